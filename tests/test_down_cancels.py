"""A fan-out still running when its machines are taken down is cancelled, not crashed; and a
Ctrl-C of a background fork's `.wait()` says the fork goes on.

A user's kernel: `%%smol fork 8 --bg --out hc`, then `%smol down`: every row of `hc` said
"machine root.40 died mid-cell: its process exited before finishing", the ledger rows were
`error`, where shutting the kernel down with the fork running recorded them cancelled.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from nbhelpers import NotebookSession, error_output, ok, plain_texts, stream_text

import smolbench
from smolbench import Ledger


def held(folder: Path) -> str:
    """A branch's cell: says it started (a file per seed), then waits for a file that never comes."""
    return (f"import os, time\nopen(os.path.join({str(folder)!r}, 'started-%d' % SEED), 'w').close()\n"
            f"while not os.path.exists(os.path.join({str(folder)!r}, 'go')):\n    time.sleep(0.05)\nreward = SEED")


def until_started(folder: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("started-*"))) < n:
        assert time.monotonic() < deadline, f"{n} branches never started"
        time.sleep(0.05)


def statuses(folder: Path, prefix: str = "root.") -> dict[str, tuple[str, str]]:
    ledger = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        df = ledger.nodes()
    finally:
        ledger.close()
    return {r.id: (r.status, r.error) for r in df.itertuples() if r.id.startswith(prefix)}


def test_smol_down_cancels_a_background_fork_and_its_wait_says_cancelled(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    with NotebookSession(tmp_path) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend process"))
        ok(nb.run(f"%%smol fork 4 --bg --out hc\n{held(gate)}"))
        until_started(gate, 4)
        down = ok(nb.run("%smol down"))
        waited = nb.run("hc.wait()\nprint(hc.done(), sorted({(r['status'], r['error']) for r in hc}))")
    assert error_output(waited) is None, waited.outputs  # as after hc.cancel(): the wait returns
    assert stream_text(waited) == "True [('cancelled', 'cancelled')]\n"
    assert "cancelled 1 running fan-out first" in stream_text(down)
    assert stream_text(down).endswith("smolbench: deleted 5 machines\n")  # the root and the 4 branches
    assert statuses(tmp_path) == {f"root.{i}": ("cancelled", "cancelled") for i in range(4)}


def test_session_down_cancels_a_fork_running_in_another_thread(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    gate = tmp_path / "gate"
    gate.mkdir()
    s = smolbench.Session(backend="process").up()
    outcome: list[BaseException | object] = []

    def fork() -> None:
        try:
            outcome.append(s.fork(3, held(gate), allow_errors=True))
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=fork)
    t.start()
    try:
        until_started(gate, 3)
    finally:
        assert s.down() == 4
        t.join(120)
    assert not t.is_alive()
    assert statuses(tmp_path) == {f"root.{i}": ("cancelled", "cancelled") for i in range(3)}
    assert s.last_result is not None and {r["status"] for r in s.last_result} == {"cancelled"}


def test_ctrl_c_of_a_background_forks_wait_says_the_fork_goes_on(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend process"))
        ok(nb.run(f"%%smol fork 2 --bg --out hc\n{held(gate)}"))
        until_started(gate, 2)
        waiting = tmp_path / "waiting"

        def interrupt() -> None:
            try:
                deadline = time.monotonic() + 60
                while not waiting.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                nb.interrupt()

        t = threading.Thread(target=interrupt, daemon=True)
        t.start()
        cell = nb.run(f"open({str(waiting)!r}, 'w').close()\nhc.wait()")
        t.join()
        still = ok(nb.run("print(hc.done())"))
        ok(nb.run("hc.cancel(); hc.wait(); print(sorted({r['status'] for r in hc}))"))
        after = nb.run("print(hc.done(), sorted({r['status'] for r in hc}))")
        ok(nb.run("%smol down"))
    err = error_output(cell)
    assert err is not None and err.ename == "KeyboardInterrupt", cell.outputs
    assert err.traceback == ["KeyboardInterrupt: stopped waiting; the fork goes on in the background (0 of 2 done): "
                             "`hc.cancel()` stops it"]
    assert stream_text(still) == "False\n"
    assert stream_text(after) == "True ['cancelled']\n"
    assert not plain_texts(after)
