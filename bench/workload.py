"""The B2 workload: a CPU-bound pure-Python setup that builds a table, then cheap seeded rollouts.

Both are the same LCG loop, so one calibration (ns per iteration, measured on
this host with this interpreter) sizes the setup to S seconds and a rollout to r
seconds. The same source text runs locally, in smolbench machines and on
ipyparallel engines, and every variant must return the same reward per seed.
"""

from __future__ import annotations

import statistics
import time

FUNCS = '''
def build_table(iters):
    t = [0] * 65536
    x = 1
    for _ in range(iters):
        x = (x * 1103515245 + 12345) & 0x7fffffff
        t[(x >> 15) & 0xffff] += 1
    return t


def rollout(table, seed, iters):
    x = seed + 1
    acc = 0
    for _ in range(iters):
        x = (x * 1103515245 + 12345) & 0x7fffffff
        acc = (acc + table[(x >> 15) & 0xffff]) & 0xffffffff
    return acc
'''


def setup_code(setup_iters: int) -> str:
    """The setup cell: define the functions, build the table (S seconds of CPU)."""
    return f"{FUNCS}\ntable = build_table({setup_iters})\n"


def rollout_code(roll_iters: int) -> str:
    """The rollout cell: one seeded rollout (r seconds of CPU), its reward."""
    return f"reward = rollout(table, SEED, {roll_iters})\n"


def timed(body: str, name: str) -> str:
    """``body`` followed by ``name = <main-thread CPU seconds it took>`` (time.thread_time: the
    cell's own CPU, page faults included, not time spent waiting for a core)."""
    return f"import time as _bt\n_bc0 = _bt.thread_time()\n{body}\n{name} = _bt.thread_time() - _bc0\n"


REPORT = "import smolbench_guest as _bg\n_bg.report(cpu=_b_roll_cpu, setup_cpu=_b_setup_cpu)\n"


def calibrate(target_s: float, probe_iters: int = 1_500_000, repeats: int = 3) -> dict[str, float]:
    """CPU seconds per iteration of each loop on this host (median of ``repeats``)."""
    ns: dict[str, object] = {}
    exec(FUNCS, ns)
    build, roll = ns["build_table"], ns["rollout"]
    bs, rs = [], []
    table = build(1000)  # type: ignore[operator]
    for _ in range(repeats):
        # CPU time, not wall time: other tenants of a shared host must not inflate the sizes.
        t0 = time.thread_time()
        build(probe_iters)  # type: ignore[operator]
        bs.append((time.thread_time() - t0) / probe_iters)
        t0 = time.thread_time()
        roll(table, 7, probe_iters)  # type: ignore[operator]
        rs.append((time.thread_time() - t0) / probe_iters)
    return {"build_s_per_iter": statistics.median(bs), "rollout_s_per_iter": statistics.median(rs)}
