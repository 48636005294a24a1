"""The Gymnasium env server: runs INSIDE a machine and steps one env for the host.

Stdlib only (plus what the env itself imports: gymnasium, and numpy for array
actions). ``smolbench.gym`` runs this file's source in the warm parent machine, once,
as ``_smolgym = Server(factory)``; every request after that is a one-line cell
(``_smolgym_out = _smolgym.step('<json>')``) whose result the host pulls with the
agent's own ``--pull`` encoding, or, on backends that keep a connection open, one cell per
episode that answers every step on its own connection (``Server.serve``), in the same
encoding. Either way it crosses the gate as data: observations and
arrays as ``.npy``, the rest JSON. The host trusts none of it: it rebuilds the spaces
from their description and checks every observation against them
(``smolbench/gym/spaces.py``).

Requests carry JSON text (actions: ints, floats, strings, ``{"$": "array", ...}`` raw
little-endian bytes with dtype and shape, ``{"$": "dict"|"tuple", "v": ...}``).
"""

import base64
import ctypes  # a spare's madvise: imported in the warm parent, not in every branch
import hashlib
import json
import math
import os
import random
import stat
import sys

MAX_INFO_DEPTH = 20
MAX_CARRIED = 16  # the env's own generators whose states a fresh episode carries on, at most
MAX_OWNED = {"w": 4096, "r": 16384}  # pages a spare makes its own ahead of its episode, at most (copied; mapped)
POPULATE = {"w": 23, "r": 22}  # MADV_POPULATE_WRITE, MADV_POPULATE_READ (Linux 5.14)


def _np():
    import numpy

    return numpy


def _json_number(value):
    """A bit generator state's numpy numbers as JSON (SFC64's and Philox's are arrays)."""
    return value.tolist() if hasattr(value, "tolist") else int(value)


