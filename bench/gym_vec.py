"""smolbench.gym speed, side by side in one run: CartPole at 16 envs and fresh vs in-place resets.

``python -m bench.gym_vec`` (needs bubblewrap and the gym extra) measures, interleaved round
by round so a busy host slows every series alike:

- steps/s of CartPole-v1 with 16 envs: ``smolbench.gym.make_vec`` (16 sandbox machines),
  ``gymnasium.vector.AsyncVectorEnv`` (16 processes) and ``SyncVectorEnv`` (this process);
- the per-step overhead of ``smolbench.gym.make`` over the same env stepped here;
- episodes/s with ``reset="fresh"`` (a new branch per episode) vs ``reset="in-place"``.

Writes ``bench/results/gym.json`` and its section of ``bench/RESULTS.md``. Timings are
measurements, never test assertions.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

ROOT = Path(__file__).resolve().parent
BEGIN, END = "<!-- gym:begin -->", "<!-- gym:end -->"
CARTPOLE = functools.partial(gymnasium.make, "CartPole-v1")
NUM_ENVS = 16
STEPS = int(os.environ.get("GYM_BENCH_STEPS", "200"))  # vector steps per round
ROUNDS = int(os.environ.get("GYM_BENCH_ROUNDS", "5"))
EPISODES = int(os.environ.get("GYM_BENCH_EPISODES", "30"))  # per round, each reset mode


def vec_rate(envs: Any, steps: int, seed: int, cpu: dict[str, list[float]] | None = None) -> float:
    """Sub-env steps per second over ``steps`` vector steps of random actions; with ``cpu``,
    also the CPU milliseconds per vector step of this process and of its descendants (the
    machines, or AsyncVectorEnv's workers), appended to ``cpu["host"]`` and ``cpu["workers"]``."""
    envs.reset(seed=seed)
    rng = np.random.default_rng(seed)
    actions = [rng.integers(0, 2, NUM_ENVS) for _ in range(steps)]
    kids = _descendants(os.getpid())
    host, workers = time.process_time(), _cpu(kids)
    t = time.perf_counter()
    for a in actions:
        envs.step(a)
    rate = steps * NUM_ENVS / (time.perf_counter() - t)
    if cpu is not None:
        cpu["host"].append(1000 * (time.process_time() - host) / steps)
        now = _cpu(kids)  # those there throughout (another env's machines may have been deleted meanwhile)
        cpu["workers"].append(1000 * sum(now[k] - workers[k] for k in now.keys() & workers.keys()) / steps)
    return rate


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for task in _listdir(f"/proc/{todo.pop()}/task"):
            try:
                kids = [int(k) for k in Path(task, "children").read_text().split()]
            except OSError:
                continue
            todo += kids
            out += kids
    return out


def _listdir(path: str) -> list[str]:
    try:
        return [os.path.join(path, t) for t in os.listdir(path)]
    except OSError:
        return []


def _cpu(pids: list[int]) -> dict[tuple[int, str], float]:
    """Seconds of CPU each thread of the processes ``pids`` ran so far (those still there),
    from the scheduler's own count (/proc/PID/task/TID/schedstat, in ns): utime and stime are
    sampled at the clock tick, which misses processes that run ~50 us at a time."""
    out: dict[tuple[int, str], float] = {}
    for pid in pids:
        for task in _listdir(f"/proc/{pid}/task"):
            try:
                out[(pid, task)] = int(Path(task, "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                continue
    return out


def step_ms(env: Any, steps: int) -> float:
    """Median milliseconds of one ``env.step`` (alternating actions, reset when an episode ends)."""
    env.reset(seed=0)
    times = []
    for k in range(steps):
        t = time.perf_counter()
        out = env.step(k % 2)
        times.append(time.perf_counter() - t)
        if out[2] or out[3]:
            env.reset()
    return 1000 * statistics.median(times)


def episode_rate(env: Any, episodes: int) -> tuple[float, float]:
    """Episodes per second, each a reset then always-left steps until it ends (~10 steps);
    and the median milliseconds of one of those resets."""
    resets = []
    t = time.perf_counter()
    for k in range(episodes):
        r = time.perf_counter()
        env.reset(seed=k)
        resets.append(time.perf_counter() - r)
        while True:
            out = env.step(0)
            if out[2] or out[3]:
                break
    return episodes / (time.perf_counter() - t), 1000 * statistics.median(resets)


def main() -> dict[str, Any]:
    import smolbench.gym as sgym
    from smolbench import Session

    from .common import log, write_section

    series: dict[str, list[float]] = {k: [] for k in ("make_vec", "make_vec_inplace", "async", "sync", "make_ms", "local_ms", "fresh", "in-place",
                                                     "fresh_reset_ms", "in-place_reset_ms", "inplace_host_cpu_ms",
                                                     "inplace_guest_cpu_ms", "async_host_cpu_ms", "async_worker_cpu_ms")}
    folder = tempfile.mkdtemp(prefix="smolbench-gym-bench-")
    started, load_before = time.time(), os.getloadavg()
    with Session(backend="sandbox", ledger=os.path.join(folder, "ledger.db")) as s:
        ours = sgym.make_vec(CARTPOLE, NUM_ENVS, session=s)
        ours_inplace = sgym.make_vec(CARTPOLE, NUM_ENVS, session=s, reset="in-place")
        theirs_async = gymnasium.vector.AsyncVectorEnv([CARTPOLE] * NUM_ENVS)
        theirs_sync = gymnasium.vector.SyncVectorEnv([CARTPOLE] * NUM_ENVS)
        one, here = sgym.make(CARTPOLE, session=s), CARTPOLE()
        fresh, inplace = sgym.make(CARTPOLE, session=s), sgym.make(CARTPOLE, session=s, reset="in-place")
        try:
            for r in range(ROUNDS):
                log(f"gym bench round {r + 1}/{ROUNDS}")
                series["make_vec"].append(vec_rate(ours, STEPS, r))
                ours_cpu: dict[str, list[float]] = {"host": series["inplace_host_cpu_ms"], "workers": series["inplace_guest_cpu_ms"]}
                their_cpu: dict[str, list[float]] = {"host": series["async_host_cpu_ms"], "workers": series["async_worker_cpu_ms"]}
                series["make_vec_inplace"].append(vec_rate(ours_inplace, STEPS, r, ours_cpu))
                series["async"].append(vec_rate(theirs_async, STEPS, r, their_cpu))
                series["sync"].append(vec_rate(theirs_sync, STEPS, r))
                series["make_ms"].append(step_ms(one, STEPS))
                series["local_ms"].append(step_ms(here, STEPS))
                for key, env in (("fresh", fresh), ("in-place", inplace)):
                    rate, reset_ms = episode_rate(env, EPISODES)
                    series[key].append(rate)
                    series[f"{key}_reset_ms"].append(reset_ms)
        finally:
            for env in (ours, ours_inplace, theirs_async, theirs_sync, one, fresh, inplace):
                env.close()
    shutil.rmtree(folder, ignore_errors=True)  # its ledger: the numbers go to results/gym.json
    # rates: the best round; times: the fastest; CPU per step: the median round
    best = {k: (statistics.median(v) if "_cpu_" in k else max(v) if not k.endswith("_ms") else min(v)) for k, v in series.items()}
    out = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - started, 1),
           "load_before": load_before, "load": os.getloadavg(), "cores": os.cpu_count(), "steps": STEPS, "rounds": ROUNDS, "episodes": EPISODES,
           "series": series, "best": best}
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "gym.json").write_text(json.dumps(out, indent=1))
    write_section(ROOT / "RESULTS.md", section(out), BEGIN, END)
    return out


