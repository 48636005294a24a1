"""Episodes from a pristine zygote: one never-used machine per baseline, each episode a branch of it.

``%%smol episodes N`` wants N fresh machines of the Smolfile's baseline. Booting each costs a
machine's start and its init commands; a branch of a machine that booted the same baseline and
ran the same init commands, and nothing else, is the same machine at a fork's cost. The zygote
runs no cell but the init commands (and a look at what they left); each episode is a branch of it (its own files, processes,
namespace and seed), deleted afterwards, so no episode ever sees another's state.

That is only the same as a fresh boot when the init commands give the same result every time.
So before the first use, a second machine boots and runs them too, and a branch of each hashes
what init left behind (the files of the workspace, /tmp and the home folder, and the namespace's
variables, addresses left out; a check that fails counts as a difference):
if the two differ, this baseline's episodes boot fresh machines, and the notebook says why. A
branch has an empty /dev/shm and none of its parent's processes: when init left files there or a
process running (one look at the zygote itself, which leaves no name behind), episodes boot too,
saying why. The Smolfile's ``[episodes] fresh = "boot"`` always boots. Which was used goes to the
ledger.

A zygote that died (its process gone) is noticed when it is next used, or when a fork of it
fails: it is deleted and the episode's fork fails with an InfraError, so the episode's retry
makes a new zygote (an attempt in the ledger). A zygote (and its twin) boots with the same
retries as any machine (``again``: the Workbench's retries.again).

Only the sandbox backend uses a zygote: its branches are copy-on-write forks. A process-backend
branch copies the workspace and /tmp, and a microVM branch (smol) is a snapshot: neither is
cheaper than a boot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable

from ._aio import _to_the_end
from .backends._limits import fork_room
from .backends.base import Backend, CellRequest, MachineRef
from .errors import InfraError
from .gate.frames import loads as json_loads
from .gate.frames import shown
from .spec import MachineSpec

# (name, retries, once): ``once(attempt)`` again after an InfraError while attempts are left
Again = Callable[[str, int, Callable[[int], Awaitable[MachineRef]]], Awaitable[MachineRef]]

# Where a branch is a copy-on-write fork: the process backend's branches copy the workspace and
# /tmp of the host (no overlay), which costs more than its boot.
LIVE_FORK_BACKENDS = ("sandbox",)

# Runs in a branch of each candidate (never in the zygote itself): what init left behind.
FINGERPRINT = r"""
def _smolbench_fingerprint():
    import hashlib, os, re, sys
    h = hashlib.sha256()
    tops = [os.getcwd(), "/tmp"] + [os.path.expanduser("~")]  # where init can write (a home may be either)
    seen = set()
    for top in tops:
        top = os.path.realpath(top)
        if top == "/" or top in seen or any(top.startswith(s + "/") for s in seen):
            continue
        seen.add(top)
        for folder, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                    h.update(path.encode("utf-8", "surrogateescape") + b"\0%d\0" % st.st_size)
                    if os.path.isfile(path) and not os.path.islink(path):
                        with open(path, "rb") as fh:  # all of it; of a big file its first and last 16 MiB
                            h.update(fh.read(16 << 20))
                            if st.st_size > 32 << 20:
                                fh.seek(-(16 << 20), 2)
                            h.update(fh.read(16 << 20))
                except OSError:
                    pass
    ns = sys.modules["__main__"].__dict__
    for key in sorted(ns):
        if (key.startswith("__") and key.endswith("__")) or key.startswith("_smolbench") \
                or key in ("display", "smolbench_guest", "SEED"):
            continue
        try:
            text = repr(ns[key])[:100000]
        except Exception:
            text = type(ns[key]).__name__
        h.update(key.encode() + b"=" + re.sub(r" at 0x[0-9a-fA-F]+", "", text).encode("utf-8", "replace") + b"\0")
    return h.hexdigest()
_smolbench_fingerprint()
"""


# Runs in the zygote itself after init (and leaves no name): what a branch would not have, a
# process init left running (a branch has none of its parent's) or files in /dev/shm (a branch's
# is empty). The agent is the pid namespace's only process otherwise.
LEFT_RUNNING = r"""
def _smolbench_left():
    import json, os
    procs = []
    for pid in os.listdir('/proc'):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open('/proc/%s/stat' % pid) as fh:
                state = fh.read().rsplit(')', 1)[1].split()[0]
            with open('/proc/%s/comm' % pid) as fh:
                comm = fh.read().strip()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if state not in 'ZXx':
            procs.append(comm)
    try:
        shm = sorted(os.listdir('/dev/shm'))
    except OSError:
        shm = []
    return json.dumps({'procs': sorted(procs), 'shm': shm})
