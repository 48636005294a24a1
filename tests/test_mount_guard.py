"""A cell can't put host RAM in a filesystem of its own (issue 17, item 7), tried from `%%smol`
cells in a real kernel.

With no cgroup (a kernel running as a user), the only bound on a machine's memory is its
own processes' limits; a tmpfs or ramfs the cell mounts in a fresh user + mount namespace
(allowed: branching needs ``unshare``) is charged to nobody. The mount guard lets a *new*
filesystem be mounted only with fstype/data pointers into a sealed read-only page at
``GUARD`` (``smolbench/guest/mountguard.py``), checked by the machine's keeper, which also
makes sure that page really is the sealed memfd.

Every attack runs in the real sandbox, where it must fail, and the same probe runs in a
weakened one (``SMOLBENCH_TEST_WEAKEN``: ``mount-guard`` = no guard, ``guard-maps`` = the
keeper skips its /proc/PID/maps identity check), where it must succeed: each check is
shown able to fail. Probes that could change the cell's own process run in a forked child.
"""

from __future__ import annotations

import base64
import shutil
import struct
import subprocess
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from nbhelpers import error_text
from test_containment import DISK_MIB, Lab, _lab

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

GUARD = 0x300000000000  # smolbench/guest/mountguard.py ADDR
FILL_MIB = DISK_MIB + 36  # what a cell puts in a ramfs of its own: more than its disk
NODES = ("root", "root.0", "root.1")

