"""Where the time goes: cProfile of the stages the benchmarks found slow.

P1  a trivial ``%%smol`` cell, profiled inside the kernel on both threads that
    serve it: the kernel's main thread (the magic, its output pump) and
    smolbench's loop thread (Workbench.run_cell, the backend, the ledger).
P2  a live fork with 200 MiB of warm state: the host side of ``backend.branch`` +
    first cell (loop thread, this process), and inside the guest: os.fork() of the
    agent process itself, and a branch's start-up (``_become_child`` pieces)
    under cProfile in a forked child.
P3  ``%%smol fork 16`` of 0.2 s rollouts: the kernel's own CPU (host-side
    orchestration that competes with the branches for the 2 cores) and its profile.

cProfile files and top-30 tables go to bench/results/profile_*.txt; the numbers
that RESULTS.md quotes go to bench/results/profile.json.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import tempfile
import time
from typing import Any

from . import workload
from .b1_overhead import close_raw, raw_backend
from .common import (
    RESULTS,
    Kernel,
    close_smol_kernel,
    log,
    machine_info,
    smol_kernel,
    wait_quiet,
    write_json,
)

PROFILE_CELLS = r"""
import cProfile as _bcp, time as _bt, resource as _brs
from smolbench import _loop as _bl
_bpm, _bpl = _bcp.Profile(), _bcp.Profile()
async def _bon(p): p.enable()
async def _boff(p): p.disable()
_bl.run(_bon(_bpl))
_bru0 = _brs.getrusage(_brs.RUSAGE_SELF)
_bt0 = _bt.perf_counter()
_bpm.enable()
for _bi in range(%(n)d):
    get_ipython().run_cell_magic('smol', %(line)r, %(cell)r)
_bpm.disable()
_bwall = _bt.perf_counter() - _bt0
_bru1 = _brs.getrusage(_brs.RUSAGE_SELF)
_bl.run(_boff(_bpl))
_bpm.dump_stats(%(main)r); _bpl.dump_stats(%(loop)r)
_bprof = {'wall_s': _bwall, 'kernel_cpu_s': (_bru1.ru_utime - _bru0.ru_utime) + (_bru1.ru_stime - _bru0.ru_stime)}
"""

GUEST_FORK_FLOOR = r"""
import os as _o, time as _t
_ts = []
for _i in range(%(n)d):
    _t0 = _t.perf_counter()
    _p = _o.fork()
    if _p == 0:
        _o._exit(0)
    _ts.append(_t.perf_counter() - _t0)
    _o.waitpid(_p, 0)
