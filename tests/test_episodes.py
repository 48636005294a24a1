"""Issue 27: `%%smol episodes N` from a pristine zygote, through a real kernel (sandbox backend).

Each episode is a branch of one never-used machine of the baseline, made after the Smolfile's
init commands, and deleted after: it must never see another episode's files, processes or
variables, whether the other ran before it or beside it. Init commands whose results differ
from boot to boot are detected (two boots, a fingerprint of what init left), and then, or when
the Smolfile says ``[episodes] fresh = "boot"``, every episode boots; the ledger records which.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbformat import NotebookNode
from nbhelpers import NotebookSession, agent_processes, error_text, stream_text

from smolbench import Ledger

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

EPISODE = r"""
import os, subprocess, time, smolbench_guest
def sleeping():
    out = []
    for pid in os.listdir('/proc'):
        if pid.isdigit():
            try:
                out.append(open('/proc/%s/cmdline' % pid, 'rb').read().split(b'\0')[:2])
            except OSError:
                pass
    return sum(c == [b'sleep', b'300'] for c in out)
seen = {'files': sorted(n for n in os.listdir('/workspace') if not n.startswith('.'))  # .packages: a mount
                 + sorted(n for n in os.listdir('/tmp') if n.startswith('ep')),
        'var': 'mine' in globals(), 'procs': sleeping()}