def _bits(gen):
    """A numpy Generator's or RandomState's bit generator (None for other kinds)."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(gen, (np.random.Generator, np.random.RandomState)):
        return None
    return gen.bit_generator if isinstance(gen, np.random.Generator) else getattr(gen, "_bit_generator", None)


def seeded_by_code(gen):
    """Whether the env's code gave ``gen`` its seed (``np.random.default_rng(1234)``, a fixed
    level set on purpose): never reseeded, as Gymnasium leaves it. numpy seeds a generator made
    without one from a SeedSequence of 128 bits of the OS's entropy, so an entropy of 2**64 or
    more (a chance of 2**-64 of being under it) is taken for that; a seed the code gave (a
    number under 2**64, a list of them, RandomState(seed)'s legacy seeding, which keeps no
    SeedSequence) is the env's own choice. ``random.Random`` and torch generators can't say
    how they were seeded: False (reseeded, as before)."""
    bits = _bits(gen)
    if bits is None:
        return False
    seq = getattr(bits, "_seed_seq", None)
    if seq is None:  # legacy seeding (RandomState(1234)): the code's seed
        return True
    entropy = getattr(seq, "entropy", None)
    return not (isinstance(entropy, int) and entropy >= 2**64)


def _machine():
    """Which machine this is: its node id (``root.3``); every machine's pid may be the same,
    each in its own pid namespace."""
    try:
        return sys.modules["smolbench_guest"].node
    except Exception:  # not under smolbench's agent
        return os.getpid()


def space_data(space):
    """A Gymnasium space as data the host can rebuild (raises TypeError for other spaces)."""
    from gymnasium import spaces as S

    if isinstance(space, S.Box):
        return {"type": "Box", "low": space.low, "high": space.high, "dtype": str(space.dtype)}
    if isinstance(space, S.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, S.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": space.nvec, "start": space.start, "dtype": str(space.dtype)}
    if isinstance(space, S.MultiBinary):
        return {"type": "MultiBinary", "n": [int(x) for x in space.shape]}
    if isinstance(space, S.Dict):
        return {"type": "Dict", "spaces": [[k, space_data(v)] for k, v in space.spaces.items()]}
    if isinstance(space, S.Tuple):
        return {"type": "Tuple", "spaces": [space_data(v) for v in space.spaces]}
    if isinstance(space, S.Text):
        return {"type": "Text", "min_length": int(space.min_length), "max_length": int(space.max_length),
                "charset": "".join(space.character_list)}  # in its order: sample() and flatten() follow it
    raise TypeError("smolbench.gym supports Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple and Text "
                    "spaces, not %s" % type(space).__name__)


def _number(value):
    """``value`` as a plain int or float (numpy's too), else None."""
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        return None
    value = value.item() if hasattr(value, "item") else value
    return value if isinstance(value, (int, float)) else None


def spec_data(spec):
    """What an env's spec holds that is plain data (None where it has no spec)."""
    if spec is None or not isinstance(getattr(spec, "id", None), str):
        return None
    steps = _number(getattr(spec, "max_episode_steps", None))
    return {"id": spec.id, "max_episode_steps": steps if isinstance(steps, int) else None,
            "reward_threshold": _number(getattr(spec, "reward_threshold", None)),
            "nondeterministic": getattr(spec, "nondeterministic", False) is True}


def decode_action(tree):
    """An action from its JSON form (see the module doc)."""
    if isinstance(tree, dict):
        tag = tree.get("$")
        if tag == "array":
            np = _np()
            raw = base64.b64decode(tree["data"])
            return np.frombuffer(raw, dtype=np.dtype(tree["dtype"]).newbyteorder("<")).astype(
                np.dtype(tree["dtype"])).reshape(tree["shape"])
        if tag == "dict":
            return {k: decode_action(v) for k, v in tree["v"]}
        if tag == "tuple":
            return tuple(decode_action(v) for v in tree["v"])
        if tag == "int64":
            return _np().int64(tree["v"])
        raise ValueError("an action of unknown form %r" % (tag,))
    return tree


def plain(value, where="info", depth=0):
    """``value`` as data the agent's pull encoding sends (numbers, text, arrays, lists, dicts
    with string keys); anything else is a TypeError naming where it was."""
    if depth > MAX_INFO_DEPTH:
        raise TypeError("%s is nested more than %d levels deep" % (where, MAX_INFO_DEPTH))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError("%s has a key %r that is not a string" % (where, k))
            out[k] = plain(v, "%s[%r]" % (where, k), depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [plain(v, "%s[%d]" % (where, i), depth + 1) for i, v in enumerate(value)]
    np = _np() if type(value).__module__ == "numpy" else None
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError("%s is an array of Python objects, not data" % where)
        return value
    if np is not None and isinstance(value, np.generic):
        return value.item() if not isinstance(value, np.bool_) else bool(value)
    raise TypeError("%s is a %s: infos must be data (numbers, text, arrays, lists, dicts)" % (where, type(value).__name__))


def observation(value, where="the observation"):
    """An observation as the pull encoding sends it (arrays stay arrays, numpy ints their
    own dtype so the host can check them against the space)."""
    if isinstance(value, dict):
        return {k: observation(v, "%s[%r]" % (where, k)) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(observation(v, "%s[%d]" % (where, i)) for i, v in enumerate(value))
    return value


def _reward(value):
    if type(value) is int:  # the env's own type (Taxi's), kept by JSON
        return value
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError("the reward is a %s, not a number" % type(value).__name__) from None
    return out if math.isfinite(out) else repr(out)  # the host refuses it in one line


def _owned():
    """The pages this branch has of its own now, by mapping: ``{(kind, first page): pages}``;
    kind "w": written since the fork (each a copy-on-write copy, or new), "r": pages of code
    and other read-only files it mapped (a fork maps none of them ahead)."""
    np = _np()
    size = os.sysconf("SC_PAGE_SIZE")
    out = {}
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            perms, name = fields[1], fields[5] if len(fields) > 5 else ""
            if perms[0] != "r" or perms[3] != "p" or name.startswith("[v"):  # [vdso], [vvar]: the kernel's
                continue
            kind = "w" if perms[1] == "w" else ("r" if name.startswith("/") else None)
            if kind is None:
                continue
            lo, hi = (int(x, 16) // size for x in fields[0].split("-"))
            pagemap.seek(lo * 8)
            flags = np.frombuffer(pagemap.read((hi - lo) * 8), dtype=np.uint64)
            mine = (flags >> np.uint64(63)) == 1  # present
            if kind == "w":
                mine &= ((flags >> np.uint64(56)) & np.uint64(1)) == 1  # mapped here only: copied (or new)
            out[(kind, lo)] = lo + np.flatnonzero(mine)
    return out


def owned_pages(before=None):
    """The pages this branch made its own since ``before`` (an earlier :func:`_owned`; else
    since its fork), as ``{"w": [[first, count], ...], "r": [...]}``, at most ``MAX_OWNED``:
    what its episode touched, for the next spares to take ahead of theirs (:meth:`Server.warm`)."""
    np = _np()
    out, left = {"w": [], "r": []}, dict(MAX_OWNED)
    for (kind, lo), pages in _owned().items():
        if before is not None and (kind, lo) in before:
            pages = np.setdiff1d(pages, before[(kind, lo)], assume_unique=True)
        pages = pages[:max(0, left[kind])]
        if not len(pages):
            continue
        left[kind] -= len(pages)
        cut = np.flatnonzero(np.diff(pages) != 1) + 1
        for a, b in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(pages)])).tolist()):
            out[kind].append([int(pages[a]), b - a])
    return out