def section(out: dict[str, Any]) -> str:
    """The gym part of RESULTS.md."""
    b = out["best"]
    ratio_async = b["async"] / b["make_vec"]
    ratio_fresh = b["in-place"] / b["fresh"]
    # the reset goal by round (each pair measured under the same load), not the best of each series
    per_reset = [f / i for f, i in zip(out["series"]["fresh_reset_ms"], out["series"]["in-place_reset_ms"])]
    reset_ratio, reset_rounds = statistics.median(per_reset), ", ".join(f"{r:.2f}×" for r in per_reset)
    load = ", ".join(f"{x:.1f}" for x in out["load"])
    before = ", ".join(f"{x:.1f}" for x in out.get("load_before", out["load"]))
    rows = "\n".join(f"| {name} | " + " | ".join(f"{x:,.1f}" for x in out["series"][key]) + f" | **{b[key]:,.1f}** |"
                     for name, key in (("`smolbench.gym.make_vec` (16 sandbox machines), steps/s", "make_vec"),
                                       ('`make_vec`, `reset="in-place"` (no branch per episode), steps/s', "make_vec_inplace"),
                                       ("`AsyncVectorEnv` (16 processes), steps/s", "async"),
                                       ("`SyncVectorEnv` (this process), steps/s", "sync"),
                                       ("`smolbench.gym.make` step, median ms", "make_ms"),
                                       ("the same env stepped here, median ms", "local_ms"),
                                       ('episodes/s, `reset="fresh"`', "fresh"),
                                       ('episodes/s, `reset="in-place"`', "in-place"),
                                       ('a `reset()` with `reset="fresh"`, median ms', "fresh_reset_ms"),
                                       ('a `reset()` with `reset="in-place"`, median ms', "in-place_reset_ms"),
                                       ("CPU per vector step, in place: this process, ms", "inplace_host_cpu_ms"),
                                       ("CPU per vector step, in place: the 16 machines, ms", "inplace_guest_cpu_ms"),
                                       ("CPU per vector step, `AsyncVectorEnv`: this process, ms", "async_host_cpu_ms"),
                                       ("CPU per vector step, `AsyncVectorEnv`: its 16 workers, ms", "async_worker_cpu_ms")))
    head = " | ".join(f"round {i + 1}" for i in range(out["rounds"]))
    per_round = {key: ", ".join(f"{a / o:.1f}×" for a, o in zip(out["series"]["async"], out["series"][key]))
                 for key in ("make_vec", "make_vec_inplace")}
    return f"""{BEGIN}
## Gym · `smolbench.gym` (bench/gym_vec.py)

{out['when']} · sandbox backend · {out['cores']} cores, load average {before} at the start and {load} at the end
(whatever else ran on this host slowed every series alike: they are interleaved round by round) · {out['steps']} vector steps of CartPole-v1 per round, {out['episodes']} episodes per
reset mode per round, the series interleaved round by round; best of {out['rounds']} rounds (max rate, min time).

| series | {head} | best |
|---|{'---:|' * out['rounds']}---:|
{rows}

| goal | measured | status |
|---|---|---|
| `make_vec` step within 2× of `AsyncVectorEnv` at 16 envs | AsyncVectorEnv {ratio_async:.1f}× faster | **{'met' if ratio_async <= 2 else 'not met'}** |
| `make_vec` in place (the step path alone) within 2× of `AsyncVectorEnv` | AsyncVectorEnv {b["async"] / b["make_vec_inplace"]:.1f}× faster | **{'met' if b["async"] / b["make_vec_inplace"] <= 2 else 'not met'}** |
| fresh reset within 2× of in-place: the reset call | fresh {reset_ratio:.2f}× the median ms of in-place, the median of the rounds' ratios ({reset_rounds}; best round against best round {b["fresh_reset_ms"] / b["in-place_reset_ms"]:.2f}×) | **{'met' if reset_ratio <= 2 else 'not met'}** |
| fresh reset within 2× of in-place: whole episodes (the fork and deletion included) | in-place {ratio_fresh:.2f}× the episodes/s of fresh | **{'met' if ratio_fresh <= 2 else 'not met'}** |

Round by round (each series ran right after the other, so under the same load), `AsyncVectorEnv` was
{per_round["make_vec"]} faster than `make_vec` with fresh resets and {per_round["make_vec_inplace"]} faster than in place.

Per-step overhead of a machine-backed env: {b['make_ms'] - b['local_ms']:.2f} ms (median `make` step minus the
same env's step here). Each episode's machine runs one serving cell that answers every step on one kept
connection. A vector step writes all 16 requests, then waits once for all 16 answers: each connection is an
asyncio protocol that parses its answers as the bytes arrive (no stream reader, no task per sub-env), and a
step answers in a lean form (the observation as `.npy`, the info as pulled data, flags for terminated and
truncated), checked by the gate like any reply and against the rebuilt spaces (the Box check runs once for
all 16). CPU per in-place vector step (rows above): this process {b["inplace_host_cpu_ms"]:.1f} ms and the machines
{b["inplace_guest_cpu_ms"]:.1f} ms, where `AsyncVectorEnv` takes {b["async_host_cpu_ms"]:.1f} ms here and {b["async_worker_cpu_ms"]:.1f} ms in its workers: on 2
cores the step is CPU-bound, and this process's share is what is left to cut.

How a step runs now: the guest reads a Discrete step request and writes a step that goes on with
an empty info without JSON (the same bytes JSON would make); the host takes that form with one
strict match (gate/channel.py), its writes and reads on the caller's thread (one poll for all 16);
an episode's end and an in-place autoreset are checked there too, and their ledger rows written on
the loop just after the step, in one transaction (so a finished episode reaches the ledger a moment
after the step returns, not before); in place, at most 10 ms after it, with those of the steps in
between (gathered since
2026-12-04: one wake of the loop and one commit per step were ~20% of this process's CPU, host CPU
per in-place vector step 0.87-0.90 -> 0.66-0.67 ms, `AsyncVectorEnv` 1.74-1.92x -> 1.54-1.58x
faster in an A/B on the quiet host). The guest waits for a request in `poll()`, not a blocking
`recv()`: the host reading its last answer frees its socket's send space, and the kernel's wake-up
for that woke a reader asleep in `recv()` for nothing (per vector step, ~4.7% of this process's
CPU and a context switch in each machine). History: 5.0-6.0 ms of host CPU per vector step at main
b70f802 (asyncio streams and a task per sub-env, the gate's JSON path, np.save headers).

How a fresh reset runs now: it takes one of 16 spare branches (one per sub-env past 16, at most 32)
made ahead of time, whose serving cell waits on its connection and has taken ahead the pages a
*practice* episode made its own (gym/practice.py: once per env, in a branch no real episode runs in);
when an episode ends, the spare its reset will take is woken (a line it doesn't answer); the reset
is one request from the caller's thread, and the last machine's deletion and the refill start after
it returns. An in-place reset is the same request on the env's own connection. Gymnasium's
passive env checker (in every `gymnasium.make` env) checks an env's first reset and steps once; a
spare is a copy of the warm parent's never-reset env, so until 4a8972c it checked again in every
fresh episode (the env's reset in a spare 0.34 ms, 0.16 ms without it, 0.10 ms in place, guest
timestamps); spares made after the practice episode, which ran those checks, count them as done.
What is left between them is the spare's first request in a process that has not run for a while
(its seeding, the env's reset and the answer each ~40-50 us slower than in a machine that just
stepped) and the background work fresh episodes make (refills, deletions) on the same 2 cores; left
idle 100 ms, both kinds of reset take ~1.4 ms. Measured 2026-12-03 with that background work held
off (48 spares made ahead, 20 episodes measured, no refill or deletion among them; a probe, not this
bench): fresh 0.93-1.16 ms against 0.57-0.66 ms in place, **1.75×** (4 rounds); with it, in the
same probe, 4.3×. The spare's reset itself takes no page faults (counted: 0); waking it from the
caller's thread, or keeping it polling after the wake, made no difference. So on these 2 cores the
reset goal is held back by what each fresh episode costs the others. A fresh episode also costs its fork and the last
machine's deletion (~22 ms of CPU an episode in all, against 2.4 ms in place, measured over 200
episodes): CartPole's random-action episodes (~10-20 steps) are
short, so `make_vec` with `reset="fresh"` is bound by how fast the warm parent forks (compare the
in-place row). Since 61bf85e a refill's spares (half of them at once) are leaf branches, one process
each with no keeper (guest/leaves.py; about a quarter less CPU per branch in a fork of 16): measured
2026-12-03 20:30 this moved fresh episodes/s from ~100 to ~109 and left the fresh reset at ~2.1× in
place, within this bench's round-to-round spread; a fresh episode's serving cell, its pages taken
ahead and its deletion are unchanged, and on 2 cores they still run beside the next reset. Tried
too, in probes (not kept): a spare's cgroup at the lowest CPU weight until its episode takes it
(resets then waited for spares: 4.5×), the taken spare's weight raised (2.8-3.5×), a shorter GIL
switch interval (2.2-2.5×), no read-only pages taken ahead (2.3×), none at all (2.5-3.0×).
With no other work on the host (load figures from 22:35 on are these benches' own, back to back),
2026-12-03 22:17-22:55, 17 runs of this bench: the fresh reset 1.76-2.63× in place (median 2.13×);
interleaved, the code before and after 2c11d4d (a leaf makes its own net namespace)
2.13, 2.19, 2.52, 1.99× against 2.03, 2.63, 2.33, 1.97×: no difference, all spread. `AsyncVectorEnv`
got faster on the quiet host (17-21k steps/s, was ~14-15k under load) and `make_vec` in place less
so (9-11k): 1.7-2.0× apart. This process's CPU per in-place vector step (~1.0 ms, perf on its
main thread over 3,700 steps): 38% system calls (16 writes, each waking a machine's process, 11.6%;
the poll that waits for the 16 answers 13.6%, most of it the switch back; 16 reads 7.5%; futexes
4.4%: the loop thread woken for the ledger rows of the episodes that ended), the rest Python
(base64 and `.npy` of 16 observations, the strict match of 16 lean steps, the spaces' check, two
`np.stack`s). 2026-12-04, quiet host, after the two changes above (a poll in the guest, in-place
records gathered; the loop thread had been 25% of this process's CPU in an in-place step): five runs
of this bench, `make_vec` in place 12.0-13.6k steps/s against `AsyncVectorEnv` 19.9-22.8k,
1.47-1.77× (this process 0.77-0.82 ms of CPU a vector step against its 0.34-0.37). An in-place
reset no longer wakes the loop either, and went from ~0.33 to 0.26-0.27 ms; a fresh one is
unchanged at 0.68-0.85 ms, so the reset ratio is now 2.6-3.3× (the median of each run's rounds),
further from the goal because the in-place side got faster. Gathering a fresh episode's records
too changed nothing in a probe (its reset is held up by the fork and deletion work, not the
records), and they stay written at once: a fresh episode is a branch. Split by timestamps taken in
the guest around the env's own reset (2026-12-04 10:50, a probe: one `make` env each way, 30 seeded
episodes a series, A/B interleaved 4 times): a fresh reset 0.65-0.78 ms against 0.26-0.33 in place;
the request's way in (the host's send, the spare's wake, its seeding) 0.23-0.35 against 0.11-0.14
ms, the env's reset 0.09-0.11 against 0.035-0.05, the answer's way back 0.22-0.31 against
0.10-0.13: every part about twice as slow in the spare, not one step that could go. Tried there and
not kept: the loop woken for the last machine's retirement after the answer was checked, not
before (no change: not the GIL); a fresh episode's records gathered as in-place ones are (the way
back 0.33-0.40 ms, worse); a rehearsal in the next spare right after the previous reset, its
answer's encoding and a walk of 3,000 of the env's objects (no change). Where a fresh episode's
CPU goes (2026-12-04 12:30, quiet host, probes: /proc/stat over 300 vector steps of `make_vec` at
16, fresh minus in place, over the ~200 episodes that ended): 13.7-15.9 ms of CPU an episode, the
kernel process 2.3 ms of it; a `--keep none` fork of 16 from a parent that imported gymnasium and
made CartPole costs 8.1-8.7 ms a branch (6.2-6.9 from a bare parent), so the branch is most of it
and the serving cell, the episode's first touches and its records the rest; taking the practice
pages ahead is ~1.5 ms of it (without: 13.1-14.3 ms, and resets 1.5-1.8 ms instead of 0.8-0.9).
At ~1.5 ms of CPU an episode for the step goal, a branch per episode can't get there on 2 cores.
2026-12-05 06:48 (load ~9): every sub-env now draws its own numbers (a machine's
first reset gives `np_random` a new stream unless seeded or carried, and reseeds the generators the
env keeps itself). Its first version walked the env's attributes in every branch: A/B interleaved 3
times against 3b7fef0, a fresh reset took 1.07-1.09 ms against 0.88-0.96 (the walk's first touches
of shared pages). The generators are now found once, in the warm parent, and a branch reseeds only
those: 0.90-1.07 ms against 0.91-1.01, the same within the noise. `make_vec` in place, interleaved
the same way: 9.8-10.2k steps/s against 10.0-11.0k (1.65-1.83x `AsyncVectorEnv` against
1.59-1.65x; host CPU a vector step 0.92-0.95 against 0.88-0.93 ms): the actions' new check (a Box
cast to its dtype, no bounds) is at most a few percent.
2026-12-05 21:23 (load 3-5, other work on the host; a probe, not this bench): image observations,
16 sub-envs of `Box(0, 1, (3, 84, 84), float32)` in place, the gate's lean path before and after
d257a69/3ff8022 swapped in the same process and interleaved over 6 rounds: 168 -> 242 vector
steps/s (median; the per-round ratio's median 1.41x), this process's CPU a vector step 4.09 -> 2.78
ms, `AsyncVectorEnv` 875 (shared memory) and 733 (without): 5.0x -> 3.8x faster (CartPole in the
same run unchanged, 0.51 ms either way). The lean step's check had run a pattern over the
observation's whole base64 (a third of the host's time); it now matches the fixed head and the
tail and leaves the base64 to binascii's strict decode (the same frames taken: tests/test_gate_lean.py),
and the Box check compares each observation's least and greatest item when the bounds are the same
everywhere. What is left is mostly that decode (`a2b_base64`, ~130 us an 84 KB observation, ~2.2 ms
of the 2.8; `a2b_hex` takes ~38 us, at 1.5x the bytes: a change of the wire's lean form, not made).
{END}"""


if __name__ == "__main__":
    print(json.dumps(main()["best"], indent=1))