# Loaded into every machine of a lab (after test_containment's PROBES); each returns plain data.
GUARD_PROBES = r'''
import base64, ctypes, errno, json, os, shutil, signal, subprocess, tempfile, time
_g = ctypes.CDLL(None, use_errno=True)
_vp, _sz, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_g.mmap.restype = _vp
_g.mmap.argtypes = [_vp, _sz, _int, _int, _int, ctypes.c_long]
_g.munmap.argtypes = [_vp, _sz]
_g.mprotect.argtypes = [_vp, _sz, _int]
_g.mremap.restype = _vp
_g.mremap.argtypes = [_vp, _sz, _sz, _int, _vp]
_g.mount.argtypes = [_vp, _vp, _vp, ctypes.c_ulong, _vp]
_g.shmat.restype = _vp
_g.shmat.argtypes = [_int, _vp, _int]
_g.syscall.restype = ctypes.c_long
GUARD = 0x300000000000
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
PROT_READ, PROT_WRITE = 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 1, 2, 0x10, 0x20
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
MAP_FAILED = 2**64 - 1

def _err(ok):
    if ok:
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

def _in_child(fn, *args):
    """fn(*args) in a forked child (whatever it breaks dies with it); its value comes back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                out = json.dumps(fn(*args))
            except BaseException as exc:
                out = json.dumps({"raised": repr(exc)})
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    data = _read_all(r)
    _, status = os.waitpid(pid, 0)
    return json.loads(data) if data else {"died": os.waitstatus_to_exitcode(status)}

def _read_all(r):
    """Everything until the pipe's other end closes; closes ours."""
    data = b""
    while True:
        part = os.read(r, 65536)
        if not part:
            break
        data += part
    os.close(r)
    return data

def _mapping(addr):
    """The /proc/self/maps fields of the mapping holding addr, or None."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields
    return None

def guard_page():
    """What this process has at GUARD: None (nothing), or the first 8 bytes, permissions and file."""
    m = _mapping(GUARD)
    if m is None:
        return None
    head = ctypes.string_at(GUARD, 8).decode("latin-1") if "r" in m[1] else None
    return {"head": head, "perms": m[1], "file": " ".join(m[5:])}

def _own_userns():
    """Become root of a fresh user + mount namespace (this process must be single-threaded)."""
    uid, gid = os.getuid(), os.getgid()
    if _g.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        return _err(False)
    for name, line in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
        with open("/proc/self/" + name, "w") as fh:
            fh.write(line)
    return "ok"

def _fill(path, mib):
    chunk = b"\1" * (1 << 20)
    written = 0
    try:
        with open(path, "wb") as fh:
            for _ in range(mib):
                fh.write(chunk)
                fh.flush()
                written += 1
    except OSError:
        pass
    return written

def _in_child_with_folder(attempt, subdirs=()):
    """attempt(base) in a forked child, with a fresh folder under /tmp (removed after)."""
    base = tempfile.mkdtemp(prefix="guard-", dir="/tmp")
    for d in subdirs:
        os.mkdir(os.path.join(base, d))
    try:
        return _in_child(attempt, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)

def own_mounts(fill_mib):
    """In a fresh user + mount namespace: tmpfs, tmpfs size=1g and ramfs on new dirs under
    /tmp, then fill_mib MiB into the ramfs (if it mounted)."""
    def attempt(base):
        got = {"userns": _own_userns()}
        for d, fs, data in (("tmpfs", b"tmpfs", None), ("tmpfs-1g", b"tmpfs", b"size=1g"), ("ramfs", b"ramfs", None)):
            got[d] = _err(_g.mount(b"x", os.path.join(base, d).encode(), fs, 0, data) == 0)
        got["fsopen"] = _err(_g.syscall(430, b"tmpfs", 0) >= 0)  # the fd-based mount API
        got["ramfs_mib"] = _fill(os.path.join(base, "ramfs", "fill"), fill_mib) if got["ramfs"] == "ok" else 0
        return got

    return _in_child_with_folder(attempt, ("tmpfs", "tmpfs-1g", "ramfs"))

DISGUISES = {"MS_SILENT": 0x8000, "MS_REC|MS_SILENT": 0xC000, "MS_MGC_VAL": 0xC0ED0000,
             "MS_MGC_VAL|MS_SILENT": 0xC0ED8000}

def disguised_flags():
    """In a fresh user + mount namespace: ramfs with flags a filter could take for a change of
    propagation (no new filesystem), which the kernel mounts as new; and a real propagation
    change (which must pass)."""
    def attempt(base):
        got = {"userns": _own_userns()}
        for name, flags in DISGUISES.items():
            got[name] = _err(_g.mount(b"x", base.encode(), b"ramfs", flags, None) == 0)
        got["propagation"] = _err(_g.mount(None, b"/", None, 0x4000 | 0x40000, None) == 0)  # MS_REC | MS_PRIVATE
        return got

    return _in_child_with_folder(attempt)

def sealed_pointer_mount():
    """In a fresh user + mount namespace, mount a tmpfs with the guard page's own pointers
    (fstype GUARD+32 "tmpfs", data GUARD+64: the store's options). With no guard page
    (no guard), map one like it first."""
    def attempt(base):
        got = {"page": guard_page()}
        if got["page"] is None:
            p = _g.mmap(GUARD, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
            got["own_page"] = _err(p == GUARD)
            if p == GUARD:
                ctypes.memmove(GUARD + 32, b"tmpfs\0", 6)
                ctypes.memmove(GUARD + 64, b"mode=0700,size=64m\0", 19)
        got["userns"] = _own_userns()
        got["mount"] = _err(_g.mount(b"x", base.encode(), GUARD + 32, 0, GUARD + 64) == 0)
        return got

    return _in_child_with_folder(attempt)

def _mem_write():
    with open("/proc/self/mem", "r+b", buffering=0) as fh:
        fh.seek(GUARD)
        fh.write(b"ramfs\0")

def _fd_write():
    """Write to the memfd behind the page through any descriptor this process has for it."""
    done = []
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + n)
        except OSError:
            continue
        if target.startswith("/memfd:"):
            try:
                fd = os.open("/proc/self/fd/" + n, os.O_RDWR)
                try:
                    os.pwrite(fd, b"ramfs\0", 0)
                finally:
                    os.close(fd)
                done.append(target)
            except OSError as exc:
                return errno.errorcode.get(exc.errno, str(exc.errno))
    return "ok: " + ",".join(done) if done else "no memfd"

def _replace(op):
    """One attempt at replacing or changing the page at GUARD; then what GUARD holds."""
    anon = PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0
    if op == "munmap":
        res = _err(_g.munmap(GUARD, 4096) == 0)
    elif op == "mmap_fixed":
        res = _err(_g.mmap(GUARD, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == GUARD)
    elif op == "mprotect_rw":
        res = _err(_g.mprotect(GUARD, 4096, PROT_READ | PROT_WRITE) == 0)
    elif op == "pkey_mprotect_rw":
        res = _err(_g.syscall(329, _vp(GUARD), _sz(4096), PROT_READ | PROT_WRITE, -1) == 0)
    elif op == "mremap_onto":
        fresh = _g.mmap(None, 4096, *anon)
        res = _err(_g.mremap(fresh, 4096, 4096, MREMAP_MAYMOVE | MREMAP_FIXED, GUARD) == GUARD)
    elif op == "mremap_away":
        res = _err(_g.mremap(GUARD, 4096, 8192, MREMAP_MAYMOVE, None) not in (None, MAP_FAILED))
    elif op == "munmap_around":
        res = _err(_g.munmap(GUARD - 2**40, 2**41) == 0)
    elif op == "munmap_huge_from_below":  # starts below the range, longer than 16 TiB
        res = _err(_g.munmap(GUARD - 2**44 - 2**40, 2**44 + 2**41) == 0)
    elif op == "remap_file_pages":
        res = _err(_g.syscall(216, _vp(GUARD), _sz(4096), 0, _sz(1), 0) == 0)
    elif op == "shmat_remap":
        shm = _g.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        p = _g.shmat(shm, GUARD, 0o40000)  # SHM_REMAP
        res = _err(p == GUARD)
        _g.shmctl(shm, 0, None)  # IPC_RMID
    elif op == "proc_self_mem":
        try:
            _mem_write()
            res = "ok"
        except OSError as exc:
            res = errno.errorcode.get(exc.errno, str(exc.errno))
    elif op == "memfd_fd_write":
        res = _fd_write()
    else:
        raise ValueError(op)
    return {"result": res, "page": guard_page()}

REPLACE_OPS = ["munmap", "mmap_fixed", "mprotect_rw", "pkey_mprotect_rw", "mremap_onto", "mremap_away",
               "munmap_around", "munmap_huge_from_below", "remap_file_pages", "shmat_remap",
               "proc_self_mem", "memfd_fd_write"]

def replace_page():
    """Each attempt in its own forked child; then the page as this (untouched) process sees it."""
    got = {op: _in_child(_replace, op) for op in REPLACE_OPS}
    got["after"] = guard_page()
    return got

_thieves = {}

def start_grant_thief(seconds):
    """Leave a process behind, root of a namespace of its own, that keeps mounting a tmpfs
    with the sealed pointers (for ``seconds`` at most); returns its pid."""
    base = tempfile.mkdtemp(prefix="thief-", dir="/tmp")
    r, w = os.pipe()
    trying, tried = os.pipe()
    pid = os.fork()
    if pid == 0:
        got = {}
        try:
            os.close(r)
            os.close(trying)
            stop = []
            signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
            os.setsid()
            got = {"userns": _own_userns(), "stolen": 0, "tries": 0}
            end = time.time() + seconds
            while time.time() < end and not stop:
                d = "%s/%d" % (base, got["stolen"])
                if not os.path.isdir(d):
                    os.mkdir(d)
                got["tries"] += 1
                if _g.mount(b"x", d.encode(), GUARD + 32, 0, GUARD + 64) == 0:
                    got["stolen"] += 1
                if got["tries"] == 1:
                    os.close(tried)  # it is at work: the caller goes on
        except BaseException as exc:
            got["error"] = repr(exc)
        finally:
            os.write(w, json.dumps(got).encode())
            os._exit(0)
    os.close(w)
    os.close(tried)
    os.read(trying, 1)  # until its first try (or its end): a loaded host may run it late
    os.close(trying)
    _thieves[pid] = (r, base)
    return pid

def grant_thief_result(pid):
    """Stop the process and say what it got. (Through a pipe: after a fork of this machine,
    its /tmp and ours are no longer the same.)"""
    r, base = _thieves.pop(pid)
    os.kill(pid, signal.SIGTERM)
    data = _read_all(r)
    os.waitpid(pid, 0)
    shutil.rmtree(base, ignore_errors=True)
    return json.loads(data)

def run_elf(b64, as_memfd=False):
    """Write the crafted ELF to /tmp (or into a memfd named like the guard page's) and run it."""
    data = base64.b64decode(b64)
    if as_memfd:
        page = guard_page()
        name = page["file"].split("/memfd:", 1)[-1].split(" (deleted)")[0] if page and "/memfd:" in page["file"] else "guard"
        fd = os.memfd_create(name, 0)
        os.write(fd, data)
        res = subprocess.run(["/proc/self/fd/%d" % fd], pass_fds=(fd,), timeout=30)
        os.close(fd)
        return {"rc": res.returncode, "name": name}
    path = "/tmp/guard-elf"
    with open(path, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o755)
    try:
        return {"rc": subprocess.run([path], timeout=30).returncode}
    finally:
        os.unlink(path)
'''

