"""Output floods through ``%%smol`` (issue 9): batching, the per-cell budget, Ctrl-C.

    python -m bench.flood            # writes bench/results/flood.json, regenerates RESULTS.md

Every stage runs in a real ipykernel driven by nbclient, which (like a browser) takes
every output message before a cell counts as done, so times are what a user waits:

* ``lines_20k``: ``for i in range(20000): print(i)`` as a local cell and as a
  ``%%smol`` cell, interleaved, 5 of each (goal: ``%%smol`` within 2x of local).
* ``million``: 1,000,000 lines of 100 bytes through ``%%smol`` (the per-cell budget shows
  5 MB, the rest goes to a bounded log): time to finish.
* ``ctrl_c``: a cell printing 10**8 such lines (still pouring out at any host speed)
  interrupted (Jupyter's interrupt) after 2 s: seconds from the interrupt until the cell
  returns (goal: within 2 s).
* ``huge_line``: ``print('x' * 10**8)``: time, and that it is cut with a note.
* ``displays_100k`` (issue 17): ``display(i)`` 100,000 times: time, displays shown (the
  per-cell cap, 200) and whether any reached the next cell (run on another machine).
* ``ctrl_c_displays`` (issue 17): a cell doing ``display(i); print(i)`` 10**7 times with the
  cap raised to 1,000,000, interrupted after 1 s: seconds from the interrupt until the cell
  returns (goal: within 2 s; the audit measured 73 s before), and what spilled after.

``python -m bench.flood displays`` runs only the two display stages (merged into the
existing flood.json).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench.common import RESULTS, machine_info  # noqa: E402

LOCAL_20K = "for i in range(20000):\n    print(i)"
SMOL_20K = "%%smol\n" + LOCAL_20K
MILLION = "%%smol\nfor i in range(10**6):\n    print('y' * 99)"
FLOOD = "%%smol\nfor i in range(10**8):\n    print('y' * 99)"
HUGE = "%%smol\nprint('x' * 10**8)"
DISPLAYS = "%%smol\nfor i in range(100_000):\n    display(i)"
DISPLAY_FLOOD = "%%smol\nfor i in range(10**7):\n    display(i)\n    print('line', i)"
MINE = "%%smol\nprint('mine')"


def _timed(nb: Any, src: str) -> tuple[float, Any]:
    t0 = time.perf_counter()
    cell = nb.run(src)
    return time.perf_counter() - t0, cell


def _text(cell: Any, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == name)


def _displays(cell: Any) -> int:
    return sum(1 for o in cell.outputs if o.output_type == "display_data")


def display_stages(nb: Any) -> dict[str, Any]:
    """Issue 17: a display flood is capped, stays in its cell, and Ctrl-C answers."""
    out: dict[str, Any] = {}
    nb.run("%%smol fork 1 --keep all\npass")
    t, cell = _timed(nb, DISPLAYS)
    nb.run("%smol use root.0")
    after = nb.run(MINE)
    out["displays_100k"] = {"seconds": t, "shown": _displays(cell), "note": _text(cell, "stderr").strip(),
                            "spilled_into_next_cell": _displays(after) + (_text(after) != "mine\n")}
    nb.run("%smol use root")
    nb.run("%smol config displays 1000000")
    timer_at: list[float] = []

    def interrupt() -> None:
        timer_at.append(time.perf_counter())
        nb.interrupt()

    timer = threading.Timer(1.0, interrupt)
    timer.start()
    t0 = time.perf_counter()
    cell = nb.run(DISPLAY_FLOOD)
    ended = time.perf_counter()
    timer.join()
    after = nb.run(MINE)
    out["ctrl_c_displays"] = {"interrupt_to_return_s": ended - timer_at[0], "cell_s": ended - t0,
                              "shown": _displays(cell),
                              "ename": next((o.ename for o in cell.outputs if o.output_type == "error"), None),
                              "spilled_into_next_cell": _displays(after) + (_text(after) != "mine\n")}
    nb.run("%smol config displays 200")
    return out


def run(repeats: int = 5, only_displays: bool = False) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from nbhelpers import NotebookSession

    out: dict[str, Any] = {"machine": machine_info("sandbox")}
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp, NotebookSession(Path(tmp), timeout=600,
                                                                                   allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend sandbox")
        if only_displays:
            out.update(display_stages(nb))
            nb.run("%smol down")
            return out
        nb.run(LOCAL_20K)
        nb.run(SMOL_20K)  # warm both paths once
        local, smol = [], []
        for _ in range(repeats):
            local.append(_timed(nb, LOCAL_20K)[0])
            t, cell = _timed(nb, SMOL_20K)
            assert _text(cell).count("\n") == 20000, "every line must arrive"
            smol.append(t)
        out["lines_20k"] = {"local_s": local, "smol_s": smol, "local_median_s": statistics.median(local),
                            "smol_median_s": statistics.median(smol),
                            "ratio": statistics.median(smol) / statistics.median(local)}
        t, cell = _timed(nb, MILLION)
        out["million"] = {"seconds": t, "shown_bytes": len(_text(cell).encode()),
                          "note": _text(cell, "stderr").strip().splitlines()[-1:]}
        timer_at: list[float] = []

        def interrupt() -> None:
            timer_at.append(time.perf_counter())
            nb.interrupt()

        timer = threading.Timer(2.0, interrupt)
        timer.start()
        t0 = time.perf_counter()
        cell = nb.run(FLOOD)
        ended = time.perf_counter()
        timer.join()
        out["ctrl_c"] = {"interrupt_to_return_s": ended - timer_at[0], "cell_s": ended - t0,
                         "ename": next((o.ename for o in cell.outputs if o.output_type == "error"), None)}
        t, cell = _timed(nb, HUGE)
        out["huge_line"] = {"seconds": t, "cut_note": "line cut" in _text(cell),
                            "shown_bytes": len(_text(cell).encode())}
        out.update(display_stages(nb))
        nb.run("%smol down")
    return out


def section(d: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for ``flood.json``."""
    f = d["lines_20k"]
    c = d["ctrl_c"]
    return [
        "## Flood · output through `%%smol` (issue 9)", "",
        f"`python -m bench.flood`, {d['machine']['date'][:16]}, real ipykernel via nbclient (every output message "
        "taken before a cell counts as done). The agent sends output in batches (~5 ms / 64 KiB) and the kernel "
        "writes each run of text with one flush; the host shows at most 5 MB per cell and logs the rest.", "",
        "| stage | measured | goal |", "|---|---|---|",
        f"| 20,000 lines, local cell (median of {len(f['local_s'])}) | {f['local_median_s']:.2f} s | |",
        f"| 20,000 lines, `%%smol` (median of {len(f['smol_s'])}) | {f['smol_median_s']:.2f} s "
        f"(**{f['ratio']:.2f}×** local) | ≤ 2× local |",
        f"| 1,000,000 lines of 100 bytes, `%%smol` | {d['million']['seconds']:.1f} s, "
        f"{d['million']['shown_bytes'] / 1e6:.1f} MB shown, then `{(d['million']['note'] or [''])[0]}` | stays responsive |",
        f"| Ctrl-C 2 s into a cell printing 10⁸ such lines | returned {c['interrupt_to_return_s']:.2f} s after the interrupt "
        f"({c['ename']}) | ≤ 2 s |",
        f"| `print('x' * 10**8)` | {d['huge_line']['seconds']:.1f} s, cut with a note: {d['huge_line']['cut_note']} | "
        "no traceback |", "",
        "Before (issue 9, measured another way, so compare the ratio, not the seconds): 20,000 lines took 39.7 s "
        "vs 1.9 s locally (20×); 1M lines hung the kernel and Ctrl-C did not recover it in 200 s; the huge line "
        "gave a 117-line `Separator is not found` traceback. Here no browser renders the output: nbclient takes "
        "every message, as a frontend would, but draws nothing.", "",
        *_display_rows(d),
    ]