sorted(_ts)[len(_ts) // 2] * 1e3
"""

GUEST_CHILD_PROFILE = r"""
import os as _o, sys as _s, time as _t, json as _j, cProfile as _cp, pstats as _ps, io as _io
_g = type(_s.modules['smolbench_guest']._agent).fork.__globals__
_r, _w = _o.pipe()
_p = _o.fork()
if _p == 0:
    _o.close(_r)
    _pr = _cp.Profile()
    _t0 = _t.perf_counter()
    _pr.enable()
    _g['_set_pdeathsig']()
    _t1 = _t.perf_counter()
    _mode = _g['_private_files']('/workspace', 'bench-probe')
    _t2 = _t.perf_counter()
    _pr.disable()
    _buf = _io.StringIO()
    _ps.Stats(_pr, stream=_buf).sort_stats('tottime').print_stats(15)
    _o.write(_w, _j.dumps({'pdeathsig_ms': (_t1 - _t0) * 1e3, 'private_files_ms': (_t2 - _t1) * 1e3,
                           'mode': _mode, 'profile': _buf.getvalue()}).encode())
    _o._exit(0)
_o.close(_w)
_chunks = []
while True:
    _c = _o.read(_r, 65536)
    if not _c:
        break
    _chunks.append(_c)
_o.close(_r); _o.waitpid(_p, 0)
print('@@CHILD@@' + b''.join(_chunks).decode())
"""


_OUT: dict[str, Any] = {"dir": RESULTS, "tmp": tempfile.gettempdir()}


def _txt(name: str) -> Any:
    """Where a profile table goes (bench/results/, or bench/results/quick/ for --quick)."""
    _OUT["dir"].mkdir(parents=True, exist_ok=True)
    return _OUT["dir"] / name


def _prof(name: str) -> str:
    """A raw cProfile dump (kept out of the repository, in a temporary directory)."""
    return f"{_OUT['tmp']}/{name}"


def _top(path: str, sort: str, n: int = 30) -> str:
    buf = io.StringIO()
    pstats.Stats(path, stream=buf).strip_dirs().sort_stats(sort).print_stats(n)
    return buf.getvalue()


def _cum(path: str, *names: str) -> dict[str, float]:
    """Cumulative seconds of functions by ``file:function`` suffix (summed over matches)."""
    st = pstats.Stats(path).stats  # type: ignore[attr-defined]
    out = {}
    for want in names:
        fname, func = want.split(":")
        out[want] = sum(v[3] for (f, _ln, fn), v in st.items() if fn == func and f.endswith(fname))
    return out


def p1_trivial_cell(backend: str, n: int) -> dict[str, Any]:
    main, loop = _prof("p1_main.prof"), _prof("p1_loop.prof")
    k: Kernel | None = None
    with tempfile.TemporaryDirectory(prefix="smolbench-prof-") as work:
        try:
            k = smol_kernel(work, backend)
            for _ in range(10):
                k.execute("%%smol\npass")
            wait_quiet(label="P1")
            k.execute(PROFILE_CELLS % {"n": n, "line": "", "cell": "pass", "main": main, "loop": loop}, timeout=600)
            meta = k.eval_json("_bprof")
        finally:
            if k is not None:
                close_smol_kernel(k)
    per = {key: v / n * 1e3 for key, v in _cum(
        main, "magics.py:_pump", "magics.py:_drain", "queue.py:get", "magic_arguments.py:parse_argstring",
        "magics.py:_run_cell").items()}
    per_loop = {key: v / n * 1e3 for key, v in _cum(
        loop, "workbench.py:run_cell", "sandbox.py:exec_cell", "ledger.py:add_cell", "sandbox.py:_open",
        "_wire.py:read_replies", "workbench.py:_record").items()}
    _txt("profile_p1_main.txt").write_text(_top(main, "cumulative"))
    _txt("profile_p1_loop.txt").write_text(_top(loop, "cumulative"))
    return {"cells": n, "wall_ms_per_cell": meta["wall_s"] / n * 1e3, "kernel_cpu_ms_per_cell": meta["kernel_cpu_s"] / n * 1e3,
            "main_thread_cum_ms_per_cell": per, "loop_thread_cum_ms_per_cell": per_loop,
            "files": ["profile_p1_main.txt", "profile_p1_loop.txt"]}


def p2_fork(backend: str, n: int) -> dict[str, Any]:
    import json

    from smolbench import _loop
    from smolbench.backends.base import CellRequest

    from .b3_fork import STATE_CODE

    be, ref = raw_backend(backend)
    out: dict[str, Any] = {"branches": n}
    try:
        _loop.run(be.exec_cell(ref, CellRequest(STATE_CODE), lambda e: None), timeout=120)
        wait_quiet(label="P2")
        # os.fork() of the agent process itself (200 MiB + the agent's threads), child exits at once.
        r = _loop.run(be.exec_cell(ref, CellRequest(GUEST_FORK_FLOOR % {"n": n}), lambda e: None), timeout=120)
        out["guest_os_fork_median_ms"] = float(r.result["text/plain"]) if r.status == "ok" and r.result else None
        # A branch's own start-up, profiled in a forked child of the agent.
        r = _loop.run(be.exec_cell(ref, CellRequest(GUEST_CHILD_PROFILE), lambda e: None), timeout=120)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("@@CHILD@@")), None)
        if line:
            child = json.loads(line[len("@@CHILD@@"):])
            _txt("profile_p2_branch_startup.txt").write_text(child.pop("profile"))
            out["branch_startup"] = child
        # Host side of branch + first cell, loop thread profiled.
        prof = cProfile.Profile()

        async def go() -> tuple[float, float]:
            prof.enable()
            t0 = time.perf_counter()
            kids = await be.branch(ref, [f"prof.{i}" for i in range(n)], list(range(n)))
            t1 = time.perf_counter()
            await asyncio.gather(*(be.exec_cell(kd, CellRequest("SEED"), lambda e: None) for kd in kids))
            t2 = time.perf_counter()
            prof.disable()
            for kd in kids:
                await be.delete(kd)
            return t1 - t0, t2 - t0

        t_req, t_ready = _loop.run(go(), timeout=300)
        path = _prof("p2_host_loop.prof")
        prof.dump_stats(path)
        _txt("profile_p2_host_loop.txt").write_text(_top(path, "tottime"))
        out.update({"fork_request_ms": t_req * 1e3, "all_running_ms": t_ready * 1e3,
                    "host_loop_cum_ms": {k: v * 1e3 for k, v in _cum(path, "sandbox.py:branch", "sandbox.py:exec_cell", "sandbox.py:_open").items()}})
    finally:
        close_raw(be, ref)
    return out


def p3_fork_rollouts(backend: str, quick: bool) -> dict[str, Any]:
    n = 16
    cal = workload.calibrate(0.2)
    r_iters = int(0.2 / cal["rollout_s_per_iter"])
    main, loop = _prof("p3_main.prof"), _prof("p3_loop.prof")
    k: Kernel | None = None
    with tempfile.TemporaryDirectory(prefix="smolbench-prof-") as work:
        try:
            k = smol_kernel(work, backend)
            k.execute(f"%%smol\n{workload.setup_code(int(0.2 / cal['build_s_per_iter']))}", timeout=120)
            wait_quiet(label="P3")
            k.execute(PROFILE_CELLS % {"n": 1, "line": f"fork {n} --quiet --keep none", "cell": workload.rollout_code(r_iters),
                                       "main": main, "loop": loop}, timeout=600)
            meta = k.eval_json("_bprof")
        finally:
            if k is not None:
                close_smol_kernel(k)
    _txt("profile_p3_main.txt").write_text(_top(main, "tottime"))
    _txt("profile_p3_loop.txt").write_text(_top(loop, "tottime"))
    loop_cum = {key: v * 1e3 for key, v in _cum(loop, "workbench.py:_record", "ledger.py:upsert_node", "ledger.py:add_cell",
                                                    "sandbox.py:branch", "sandbox.py:exec_cell", "sandbox.py:delete").items()}
    return {"branches": n, "rollout_target_s": 0.2, "wall_s": meta["wall_s"], "kernel_cpu_s": meta["kernel_cpu_s"],
            "ideal_s": n * 0.2 / 2, "loop_thread_cum_ms": loop_cum,
            "files": ["profile_p3_main.txt", "profile_p3_loop.txt"]}


def run(backend: str, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="smolbench-prof-") as tmp:
        _OUT.update(dir=RESULTS / "quick" if quick else RESULTS, tmp=tmp)
        return _run(backend, quick)


def _run(backend: str, quick: bool) -> dict[str, Any]:
    log("profile P1: trivial %%smol cell")
    p1 = p1_trivial_cell(backend, 50 if quick else 200)
    log(f"profile P1: {p1['wall_ms_per_cell']:.1f} ms/cell, pump {p1['main_thread_cum_ms_per_cell']}")
    log("profile P2: fork with 200 MiB")
    p2 = p2_fork(backend, 16)
    log(f"profile P2: {p2}")
    log("profile P3: %%smol fork 16 of 0.2 s rollouts")
    p3 = p3_fork_rollouts(backend, quick)
    log(f"profile P3: wall {p3['wall_s']:.2f} s, kernel CPU {p3['kernel_cpu_s']:.2f} s")
    data = {"benchmark": "profiles", "machine": machine_info(backend), "params": {"quick": quick},
            "p1_trivial_cell": p1, "p2_fork": p2, "p3_fork_rollouts": p3}
    write_json("profile", data, quick)
    return data