USERNS_MOUNTS = """
mkdir -p /tmp/guard-m /tmp/guard-b
mount -t tmpfs x /tmp/guard-m 2>/dev/null && echo tmpfs
mount -t tmpfs -o size=1g x /tmp/guard-m 2>/dev/null && echo tmpfs-1g
mount -t ramfs x /tmp/guard-m 2>/dev/null && echo ramfs
mount --bind /tmp/guard-b /tmp/guard-m && echo bind
true
"""


def crafted_elf(addr: int = GUARD, compat: bool = False) -> bytes:
    """A static x86_64 executable whose one segment is a page at ``addr`` (RWX) holding
    b"ramfs" at ``addr`` and code at ``addr + 0x100``: unshare(CLONE_NEWUSER|CLONE_NEWNS),
    then mount("x", "/tmp", addr, 0, NULL), then exit(-rax): 0 mounted, 1 EPERM
    (100 + errno if the unshare failed). ``compat``: the mount through the 32-bit ABI
    (``int 0x80``, mount is 21 there; ``addr`` below 4 GiB)."""
    page = bytearray(0x200)
    page[0:6] = b"ramfs\0"
    page[0x80:0x82] = b"x\0"
    page[0x88:0x8D] = b"/tmp\0"
    leave = b"".join([
        b"\xf7\xd8",  # neg eax
        b"\x83\xc0\x64",  # add eax, 100
        b"\x89\xc7",  # mov edi, eax
        b"\xb8" + struct.pack("<I", 60),  # mov eax, SYS_exit
        b"\x0f\x05",  # syscall
    ])
    if compat:
        assert addr + 0x1000 < 1 << 32
        mount = b"".join([
            b"\xbb" + struct.pack("<I", addr + 0x80),  # mov ebx, "x"
            b"\xb9" + struct.pack("<I", addr + 0x88),  # mov ecx, "/tmp"
            b"\xba" + struct.pack("<I", addr),  # mov edx, "ramfs"
            b"\x31\xf6",  # xor esi, esi (flags)
            b"\x31\xff",  # xor edi, edi (data)
            b"\xb8" + struct.pack("<I", 21),  # mov eax, mount (i386)
            b"\xcd\x80",  # int 0x80
        ])
    else:
        mount = b"".join([
            b"\x48\xbf" + struct.pack("<Q", addr + 0x80),  # movabs rdi, "x"
            b"\x48\xbe" + struct.pack("<Q", addr + 0x88),  # movabs rsi, "/tmp"
            b"\x48\xba" + struct.pack("<Q", addr),  # movabs rdx, "ramfs": the pointer the guard allows
            b"\x4d\x31\xd2",  # xor r10, r10 (flags)
            b"\x4d\x31\xc0",  # xor r8, r8 (data)
            b"\xb8" + struct.pack("<I", 165),  # mov eax, SYS_mount
            b"\x0f\x05",  # syscall
        ])
    code = b"".join([
        b"\xbf" + struct.pack("<I", 0x10020000),  # mov edi, CLONE_NEWUSER | CLONE_NEWNS
        b"\xb8" + struct.pack("<I", 272),  # mov eax, SYS_unshare
        b"\x0f\x05",  # syscall
        b"\x85\xc0",  # test eax, eax
        b"\x74" + bytes([len(leave)]),  # jz over the exit below
        leave,
        mount,
        b"\xf7\xd8",  # neg eax
        b"\x89\xc7",  # mov edi, eax
        b"\xb8" + struct.pack("<I", 60),  # mov eax, SYS_exit
        b"\x0f\x05",  # syscall
    ])
    page[0x100:0x100 + len(code)] = code
    ehdr = struct.pack("<4sBBBBB7xHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0,  # 64-bit, LE, SysV
                       2, 0x3E, 1, addr + 0x100, 64, 0, 0, 64, 56, 1, 0, 0, 0)  # ET_EXEC, x86_64, 1 phdr
    phdr = struct.pack("<IIQQQQQQ", 1, 7, 0x1000, addr, addr, len(page), len(page), 0x1000)  # PT_LOAD RWX
    return (ehdr + phdr).ljust(0x1000, b"\0") + bytes(page)