mine = SEED
open('/workspace/ep%d' % SEED, 'w').write('x')
open('/tmp/ep%d' % SEED, 'w').write('x')
child = subprocess.Popen(['sleep', '300'])   # left running: it goes with the episode
time.sleep(0.2)                               # the episodes beside it are running too
smolbench_guest.report(seen=json_dumps(seen))
reward = SEED
"""


def ok(cell: NotebookNode) -> NotebookNode:
    err = error_text(cell)
    assert not err, f"{cell.source[:60]!r} raised:\n{err}"
    return cell


def machines_alive(nb: NotebookSession) -> int:
    return agent_processes(nb)[0]


def runs(cwd: Path) -> list[dict[str, object]]:
    ledger = Ledger(cwd / ".smolbench" / "ledger.db")
    try:
        df = ledger.runs()
    finally:
        ledger.close()
    return [r for r in df.to_dict("records") if r.get("kind") == "episodes"]


def fresh_of(cwd: Path) -> list[str]:
    return [json.loads(str(r["options"])).get("fresh") if isinstance(r["options"], str) else r["options"].get("fresh")
            for r in runs(cwd)]


def session(cwd: Path, smolfile: str = "") -> NotebookSession:
    if smolfile:
        (cwd / "Smolfile").write_text(smolfile)
    nb = NotebookSession(cwd, timeout=300, allow_errors=True).__enter__()
    try:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
    except BaseException:
        nb.__exit__(None, None, None)
        raise
    return nb


@pytest.fixture
def nb(open_tmp: Path) -> Iterator[NotebookSession]:
    s = session(open_tmp, 'init = ["mkdir -p /workspace/data && echo 1 > /workspace/data/ready"]\n')
    try:
        yield s
    finally:
        s.__exit__(None, None, None)


def test_zygote_episodes_never_see_another_episodes_files_processes_or_variables(nb: NotebookSession) -> None:
    ok(nb.run("%%smol\nwarm = 1"))  # the root's own state is no episode's either
    # 12 episodes, 4 at a time: later ones start after earlier ones finished, and beside others
    for_each = "import json\njson_dumps = json.dumps\n" + EPISODE
    cell = ok(nb.run("%%smol episodes 12 --concurrency 4 --out eps\n" + for_each.replace("'var': 'mine' in globals()",
                                                                                       "'var': 'mine' in globals() or 'warm' in globals()")))
    assert "12 ok" in "\n".join(o.get("text", "") or str(o.get("data", "")) for o in cell.outputs), cell.outputs
    rows = json.loads(stream_text(ok(nb.run("import json\nprint(json.dumps(eps.to_pandas().to_dict('records'), default=str))"))))
    assert len(rows) == 12
    for row in rows:
        seen = json.loads(row["m.seen"])
        assert seen == {"files": ["data"], "var": False, "procs": 0}, (row["branch"], seen)
    assert fresh_of(nb.cwd) == ["zygote"]
    # nothing left behind: the root and the zygote only, no episode's machine or its sleep
    assert machines_alive(nb) == 2
    assert not any(p.cmdline.startswith("sleep 300") for p in nb.processes())
    # the zygote is still pristine: the next run sees no trace of this one
    cell = ok(nb.run("%%smol episodes 2 --out again\nimport os\n"
                     "smolbench_guest.report(files=str(sorted(n for n in os.listdir('/workspace') if n[0] != '.')))"))
    rows = json.loads(stream_text(ok(nb.run("print(json.dumps(again.to_pandas().to_dict('records'), default=str))"))))
    assert [r["m.files"] for r in rows] == ["['data']", "['data']"]


def test_zygote_episodes_are_made_a_wave_ahead_and_run_at_most_concurrency_at_once(nb: NotebookSession) -> None:
    """Episodes from the zygote are forked a wave ahead of their cells (a fork is cheap, and
    16 episodes then cost what a fork of 16 does, bench/scale.py): at most 3 x --concurrency
    machines alive, and --concurrency cells running, at any moment."""
    cell = ok(nb.run("%%smol episodes 12 --concurrency 2 --bg --out bgeps\n"
                     "import time\nstarted = time.time()\ntime.sleep(0.4)\n"
                     "smolbench_guest.report(started=started, ended=time.time())\nreward = SEED"))
    most = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        most = max(most, machines_alive(nb) - 2)  # less the root and the zygote
        if stream_text(nb.run("print(bgeps.done())")).strip() == "True":
            break
        time.sleep(0.02)
    rows = json.loads(stream_text(ok(nb.run("import json\nprint(json.dumps(bgeps.to_pandas().to_dict('records'), default=str))"))))
    assert len(rows) == 12 and {r["status"] for r in rows} == {"ok"}, rows
    spans = [(float(r["m.started"]), float(r["m.ended"])) for r in rows]
    at_once = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert at_once <= 2, spans
    assert 3 <= most <= 6, most  # made ahead while 2 ran: 6 at most
    assert cell is not None


@pytest.mark.parametrize("where", ["/workspace/id", "/tmp/id"])
def test_nondeterministic_init_is_detected_and_the_episodes_boot(open_tmp: Path, where: str) -> None:
    """Init writes a random id; two boots differ, so episodes boot. In /tmp too (seventh audit:
    only the workspace was compared, so every episode got the zygote's one random target)."""
    nb = session(open_tmp, f'init = ["python3 -c \\"import uuid; open(\'{where}\', \'w\').write(uuid.uuid4().hex)\\""]\n')
    try:
        cell = ok(nb.run(f"%%smol episodes 3 --out eps\nreward = len(open('{where}').read())"))
        text = stream_text(cell) + stream_text(cell, "stderr")  # the notebook's notices: one line of output
        assert "different files or variables in two boots" in text and 'fresh = "boot"' in text, text
        assert fresh_of(nb.cwd)[0].startswith("boot (the Smolfile's init commands left different")
        assert machines_alive(nb) == 1  # no zygote kept for this baseline
    finally:
        nb.__exit__(None, None, None)


def test_fresh_boot_in_the_smolfile_boots_every_episode_and_is_recorded(open_tmp: Path) -> None:
    nb = session(open_tmp, '[episodes]\nfresh = "boot"\n')
    try:
        ok(nb.run("%%smol episodes 2 --out eps\nreward = SEED"))
        assert fresh_of(nb.cwd) == ['boot (the Smolfile says [episodes] fresh = "boot")']
        assert machines_alive(nb) == 1
    finally:
        nb.__exit__(None, None, None)