print(_smolbench_left())
del _smolbench_left
"""


@dataclasses.dataclass
class Verdict:
    """How this baseline's episodes start: from ``zygote`` (a machine), or fresh boots (why)."""

    zygote: MachineRef | None
    fresh: str  # "zygote" | "boot (...why...)": recorded in the ledger
    surprise: bool = False  # boots although a zygote was asked for: the notebook says why

    @property
    def note(self) -> str | None:
        """The one line the notebook shows when episodes boot although a zygote was wanted."""
        return f"smolbench: episodes {self.fresh}" if self.surprise else None


def _plain_names(names: list[str]) -> list[str]:
    """The first 5 of a machine's names, each as it is if short plain text, else quoted safe."""
    return [n if n.isprintable() and len(n) <= 60 else shown(n) for n in names[:5]]


class Zygotes:
    """One kernel's zygotes, a machine per baseline (they are none of the tree's nodes)."""

    def __init__(self, backend: Backend, init: Callable[[MachineRef], Awaitable[None]], again: Again | None = None) -> None:
        self.backend = backend
        self._init = init
        self._again = again
        self._made: dict[str, Verdict] = {}
        self._lock = asyncio.Lock()  # one zygote made at a time
        self._branch_locks: dict[str, asyncio.Lock] = {}  # one fork of a zygote at a time (its agent's rule)
        self._waiting: dict[str, list[tuple[str, int | None, asyncio.Future[MachineRef]]]] = {}
        self._count = 0
        self._closed = False  # close() started: no zygote is made any more

    async def verdict(self, spec: MachineSpec, baseline: str, retries: int = 0) -> Verdict:
        """The zygote of this baseline, made (and checked) at first use, and again when it died;
        its boots are tried ``retries`` more times after an InfraError."""
        if spec.episodes_fresh == "boot":
            return Verdict(None, 'boot (the Smolfile says [episodes] fresh = "boot")')
        if self.backend.name not in LIVE_FORK_BACKENDS:
            return Verdict(None, f"boot (the {self.backend.name} backend's branches cost a boot)")
        async with self._lock:
            if self._closed:
                raise InfraError("the session is going down: no zygote is made for these episodes")
            known = self._made.get(baseline)
            if known is not None and (known.zygote is None or self._alive(known.zygote)):
                return known
            if known is not None and known.zygote is not None:  # it died: what is left of it goes
                self._made.pop(baseline, None)
                await _to_the_end(self._delete(known.zygote))
            self._made[baseline] = made = await self._make(dataclasses.replace(spec, branch=True), retries)
            return made

    def _alive(self, zygote: MachineRef) -> bool:
        """Still the backend's, and its process still there (the host's list says only the first)."""
        return any(m.name == zygote.name for m in self.backend.list()) and not self.backend.gone([zygote])

    async def _make(self, spec: MachineSpec, retries: int) -> Verdict:
        zygote = await self._boot(spec, retries)
        if not spec.init:
            return Verdict(zygote, "zygote")
        try:
            left = await self._left_behind(zygote)
        except BaseException:
            await self._delete(zygote)
            raise
        if left:
            await self._delete(zygote)
            return Verdict(None, f"boot (the Smolfile's init commands left {left}, which a branch of a zygote would not "
                                 "have, so each episode boots its own machine)", surprise=True)
        try:
            twin = await self._boot(spec, retries)
        except BaseException:
            await self._delete(zygote)
            raise
        try:
            prints = [await self._fingerprint(m) for m in (zygote, twin)]
        except BaseException:
            await self._delete(zygote)
            raise
        finally:
            await self._delete(twin)
        if None in prints:  # not checked is not the same: boot
            await self._delete(zygote)
            return Verdict(None, "boot (the check that the Smolfile's init commands leave the same files and variables "
                                 "in two boots failed, so each episode boots its own machine; [episodes] fresh = "
                                 '"boot" in the Smolfile says so without the check)', surprise=True)
        if prints[0] != prints[1]:
            await self._delete(zygote)
            return Verdict(None, "boot (the Smolfile's init commands left different files or variables in two boots, "
                                 'so each episode boots its own machine; [episodes] fresh = "boot" in the Smolfile says so '
                                 "without the check)", surprise=True)
        return Verdict(zygote, "zygote")

    async def _boot(self, spec: MachineSpec, retries: int) -> MachineRef:
        self._count += 1
        name = f"zygote{self._count}"

        async def once(attempt: int) -> MachineRef:
            ref = await self.backend.create(spec, name)
            ref.info["attempts"] = attempt
            try:
                await self._init(ref)
            except BaseException:
                await self._delete(ref)
                raise
            return ref

        return await (once(1) if self._again is None else self._again(name, retries, once))

    async def _left_behind(self, zygote: MachineRef) -> str | None:
        """What init left that a branch would not have: "a process running (sleep)", "files in
        /dev/shm (r)", both, or None. A look that fails says so (not checked is not the same)."""
        res = await self.backend.exec_cell(zygote, CellRequest(LEFT_RUNNING, cell_name="<init left>"), lambda e: None)
        try:  # the machine's answer: read as any machine's JSON, its names shown as plain text
            seen = json_loads(res.stdout.strip().splitlines()[-1]) if res.status == "ok" else None
        except (ValueError, IndexError):
            seen = None
        procs, shm = (seen.get("procs"), seen.get("shm")) if isinstance(seen, dict) else (None, None)
        if not isinstance(procs, list) or not isinstance(shm, list):
            return "something the check of what they left running could not see (it failed)"
        said = []
        if procs:
            names = ", ".join(_plain_names(sorted(set(map(str, procs)))))
            said.append(f"{'a process' if len(procs) == 1 else 'processes'} running ({names})")
        if shm:
            said.append(f"files in /dev/shm ({', '.join(_plain_names([str(n) for n in shm]))})")
        return " and ".join(said) or None

    async def _fingerprint(self, ref: MachineRef) -> str | None:
        probe = (await self.branch(ref, "fp", None))
        try:
            res = await self.backend.exec_cell(probe, CellRequest(FINGERPRINT, cell_name="<fingerprint>"), lambda e: None)
        finally:
            await self._delete(probe)
        return (res.result or {}).get("text/plain") if res.status == "ok" else None

    async def branch(self, zygote: MachineRef, name: str, seed: int | None) -> MachineRef:
        """A new branch of ``zygote`` for one episode. The episodes that ask while a fork of the
        zygote is under way are forked together by the next one (one request for all of them)."""
        done: asyncio.Future[MachineRef] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(zygote.name, []).append((name, seed, done))
        try:
            await self._fork_waiting(zygote)
            return await done
        except asyncio.CancelledError:
            if done.done() and not done.cancelled() and done.exception() is None:  # made for us: it goes
                await _to_the_end(self._delete(done.result()))
            done.cancel()  # a later fork leaves it out
            raise

    async def _fork_waiting(self, zygote: MachineRef) -> None:
        async with self._branching(zygote):
            await asyncio.sleep(0)  # the episodes let in with this one ask in this turn: one fork for all
            waiting = [b for b in self._waiting.get(zygote.name, []) if not b[2].done()]
            # No more than the host holds (an audit: a refused wave failed every episode in it); the
            # rest are the next fork's: their own calls wait for this lock (ours is the oldest asking).
            room = fork_room()
            take = len(waiting) if room is None else min(len(waiting), max(1, room))
            batch, self._waiting[zygote.name] = waiting[:take], waiting[take:]
            if batch:
                try:
                    if self.backend.gone([zygote]):  # a fork of it would wait for an answer in vain
                        raise InfraError(f"{zygote.name} is gone")  # _died says why
                    refs = await self.backend.branch(zygote, [n for n, _, _ in batch], [s for _, s, _ in batch],
                                                     leaf=True)  # an episode's machine is never forked
                except Exception as exc:
                    failed = await self._died(zygote, exc)
                    for _, _, fut in batch:  # ours too: its ``await`` raises it (none is left unretrieved)
                        if not fut.done():
                            fut.set_exception(failed)
                    return
                except BaseException:  # we were cancelled: the others wait for the next fork
                    self._waiting[zygote.name] = batch + self._waiting[zygote.name]
                    raise
                by_name = {r.name: r for r in refs}
                for name, _, fut in batch:
                    if fut.done():  # its episode was cancelled meanwhile
                        await self._delete(by_name[name])
                    else:
                        fut.set_result(by_name[name])

    async def _died(self, zygote: MachineRef, exc: Exception) -> Exception:
        """A fork of ``zygote`` failed with ``exc``: if the zygote's process is gone, it is dropped
        (what is left of it deleted) and an InfraError says so, for the episode's retry to make a
        new one; else ``exc`` as it was."""
        dead = self.backend.gone([zygote])
        if not dead:
            return exc
        for baseline, known in list(self._made.items()):
            if known.zygote is not None and known.zygote.name == zygote.name:
                del self._made[baseline]
        await _to_the_end(self._delete(zygote))
        return InfraError(f"the episodes' zygote {zygote.name} died ({dead[zygote.name]}); a retry boots a new one")

    def _branching(self, zygote: MachineRef) -> asyncio.Lock:
        return self._branch_locks.setdefault(zygote.name, asyncio.Lock())

    async def _delete(self, ref: MachineRef) -> None:
        with contextlib.suppress(Exception):
            await self.backend.delete(ref)

    async def close(self) -> None:
        """Delete every zygote (``%smol down``); none is made after (one being made is awaited)."""
        self._closed = True
        async with self._lock:
            made, self._made = list(self._made.values()), {}
        for verdict in made:
            if verdict.zygote is not None:
                await self._delete(verdict.zygote)