ELF_B64 = base64.b64encode(crafted_elf()).decode()
COMPAT_ADDR = 0x10000000
COMPAT_ELF_B64 = base64.b64encode(crafted_elf(COMPAT_ADDR, compat=True)).decode()


def _guard_lab(weaken: str) -> Iterator[Lab]:
    labs = cast(Generator[Lab, None, None], _lab(weaken))  # a generator: close() takes the lab down
    lab = next(labs)
    try:
        for node in NODES:
            lab.ok(f"%smol use {node}")
            lab.ok("%%smol\n" + GUARD_PROBES)
        yield lab
    finally:
        labs.close()


@pytest.fixture(scope="module")
def real() -> Iterator[Lab]:
    yield from _guard_lab("")


@pytest.fixture(scope="module")
def unguarded() -> Iterator[Lab]:
    """The old set-up: no mount guard at all."""
    yield from _guard_lab("mount-guard")


@pytest.fixture(scope="module")
def no_maps_check() -> Iterator[Lab]:
    """The guard filter on, but the keeper takes any page at GUARD for the sealed one."""
    yield from _guard_lab("guard-maps")


@pytest.fixture(scope="module")
def grandchildren(real: Lab) -> tuple[str, str]:
    """root.0 forked in two (root.0.0, root.0.1), each writing a file of its own."""
    real.ok("%smol use root.0")
    real.ok("%%smol fork 2 --keep all --quiet\nimport smolbench_guest\n"
            "for d in ('/workspace', '/tmp'):\n    open(d + '/gc-' + smolbench_guest.node, 'w').write('x')")
    return "root.0.0", "root.0.1"