def _populate(pages):
    """Make ``pages`` (:func:`owned_pages`' form, from a practice episode's branch) this
    branch's own now: written ones copied, read-only ones mapped. Their contents stay as they
    are (the kernel populates, nothing is written); a page not mapped here is skipped."""
    size = os.sysconf("SC_PAGE_SIZE")
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for kind, advice in POPULATE.items():
        for first, count in pages.get(kind, ()):
            madvise(first * size, count * size, advice)  # fails where unmapped here: nothing to take


def checked_once(env):
    """Gymnasium's ``PassiveEnvChecker`` (every ``gymnasium.make`` env has one) checks an env's
    first reset and steps once per env. A spare is a copy of the warm parent's env, which never
    ran, so it checked again in every fresh episode: ~0.2 ms of a fresh reset here, most of its
    gap to an in-place one, and the first step's check too. The practice episode
    (gym/practice.py) ran those checks on the same env: a spare given its pages (only a practice
    that passed gives them) counts them as done, as one long-lived env would. What an episode
    sends is still checked on the host, every time."""
    flags = ("checked_reset", "checked_step", "checked_data_reuse")
    for _ in range(64):  # a wrapper chain, bounded
        kind = type(env)
        if kind.__name__ == "PassiveEnvChecker" and kind.__module__.startswith("gymnasium."):
            if all(type(getattr(env, f, None)) is bool for f in flags):
                for f in flags:
                    setattr(env, f, True)
        try:
            env = object.__getattribute__(env, "env")  # never a wrapper's own __getattr__
        except AttributeError:
            return


# What a fork shares instead of copying (each branch of the warm parent would reach the same one):
# a shared memory map (any but a device's, or a file's that can never be written through it),
# a descriptor of a pipe, socket, anon inode (eventfd, epoll...), memfd, /dev/shm file or
# unlinked file, and a helper process. Regular files on the workspace and /tmp are reopened per
# branch (guest/openfiles.py); a device's map (a GPU's) is the device's own.
_SHARED_FDS = ("pipe:", "socket:", "anon_inode:")
_SHARED_FILES = ("/memfd:", "/dev/shm/")
# The mount guard's page (mountguard.ADDR): a write-sealed memfd every process of a machine has
# mapped read-only there, which nothing can write (and seccomp lets nothing else be mapped at)
_GUARD_PAGE = 0x300000000000


def _never_written(lo, name):
    """Whether a read-only shared map (of ``name``, at ``lo``) is of a file named by its path
    that no mprotect can make writable: the file's open mode gave it no ``mw`` (VM_MAYWRITE)
    flag, and a branch's own path to it is its own overlay's. Not a memfd, /dev/shm, SysV or
    unlinked file, whose pages a branch reaches through its descriptor or /proc/self/fd/N."""
    if lo == _GUARD_PAGE and name.startswith("/memfd:smolbench-mounts"):
        pass  # (its "mw" is checked too)
    elif not name.startswith("/") or name.startswith(_SHARED_FILES) or name.endswith(" (deleted)"):
        return False
    heads = ("%x-" % lo, "%08x-" % lo)
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                if not line[:1].isupper():  # a map's first line
                    inside = line.startswith(heads)
                elif inside and line.startswith("VmFlags:"):
                    return "mw" not in line.split()[1:]
    except OSError:
        pass
    return False


