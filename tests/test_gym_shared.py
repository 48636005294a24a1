"""An env whose constructor left something a fork shares instead of copying is refused.

Every episode (fresh resets), every make_vec sub-env and every ``smolbench serve`` client
runs in an ``os.fork`` branch of the warm parent the env was built in. A fork copies memory,
but not a shared memory map (``mmap.mmap(-1, n)``, multiprocessing's Value/Array, /dev/shm),
not the pipe or socket to a helper process the constructor started, and not the helper: each
branch reaches the same one. An outside audit read one episode's action in the next, one
sub-env's in its sibling, and one serve client's secret in another's (``guest/gymserve.py``
``shared_left``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymhelpers import CARTPOLE, define, needs_bwrap, up_bench
from test_openenv_server import WAIT, server_env

import smolbench.gym as sgym
from smolbench.gym import warmparent
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

# Each step writes its action into a shared memory map and into a helper process on a pipe;
# each reset says what it finds in both.
LEAKY = '''
import mmap, subprocess, sys, gymnasium as gym
from gymnasium import spaces as S

HELPER = "import sys\\nlast = ''\\nfor line in sys.stdin:\\n    line = line.strip()\\n    if line == '?':\\n        print(last, flush=True)\\n    else:\\n        last = line\\n"

class Leaky(gym.Env):
    observation_space = S.Discrete(2)
    action_space = S.Discrete(100)
    def __init__(self, shm=True, helper=True):
        self.shm = mmap.mmap(-1, 4096) if shm else None
        self.helper = subprocess.Popen([sys.executable, "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True) if helper else None
    def seen(self):
        out = {}
        if self.shm is not None:
            out["shm"] = self.shm[:8].rstrip(b"\\0").decode()
        if self.helper is not None:
            self.helper.stdin.write("?\\n")
            self.helper.stdin.flush()
            out["helper"] = self.helper.stdout.readline().strip()
        return out
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, self.seen()
    def step(self, action):  # (0: writes nothing)
        a = str(int(action)).encode()
        if int(action) and self.shm is not None:
            self.shm[:8] = a.ljust(8, b"\\0")
        if int(action) and self.helper is not None:
            self.helper.stdin.write(a.decode() + "\\n")
            self.helper.stdin.flush()
        return 0, 0.0, True, False, self.seen()

def leaky():
    return Leaky()

def leaky_map():
    return Leaky(helper=False)

def leaky_helper():
    return Leaky(shm=False)

class Plain(gym.Env):
    """Python state and a numpy array: each branch has its own copy."""
    observation_space = S.Box(-1e9, 1e9, (3,), "float64")
    action_space = S.Discrete(3)
    def __init__(self):
        import numpy as np
        self.board = np.zeros(3)
        self.log = []
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.board.copy(), {"log": len(self.log)}
    def step(self, action):
        self.board[int(action)] += 1
        self.log.append(int(action))
        return self.board.copy(), 0.0, False, False, {}

def plain():
    return Plain()

class ReadOnlyShared(Leaky):
    """Looks read-only at build: a map of a memfd opened for writing mapped PROT_READ (its fd
    closed, as a C library's would be), or a memfd or unlinked file's descriptor kept
    O_RDONLY. Each step makes it writable again (mprotect, or /proc/self/fd/N reopened)."""
    def __init__(self, how):
        import ctypes, os, tempfile
        self.how, self.shm, self.helper = how, None, None
        libc = self.libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if how == "file":
            with tempfile.TemporaryFile(dir="/tmp") as t:
                fd = os.dup(t.fileno())
        else:
            fd = os.memfd_create("state")
        os.ftruncate(fd, 4096)
        if how == "map":
            self.addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            os.close(fd)
        else:
            self.ro = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY)
            os.close(fd)
    def seen(self):
        import ctypes, os
        if self.how == "map":
            return {"shm": ctypes.string_at(self.addr, 8).rstrip(b"\\0").decode()}
        return {"shm": os.pread(self.ro, 8, 0).rstrip(b"\\0").decode()}
    def step(self, action):
        import ctypes, os
        a = str(int(action)).encode().ljust(8, b"\\0")
        if int(action) and self.how == "map":
            assert self.libc.mprotect(self.addr, 4096, mmap.PROT_READ | mmap.PROT_WRITE) == 0
            ctypes.memmove(self.addr, a, 8)
        elif int(action):
            fd = os.open("/proc/self/fd/%d" % self.ro, os.O_RDWR)
            os.pwrite(fd, a, 0)
            os.close(fd)
        return 0, 0.0, True, False, self.seen()

def ro_memfd_map():
    return ReadOnlyShared("map")

def ro_memfd_fd():
    return ReadOnlyShared("fd")

def ro_unlinked_fd():
    return ReadOnlyShared("file")

def plain_reads_a_file_map():
    """A shared map of a file opened read-only (np.memmap(mode="r")): nothing can write it."""
    import tempfile
    with tempfile.NamedTemporaryFile(dir=".", delete=False) as f:
        f.write(b"data" * 1024)
    env = Plain()
    with open(f.name, "rb") as ro:
        env.data = mmap.mmap(ro.fileno(), 4096, access=mmap.ACCESS_READ)
    return env

def plain_ran_a_tool():
    """Its constructor ran a program, which ended (its pipes closed)."""
    subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, check=True)
    return Plain()
'''
REFUSED = ("that every episode's machine would share (one episode could see or change another's): make it in the "
           "env's reset() so each episode has its own")


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    for wb in up_bench(tmp_path_factory):
        define(wb, LEAKY)
        yield wb


def _one_line(err: BaseException, what: str) -> None:
    said = str(err)
    assert "\n" not in said, said
    assert said.startswith("the env could not be built in machine ") and said.endswith(f": {what} {REFUSED}"), said


def test_a_shared_memory_map_made_in_init_is_refused_by_make_and_make_vec(bench: Workbench) -> None:
    """On the old code both built, and each episode (each sub-env) read the last one's action."""
    with pytest.raises(sgym.GymError) as err:
        sgym.make("leaky_map", session=bench)
    _one_line(err.value, "the env's construction left a shared memory map of 4 KiB")
    with pytest.raises(sgym.GymError) as err:
        sgym.make_vec("leaky_map", 2, session=bench)
    _one_line(err.value, "the env's construction left a shared memory map of 4 KiB")
    assert {m.name for m in bench.backend.list()} == {bench.active}  # the warm parents are deleted


def test_a_helper_process_on_a_pipe_is_refused(bench: Workbench) -> None:
    with pytest.raises(sgym.GymError) as err:
        sgym.make("leaky_helper", session=bench, reset="in-place")
    said = str(err.value)
    assert "the env's construction left a pipe to process " in said and "-c import sys" in said, said
    assert " and 1 more " in said, said  # its other pipe (the helper itself is told with its pipes)
    assert said.endswith(REFUSED) and "\n" not in said, said


EARLIER = LEAKY + """
import mmap as _m
EARLIER = _m.mmap(-1, 8192)  # made in a cell before any env: the machine holds it

def uses_earlier():
    env = Leaky(shm=False, helper=False)
    env.shm = EARLIER
    return env
"""


def test_a_shared_map_made_before_the_env_is_refused_too(tmp_path_factory: Any) -> None:
    """A map an earlier cell (or the file ``smolbench serve`` runs) made is in the warm parent
    before the build: every branch shares it all the same."""
    for wb in up_bench(tmp_path_factory):
        define(wb, EARLIER)
        with pytest.raises(sgym.GymError) as err:
            sgym.make("uses_earlier", session=wb)
    _one_line(err.value, "the machine holds a shared memory map of 8 KiB (made before the env was built)")


@pytest.mark.parametrize(("factory", "what"), [("ro_memfd_map", "a shared memory map of 4 KiB (/memfd:state)"),
                                              ("ro_memfd_fd", "a descriptor of /memfd:state"),
                                              ("ro_unlinked_fd", "a descriptor of the unlinked file /tmp/")])
def test_a_shared_map_or_descriptor_that_is_read_only_at_build_is_refused(bench: Workbench, factory: str,
                                                                          what: str) -> None:
    """Fifth audit: the check looked at permissions now. A shared map of a memfd opened for
    writing, mapped read-only (``r--s``), passed, and every episode mprotect()ed it writable; a
    memfd (or an unlinked file) kept open read-only passed, and /proc/self/fd/N reopened it
    for writing in every episode."""
    with pytest.raises(sgym.GymError) as err:
        sgym.make(factory, session=bench)
    said = str(err.value)
    assert said.startswith("the env could not be built in machine ") and "\n" not in said, said
    assert f": the env's construction left {what}" in said and said.endswith(REFUSED), said


def test_the_attack_unchecked_a_read_only_map_is_made_writable_in_each_episode(
        bench: Workbench, monkeypatch: pytest.MonkeyPatch) -> None:
    """What that check stops is real: without it, episode 1 reads what episode 0 wrote."""
    _unchecked(monkeypatch)
    for factory in ("ro_memfd_map", "ro_memfd_fd", "ro_unlinked_fd"):
        env = sgym.make(factory, session=bench, reset="fresh")
        try:
            _practised(env)
            env.reset()
            env.step(7)
            _, info = env.reset()
            assert info == {"shm": "7"}, factory
        finally:
            env.close()


def test_the_check_knows_the_mount_guard_page() -> None:
    from smolbench.guest import gymserve, mountguard

    assert gymserve._GUARD_PAGE == mountguard.ADDR


def test_plain_envs_still_build(bench: Workbench) -> None:
    for factory in (CARTPOLE, "plain", "plain_ran_a_tool", "plain_reads_a_file_map"):
        env = sgym.make(factory, session=bench)
        try:
            env.reset(seed=0)
            env.step(1)
        finally:
            env.close()
    envs = sgym.make_vec("plain", 2, session=bench)
    try:
        envs.reset(seed=0)
        obs, *_ = envs.step(np.array([2, 0]))
        assert obs.tolist() == [[0, 0, 1], [1, 0, 0]]
    finally:
        envs.close()


def _unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check off in the machine (the old code)."""
    monkeypatch.setattr(warmparent, "SETUP", warmparent.SETUP.replace(
        "_smolgym = _smolgym_mod.Server", "_smolgym_mod.shared_left = lambda before: None\n_smolgym = _smolgym_mod.Server"))


def _practised(env: Any) -> None:
    practice = env._m._practice  # its actions would write too: over first
    deadline = time.monotonic() + 120
    while practice is not None and not practice.done():
        assert time.monotonic() < deadline, "the practice episode never ended"
        time.sleep(0.05)


def test_the_attack_unchecked_episode_1_reads_episode_0s_action(bench: Workbench, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the check stops is real: without it, fresh episodes and make_vec siblings read each other."""
    _unchecked(monkeypatch)
    env = sgym.make("leaky", session=bench, reset="fresh")
    try:
        _practised(env)
        env.reset()
        env.step(7)
        _, info = env.reset()
        assert info == {"helper": "7", "shm": "7"}
    finally:
        env.close()
    envs = sgym.make_vec("leaky_map", 2, session=bench, reset="in-place")
    try:
        envs.reset()
        envs.step(np.array([42, 0]))
        _, info = envs.reset()
        assert list(info["shm"]) == ["42", "42"]  # sub-env 1 (its action 0 writes nothing) reads sub-env 0's 42
    finally:
        envs.close()


def test_serve_refuses_such_an_env_at_startup_in_one_line(open_tmp: Path) -> None:
    """On the old code it served: client B (another branch) and a later client C read client A's secret."""
    (open_tmp / "envs.py").write_text(LEAKY)
    proc = subprocess.Popen([sys.executable, "-m", "smolbench.cli", "serve", "envs.py:leaky_map", "--backend", "sandbox",
                             "--port", "0"], cwd=open_tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=server_env())
    try:
        out = proc.stdout.readline()  # type: ignore[union-attr]  # its URL once it serves; "" once it ended
        assert "serving" not in out, out
        assert proc.wait(WAIT) == 2
        err = proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.terminate()  # (a server: it deletes its machines as it stops)
            proc.wait(WAIT)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    lines = [line for line in err.splitlines() if line.startswith("smolbench serve:")]
    assert len(lines) == 1 and lines[0].endswith(
        f": the env's construction left a shared memory map of 4 KiB {REFUSED}"), err