def _status(lab: Lab) -> str:
    lab.ok("%smol use root")
    return "".join(o.get("text", "") for o in lab.ok("%smol status").outputs if o.get("output_type") == "stream")


# -- mounting a filesystem of one's own --------------------------------------------------


def test_a_fresh_namespace_cannot_mount_tmpfs_or_ramfs(real: Lab, unguarded: Lab) -> None:
    """The attacker becomes root of a fresh user + mount namespace (allowed: branching needs
    it) and mounts tmpfs, a 1 GiB tmpfs and a ramfs, then fills the ramfs: memory no disk
    limit or cgroup counts. The guard refuses all three (a new filesystem needs the sealed
    page's pointers); without it they mount and the ramfs takes more than the machine's disk."""
    for node in NODES:
        got = real.probe(f"own_mounts({FILL_MIB})", node)
        assert got["userns"] == "ok", got  # the namespace itself stays allowed
        assert {got[k] for k in ("tmpfs", "tmpfs-1g", "ramfs", "fsopen")} == {"EPERM"}, got
        assert got["ramfs_mib"] == 0, got
    got = unguarded.probe(f"own_mounts({FILL_MIB})", "root.1")
    assert (got["tmpfs"], got["tmpfs-1g"], got["ramfs"]) == ("ok", "ok", "ok"), got
    assert got["ramfs_mib"] == FILL_MIB > DISK_MIB, got