def _display_rows(d: dict[str, Any]) -> list[str]:
    if "displays_100k" not in d:
        return []
    a, c = d["displays_100k"], d["ctrl_c_displays"]
    when = d.get("displays_date", d["machine"]["date"])[:16]
    return [
        f"Display floods (issue 17, `python -m bench.flood displays`, {when}):", "",
        "| stage | measured | goal |", "|---|---|---|",
        f"| `display(i)` 100,000 times | {a['seconds']:.1f} s, {a['shown']} shown, then `{a['note'][:60]}…`; "
        f"spilled into the next cell: {a['spilled_into_next_cell']} | capped, nothing spills |",
        f"| Ctrl-C 1 s into `display(i); print(i)` × 10⁷ (cap raised to 1,000,000) | returned "
        f"{c['interrupt_to_return_s']:.2f} s after the interrupt ({c['ename']}, {c['shown']} displays shown); "
        f"spilled into the next cell: {c['spilled_into_next_cell']} | ≤ 2 s, nothing spills |", "",
        "Before (the audit): 10⁵ displays showed 1,155 in the cell and the rest in later cells on another "
        "machine; Ctrl-C at 1 s returned after 73 s.", "",
    ]


def main() -> int:
    if sys.argv[1:] == ["displays"]:
        data = json.loads((RESULTS / "flood.json").read_text())
        part = run(only_displays=True)
        data.update({k: v for k, v in part.items() if k != "machine"})
        data["displays_date"] = part["machine"]["date"]
    else:
        data = run()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "flood.json").write_text(json.dumps(data, indent=2))
    from bench import report

    print("\n".join(section(data)))
    print(report.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