def _shared_maps():
    """This process's shared memory maps a branch could write, ``{(start, end, name): (bytes,
    perms)}``: writable now or not (a read-only map of a memfd opened for writing is made
    writable by mprotect). Left out: a device's under /dev/ (but /dev/zero's and /dev/shm's)
    and a file's that can never be written through it (``_never_written``)."""
    out = {}
    with open("/proc/self/maps") as maps:
        lines = maps.readlines()
    for line in lines:
        fields = line.split(None, 5)
        perms, name = fields[1], fields[5].strip() if len(fields) > 5 else ""
        if perms[3] != "s":
            continue
        if name.startswith("/dev/") and not name.startswith(("/dev/zero", "/dev/shm/")):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if perms[1] != "w" and _never_written(lo, name):
            continue
        out[(lo, hi, name)] = (hi - lo, perms)
    return out


def _shared_fds():
    """This process's descriptors a fork shares: ``{(fd, target)}`` (a memfd's, a /dev/shm
    file's and an unlinked file's in any open mode: ``/proc/self/fd/N`` reopens it writable)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + fd)
            if target.startswith("/") and target.endswith(" (deleted)") and not target.startswith(_SHARED_FILES):
                if not stat.S_ISREG(os.fstat(int(fd)).st_mode):
                    continue
            elif not target.startswith(_SHARED_FDS + _SHARED_FILES):
                continue
        except OSError:  # (the listing's own, closed)
            continue
        out.add((int(fd), target))
    return out


def _children():
    """This process's child processes' pids (every thread's), those still running."""
    out = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open("/proc/self/task/%s/children" % task) as f:
                out.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return {pid for pid in out if not _ended(pid)}


def _ended(pid):
    """Whether process ``pid`` has exited (a zombie, waiting to be reaped: it holds nothing)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def shared_now():
    """What this process holds that its forks would share: :func:`shared_left`'s ``before``."""
    return {"maps": _shared_maps(), "fds": _shared_fds(), "children": _children()}


def _command(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "gone"
    line = " ".join(w.decode("utf-8", "replace") for w in words if w)
    line = "".join(c if c.isprintable() else "?" for c in line)
    return line[:60] + ("..." if len(line) > 60 else "") or "?"


def _holder(target, pids):
    """The first of ``pids`` that holds the pipe or socket ``target`` too, or None."""
    for pid in sorted(pids):
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%d/fd/%s" % (pid, fd)) == target:
                    return pid
            except OSError:
                continue
    return None


def _size(n):
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return "%d %s" % (n, unit) if unit == "bytes" or n == int(n) else "%.1f %s" % (n, unit)
        n /= 1024.0
    return "%d bytes" % n


def shared_left(before):
    """The one line refusing an env whose construction (since ``before``, :func:`shared_now`)
    left something every branch of this warm parent would share, or None. A shared map a
    branch could write is refused even when it was there before (made by earlier code in the
    machine: a plain warm parent has none; smolbench's own is never writable); a descriptor or a child from
    before is not (the agent's own connections are descriptors too; a fork copies no child)."""
    found, old = [], []
    for (lo, hi, name), (size, perms) in sorted(_shared_maps().items()):
        what = "a shared memory map of %s" % _size(size)
        if name.startswith(_SHARED_FILES):
            what += " (%s)" % name.split(" (deleted)")[0][:60]
        elif name and not name.startswith("/dev/zero"):
            what = "a%s shared map of %s of %s" % (" writable" if perms[1] == "w" else "", _size(size), name[:60])
            what += "" if perms[1] == "w" else " that a branch can write"
        (old if (lo, hi, name) in before["maps"] else found).append(what)
    kids = _children() - before["children"]
    held = set()
    for _, target in sorted(_shared_fds() - before["fds"]):
        if target.startswith("anon_inode:"):
            kind = "an anon inode (%s)" % target.split(":", 1)[1].strip("[]")[:40]
        elif target.startswith(_SHARED_FILES):
            kind = "a descriptor of %s" % target.split(" (deleted)")[0][:60]
        elif target.startswith("/"):
            kind = "a descriptor of the unlinked file %s" % target.split(" (deleted)")[0][:60]
        else:
            kind = "a " + target.split(":", 1)[0]
        pid = _holder(target, kids) if target.startswith(("pipe:", "socket:")) else None
        if pid is not None:
            held.add(pid)
            kind += " to process %d (%s)" % (pid, _command(pid))
        found.append(kind)
    for pid in sorted(kids - held):
        found.append("a helper process %d (%s)" % (pid, _command(pid)))
    if not found and not old:
        return None
    items = found or old
    what = items[0] + (" and %d more" % (len(found) + len(old) - 1) if len(found) + len(old) > 1 else "")
    said = "the env's construction left %s" if found else "the machine holds %s (made before the env was built)"
    return (said % what + " that every episode's machine would share (one episode could see or change another's): "
            "make it in the env's reset() so each episode has its own")


class Server:
    """One env in this machine; its methods answer the host's requests with data."""

    def __init__(self, factory, reseed=True):
        self.factory = factory
        self.env = None
        self.reseed = reseed  # False: the env's own generators are left alone (make's reseed=False)
        self._home = _machine()  # the warm parent: a reset in another machine is a branch's first
        self._own = []  # (name, generator) the env keeps itself: build() finds them
        self._fixed = []  # for each: seeded by the env's code (seeded_by_code), never reseeded

    def build(self):
        """Make the env (in the warm parent, once) and describe its spaces."""
        before = shared_now()
        env = self.factory()
        if not hasattr(env, "step") or not hasattr(env, "reset"):
            raise TypeError("the env factory returned a %s, not a gymnasium.Env" % type(env).__name__)
        self.env = env
        shared = shared_left(before)
        if shared is not None:  # before any fork: the host refuses the env in this line
            return {"shared": shared}
        try:  # the generators the env keeps itself, found here once (a walk in every branch costs its page copies)
            from _smolbench_guest.reseed import streams_of

            self._own = [(n, g) for n, g in streams_of(env, "env") if not n.endswith("_np_random")]
        except ImportError:  # not under smolbench's agent
            self._own = []
        if not self.reseed:
            self._own = []
        self._fixed = [seeded_by_code(g) for _, g in self._own]
        meta = getattr(env, "metadata", None)
        meta = meta if isinstance(meta, dict) else {}
        modes = meta.get("render_modes")
        return {"observation_space": space_data(env.observation_space), "action_space": space_data(env.action_space),
                "render_modes": [str(m) for m in modes[:16]] if isinstance(modes, (list, tuple)) else [],
                "render_fps": _number(meta.get("render_fps")), "spec": spec_data(getattr(env, "spec", None)),
                "own_streams": len(self._own)}

    def rng(self):
        """The env's random generator states (what a fresh machine continues from): its
        ``np_random``'s, and ``own``: each of the generators it keeps itself (None for one
        that can't be carried: a torch generator, or past ``MAX_CARRIED``)."""
        base = self.env.unwrapped
        out = None
        if getattr(base, "_np_random", None) is not None:
            state = base._np_random.bit_generator.state
            out = {"state": json.dumps(state, default=_json_number), "seed": getattr(base, "_np_random_seed", None)}
        if self._own:
            out = out or {"state": None, "seed": None}
            out["own"] = [self._own_state(g) for _, g in self._own[:MAX_CARRIED]]
        return out

    @staticmethod
    def _own_state(gen):
        """A generator's state as JSON: a numpy Generator's bit generator's state; a legacy
        ``RandomState``'s or a ``random.Random``'s, tagged with its kind; None for another kind."""
        np = sys.modules.get("numpy")
        try:
            if np is not None and isinstance(gen, np.random.Generator):
                return json.dumps(gen.bit_generator.state, default=_json_number)
            if np is not None and isinstance(gen, np.random.RandomState):
                return json.dumps({"kind": "RandomState", "state": gen.get_state(legacy=False)}, default=_json_number)
            if isinstance(gen, random.Random) and not isinstance(gen, random.SystemRandom):
                return json.dumps({"kind": "Random", "state": gen.getstate()})
        except Exception:
            pass
        return None

    @staticmethod
    def _carry(gen, state):
        """Set ``gen`` to a state :meth:`_own_state` made (raises if it is not of its kind)."""
        new = json.loads(state)
        kind = new.get("kind") if isinstance(new, dict) else None
        if kind == "RandomState":
            np = _np()
            if not isinstance(gen, np.random.RandomState):
                raise ValueError("another kind of generator")
            inner = dict(new["state"])
            inner["state"] = {"key": np.array(inner["state"]["key"], dtype=np.uint32), "pos": inner["state"]["pos"]}
            gen.set_state(inner)
        elif kind == "Random":
            if not isinstance(gen, random.Random):
                raise ValueError("another kind of generator")
            version, internal, gauss = new["state"]
            gen.setstate((version, tuple(internal), gauss))
        else:
            bits = gen.bit_generator
            if new.get("bit_generator") != type(bits).__name__:
                raise ValueError("another kind of generator")
            bits.state = new

    def _set_rng(self, rng):
        np = _np()
        state = json.loads(rng["state"])
        kind = getattr(np.random, str(state.get("bit_generator")), None)
        if kind is None or not isinstance(kind, type) or not issubclass(kind, np.random.BitGenerator):
            raise ValueError("unknown bit generator %r" % (state.get("bit_generator"),))
        gen = kind()
        gen.state = state
        base = self.env.unwrapped
        base._np_random = np.random.Generator(gen)
        seed = rng.get("seed")
        base._np_random_seed = seed if isinstance(seed, int) else -1

    def reset(self, text):
        """``env.reset(seed=..., options=...)``; ``rng`` (from a previous episode's machine)
        continues the env's random stream the way one long-lived env would."""
        req = json.loads(text)
        seed, rng = req.get("seed"), req.get("rng")
        if seed is None and rng:
            self._set_rng(rng)
        here = _machine()
        if self._home != here:
            self._home = here
            self._own_streams(seed, rng, req.get("own"))
        kwargs = {"seed": seed}
        if req.get("options") is not None:
            kwargs["options"] = req["options"]
        obs, info = self.env.reset(**kwargs)
        return {"obs": observation(obs), "info": plain(info)}

    def _own_streams(self, seed, rng, own=None):
        """A branch's first episode: the generators it copied from the warm parent are every
        sibling's too. The env's ``np_random``, unless seeded or carried over, starts from the
        OS's entropy, as a new env's does. Each generator the env keeps itself continues from
        its state carried from the last episode (``own``, fresh resets), as one long-lived env's
        would; else one the env's code seeded (:func:`seeded_by_code`) is left as it is; else it
        is reseeded (as a fork's branches' are: guest/reseed.py) from the reset's seed, else
        from the carried np_random state, else from entropy. A seed reseeds an entropy-seeded
        one even where a state was carried (a seeded run replays)."""
        base = self.env.unwrapped
        if seed is None and not rng and getattr(base, "_np_random", None) is not None:
            try:
                from gymnasium.utils import seeding

                base._np_random, base._np_random_seed = seeding.np_random()
            except Exception:  # not gymnasium's (or an old one): numpy's own, from entropy
                base._np_random = _np().random.default_rng()
        if not self._own:
            return
        carried = own if isinstance(own, list) else []
        left = []
        for k, (name, gen) in enumerate(self._own):
            state = carried[k] if k < len(carried) else None
            if isinstance(state, str) and (self._fixed[k] or seed is None):
                try:
                    self._carry(gen, state)
                    continue
                except Exception:  # not to be had: as if none was carried
                    pass
            if not self._fixed[k]:
                left.append((name, gen))
        if not left:
            return
        if seed is not None:
            root = seed
        elif rng:
            root = int.from_bytes(hashlib.sha256(str(rng.get("state")).encode()).digest()[:8], "big")
        else:
            root = int.from_bytes(os.urandom(8), "big")
        from _smolbench_guest.reseed import reseed_streams

        reseed_streams(left, root)

    def step(self, text):
        """One ``env.step``; the rng state rides along when the episode ends."""
        return self._step(json.loads(text))

    def _step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(decode_action(action))
        out = {"obs": observation(obs), "reward": _reward(reward), "terminated": bool(terminated),
               "truncated": bool(truncated), "info": plain(info)}
        if terminated or truncated:
            out["rng"] = self.rng()
        return out

    def serve(self, api, first, pages=None, learn=False):
        """Answer the host on this cell's own connection (``smolbench_guest.channel()``):
        ``first`` is the episode's reset (None: answer None and wait for it), then ``{"op": "step", "a": ...}``,
        ``{"op": "rng"}``, ``{"op": "reset", "r": ...}`` and ``{"op": "pages"}`` (:func:`owned_pages`)
        requests until the host ends the channel, and ``{"op": "wake"}`` lines, read and not answered
        (a spare woken ahead of its episode: nothing of the env runs). A request that fails is answered with its error; the
        loop goes on. ``pages`` (JSON text) are what a spare takes ahead (:meth:`warm`); ``learn``:
        the practice episode's branch (smolbench/gym/practice.py), asked for its pages at the end."""
        requests, answer = api.channel()
        if first is None:  # a spare branch: warmed while it waits, so its reset costs what an in-place one does
            self.warm(getattr(answer, "warm", None), json.loads(pages) if pages else None, learn)
            if pages:  # only a practice that passed gives them
                checked_once(self.env)
        answer(self.reset(first) if first is not None else None)
        for req in requests:
            try:
                op = req.get("op")
                if op == "wake":
                    continue
                if op == "step":
                    obs, reward, terminated, truncated, info = self.env.step(decode_action(req.get("a")))
                    flags = (1 if terminated else 0) | (2 if truncated else 0)
                    lean = getattr(answer, "step", None)
                    if lean is not None:  # the lean form: no dict of the whole step to encode
                        lean(observation(obs), _reward(reward), flags, plain(info), self.rng() if flags else None)
                        continue
                    out = {"obs": observation(obs), "reward": _reward(reward), "terminated": bool(terminated),
                           "truncated": bool(truncated), "info": plain(info)}
                    if flags:
                        out["rng"] = self.rng()
                elif op == "rng":
                    out = self.rng()
                elif op == "reset":
                    out = self.reset(req.get("r"))
                elif op == "pages":
                    out = owned_pages()
                else:
                    raise ValueError("unknown gym request %r" % (op,))
            except Exception as exc:
                answer(error=exc)
                continue
            answer(out)
        return True

    def warm(self, encode, pages=None, learn=False):
        """Write, before the episode's first request, the pages answering it would write first
        (a branch shares its parent's memory until it writes a page; each first write costs a
        page copy, ~200 of them made a fresh reset several times an in-place one). Nothing of
        the env runs: only its attributes are read (their objects' reference counts are
        written), and the request/answer path runs on made-up data. ``pages``: what the practice
        episode's branch made its own since its fork (:func:`owned_pages`: this warming's pages,
        and those the env's own reset and steps wrote, its code's pages mapped), taken here
        ahead instead of the walk; ``learn``: the practice's branch, no walk either (what it
        touches is what it says)."""
        if pages:
            _populate(pages)
        np = _np()
        rng = np.random.default_rng(0)  # not the env's own, nor numpy's global one
        obs = np.asarray(rng.uniform(-0.05, 0.05, size=(4,)), dtype=np.float32)
        sample = {"obs": obs, "reward": 1.0, "terminated": False, "truncated": False, "info": plain({"k": obs.copy()}),
                  "rng": {"state": json.dumps(rng.bit_generator.state, default=int), "seed": 0}}
        json.loads(sample["rng"]["state"])
        decode_action({"$": "int64", "v": 1})
        if encode is not None:
            encode(sample)
        if learn or pages:
            return
        seen, todo = set(), [self.env]
        while todo and len(seen) < 20000:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, type):
                continue
            seen.add(id(obj))
            try:
                attrs = object.__getattribute__(obj, "__dict__")  # never the env's own __getattr__
            except AttributeError:
                attrs = None
            if isinstance(attrs, dict):
                todo.extend(attrs.values())
            elif type(obj) in (list, tuple):
                todo.extend(obj)
            elif type(obj) is dict:
                todo.extend(obj.values())

    def close(self):
        close = getattr(self.env, "close", None)
        if close is not None:
            close()
        return True