DISGUISES = ("MS_SILENT", "MS_REC|MS_SILENT", "MS_MGC_VAL", "MS_MGC_VAL|MS_SILENT")


@pytest.mark.parametrize("flags", DISGUISES)
def test_flags_that_look_like_a_propagation_change_mount_nothing(real: Lab, unguarded: Lab, flags: str) -> None:
    """The attacker names ramfs with mount flags the guard could take for a flag-only call:
    MS_SILENT (1 << 15, next to the propagation bits) is no propagation flag, so the kernel
    makes a new mount; MS_MGC_VAL (0xC0ED0000, the pre-2.4 magic the kernel still discards)
    has the MS_PRIVATE and MS_SLAVE bits set, and the kernel strips it before it looks. Each
    must be EPERM, while a real propagation change passes."""
    got = unguarded.probe("disguised_flags()", "root.1")
    assert got[flags] == "ok", got  # the probe does mount where nothing guards
    for node in ("root", "root.0"):
        got = real.probe("disguised_flags()", node)
        assert got["userns"] == "ok" and got["propagation"] == "ok", got
        assert got[flags] == "EPERM", got


def test_the_mount_binary_in_unshare_is_refused_too(real: Lab, unguarded: Lab) -> None:
    """`unshare -r -m sh -c 'mount -t tmpfs ...'`: the same mounts from an exec'd program
    (no guard page after exec). Refused; a bind mount (flag-only, which branches use) and
    unshare's own propagation change still work."""
    script = repr(USERNS_MOUNTS)
    for node in ("root", "root.0"):
        got = real.probe(f"in_new_userns({script})", node)
        assert got["rc"] == 0 and got["out"] == ["bind"], got
    got = unguarded.probe(f"in_new_userns({script})", "root.0")
    assert got["rc"] == 0 and got["out"] == ["tmpfs", "tmpfs-1g", "ramfs", "bind"], got


def test_the_sealed_pointers_give_no_tmpfs_outside_an_ordered_fork(real: Lab, grandchildren: tuple[str, str], unguarded: Lab) -> None:
    """The attacker passes the guard page's own pointers (fstype "tmpfs" at GUARD+32, the
    store's options at GUARD+64), which the guard allows only once per branch the host
    ordered, for its store. A cell's call gets EPERM, in a fresh branch too; with no guard
    the same call (on a page the probe maps itself) mounts."""
    for node in (*NODES, grandchildren[0]):
        got = real.probe("sealed_pointer_mount()", node)
        assert got["page"] is not None and got["page"]["head"] == "overlay\0" and "w" not in got["page"]["perms"], got
        assert got["userns"] == "ok" and got["mount"] == "EPERM", got
    got = unguarded.probe("sealed_pointer_mount()", "root.0")
    assert got["page"] is None and got["own_page"] == "ok" and got["mount"] == "ok", got


def test_the_guard_page_cannot_be_replaced_or_written(real: Lab, unguarded: Lab) -> None:
    """The attacker unmaps, remaps, reprotects, moves or overwrites the page at GUARD (in a
    forked child), to then point mount(2) at strings of its own at the allowed address.
    Every way is refused and the page still reads "overlay". (With no guard there is no page:
    the same probe maps over the address, showing it reports a success.)"""
    for node in ("root", "root.1"):
        got = real.probe("replace_page()", node)
        after = got.pop("after")
        assert after is not None and after["head"] == "overlay\0", after
        for op, res in got.items():
            assert res["result"] in ("EPERM", "EIO", "EACCES") or res["result"] == "no memfd", (op, res)
            assert res["page"] is not None and res["page"]["head"] == "overlay\0", (op, res)
    got = unguarded.probe("replace_page()", "root")
    assert got["after"] is None and got["mmap_fixed"]["result"] == "ok" and got["mmap_fixed"]["page"]["head"] == "\0" * 8, got


def test_a_crafted_elf_mapping_its_own_page_at_the_address_is_refused(real: Lab, no_maps_check: Lab) -> None:
    """The attacker execs a static ELF whose only segment is loaded by the kernel at GUARD
    (no mmap call for the filter to see), with "ramfs" at GUARD+0, and mounts a ramfs with
    that pointer. The keeper sees the page is not the sealed memfd: EPERM (exit 1). With the
    keeper's maps check skipped, the same program mounts (exit 0)."""
    for node in ("root", "root.0"):
        assert real.probe(f"run_elf({ELF_B64!r})", node) == {"rc": 1}
    assert no_maps_check.probe(f"run_elf({ELF_B64!r})", "root.0") == {"rc": 0}


def test_a_crafted_elf_in_a_memfd_named_like_the_guard_is_refused(real: Lab, no_maps_check: Lab) -> None:
    """The same ELF exec'd from a memfd given the guard page's own name, so its page at
    GUARD shows in /proc/PID/maps as "/memfd:<that name> (deleted)" too: the keeper must
    tell the sealed memfd by more than its name."""
    for node in ("root", "root.1"):
        got = real.probe(f"run_elf({ELF_B64!r}, as_memfd=True)", node)
        assert got["rc"] == 1, got
    assert no_maps_check.probe(f"run_elf({ELF_B64!r}, as_memfd=True)", "root.1")["rc"] == 0


# -- what the guard must not break ----------------------------------------------------------


def test_forks_of_a_branch_still_get_their_own_files(real: Lab, grandchildren: tuple[str, str]) -> None:
    """Each branch mounts its store (once, as the host ordered) under the guard: a fork of a
    fork works, and a grandchild's files are its own."""
    a, b = grandchildren
    seen: dict[str, Any] = {}
    for node in (a, b, "root.0"):
        seen[node] = real.probe("sorted(f for d in ('/workspace', '/tmp') for f in os.listdir(d) if f.startswith('gc-'))", node)
    assert seen == {a: [f"gc-{a}", f"gc-{a}"], b: [f"gc-{b}", f"gc-{b}"], "root.0": []}, seen


@pytest.mark.parametrize("thief", ["root", "root.0"])  # root.1's parent, its sibling
def test_a_store_grant_goes_to_the_branch_it_was_for(real: Lab, thief: str) -> None:
    """The attacker leaves a process behind that keeps calling mount(2) with the sealed
    pointers ("tmpfs", the store's options) from a namespace of its own. When the host
    orders a fork of root.1 it grants two stores, and the process must not get them: a
    grant it got would be a tmpfs of ``disk`` outside any branch (one more at every fork
    ordered, however few branches are alive), and the branch it was for would fail.
    (Before the grants named a pid namespace, it took both.)"""
    pid = real.probe("start_grant_thief(30)", thief)
    real.ok("%smol use root.1")
    fork = real.nb.run("%%smol fork 2 --keep none --quiet\n1 + 1")
    got = real.probe(f"grant_thief_result({pid})", thief)
    assert got.get("userns") == "ok" and got.get("tries", 0) > 0, got
    assert got["stolen"] == 0, got
    assert not error_text(fork), error_text(fork)


def test_a_machines_own_process_takes_at_most_its_branches_stores(real: Lab) -> None:
    """The same process left in root.1 itself, which is in the pid namespace the grants name.
    What docs/security.md accepts: it takes at most one store per branch ordered, and those
    branches fail to start (loudly), so nothing is taken unseen."""
    pid = real.probe("start_grant_thief(30)", "root.1")
    real.ok("%smol use root.1")
    fork = real.nb.run("%%smol fork 2 --keep none --quiet\n1 + 1")
    got = real.probe(f"grant_thief_result({pid})", "root.1")
    assert got.get("userns") == "ok" and got.get("tries", 0) > 0 and got["stolen"] <= 2, got
    if got["stolen"]:
        assert f"{got['stolen']} of 2 branches failed" in error_text(fork), (got, error_text(fork))


@pytest.fixture(scope="module")
def parent_grants() -> Iterator[Lab]:
    """Leaf forks granted to the forking machine's pid namespace too, as a keeper's branches are."""
    yield from _guard_lab("leaf-parent-grants")


def test_a_leaf_forks_stores_go_to_its_branches_own_namespaces(real: Lab, parent_grants: Lab) -> None:
    """A --keep none fork makes leaf branches (guest/leaves.py), each in a pid namespace of its
    own from its clone on: the host grants each its store there, after the clone and before it
    runs. So not even a process of the forking machine itself takes one, and the fork works.
    Granted to the forking machine's namespace too, the same process takes them."""
    for lab, stolen in ((real, 0), (parent_grants, 2)):
        pid = lab.probe("start_grant_thief(30)", "root.1")
        lab.ok("%smol use root.1")
        fork = lab.nb.run("%%smol fork 2 --keep none --quiet\n1 + 1")
        got = lab.probe(f"grant_thief_result({pid})", "root.1")
        assert got.get("userns") == "ok" and got.get("tries", 0) > 0, got
        assert not error_text(fork), error_text(fork)
        assert got["stolen"] == stolen, (lab, got)


def test_status_says_tmpfs_and_ramfs_are_refused(real: Lab, unguarded: Lab) -> None:
    assert "tmpfs/ramfs refused" in _status(real)
    assert "tmpfs/ramfs refused" not in _status(unguarded)


def test_a_mount_through_the_32_bit_abi_is_refused(real: Lab) -> None:
    """The attacker execs a static ELF that mounts a ramfs through ``int 0x80`` (the i386
    ABI: mount is 21 there, pointers below 4 GiB), where a filter that reads only x86_64
    numbers sees no mount(2). Refused (the machine's filter answers ENOSYS to foreign ABIs);
    on the host the same program mounts (the test below)."""
    for node in ("root", "root.1"):
        assert real.probe(f"run_elf({COMPAT_ELF_B64!r})", node)["rc"] not in (0, -11), node  # -11: no int 0x80 here


@pytest.mark.parametrize("compat", [False, True])
def test_the_crafted_elf_mounts_where_nothing_guards(tmp_path: Path, compat: bool) -> None:
    """The ELFs themselves work: in a namespace of their own on this host, they mount (exit 0)."""
    path = tmp_path / "elf"
    path.write_bytes(crafted_elf(COMPAT_ADDR, compat=True) if compat else crafted_elf())
    path.chmod(0o755)
    res = subprocess.run([str(path)], timeout=30)
    if res.returncode == 101:  # EPERM from unshare: this host refuses user namespaces
        pytest.skip("user namespaces are not allowed here")
    if compat and res.returncode == -11:
        pytest.skip("this kernel runs no 32-bit syscalls (no IA32 emulation)")
    assert res.returncode == 0
