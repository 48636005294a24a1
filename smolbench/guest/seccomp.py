"""The machine's seccomp filter: a classic BPF program built in stdlib Python.

Refused with EPERM: debugging other processes (ptrace, process_vm_*), kernel keyrings,
bpf, perf, module loading and kexec, userfaultfd, handle-based opens, setns,
pivot_root/chroot, swap, reboot, accounting, quotas, the fd-based mount API, io_uring
(it bypasses seccomp), clocks, kernel logs, and namespace flags other than the ones
branching uses (user, mount, pid, IPC, net: cgroup, UTS and time are refused).
clone3 answers ENOSYS, so libc falls back to clone, whose flags the filter can read.
socket() and socketpair() answer EAFNOSUPPORT for every address family but AF_UNIX,
AF_INET, AF_INET6 and AF_NETLINK (as Docker's default profile): a network namespace holds
only those, so the others (AF_VSOCK above all: it reaches the hypervisor of a VM host
whatever the namespace, past the egress proxy; AF_PACKET, AF_ALG, AF_BLUETOOTH...) would be
ways out or kernel code no machine needs.
Foreign syscall ABIs (x32, 32-bit) are refused.

A second filter, the mount guard (``guard_program``; why and how in ``mountguard.py``),
checks mount(2) of new filesystems by the addresses of their type and options, and keeps
the page those addresses point into where it is.

Why mount and unshare(user|mount|pid) stay allowed: a branch is a live fork of a
machine that has run cells, so whatever the filter forbids, a branch can't do to
set itself up. In a fresh user namespace those calls only give power over the
caller's own private view: inherited mounts are locked (can't be made writable or
unmounted), the machine's uid owns no host files, and /proc can't be remounted
(see docs/security.md).
"""

import ctypes
import errno
import os
import struct

ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
CLONE_NEWTIME = 0x00000080
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000

# x86_64 syscall numbers refused with EPERM.
DENY_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "keyctl": 250, "add_key": 248, "request_key": 249,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "create_module": 174, "get_kernel_syms": 177, "query_module": 178,
    "open_by_handle_at": 304, "name_to_handle_at": 303, "setns": 308,
    "pivot_root": 155, "chroot": 161, "swapon": 167, "swapoff": 168, "reboot": 169,
    "acct": 163, "quotactl": 179, "quotactl_fd": 443,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429,
    "open_tree": 428, "mount_setattr": 442,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "iopl": 172, "ioperm": 173, "syslog": 103, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "lookup_dcookie": 212, "uselib": 134,
    "vhangup": 153, "nfsservctl": 180, "_sysctl": 156,
}
NR_CLONE, NR_UNSHARE, NR_CLONE3 = 56, 272, 435
NR_SOCKET, NR_SOCKETPAIR = 41, 53
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16  # the socket families a machine may create

LD_ABS_W, JEQ, JGT, JGE, JSET, RET, AND = 0x20, 0x15, 0x25, 0x35, 0x45, 0x06, 0x54
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
RET_USER_NOTIF = 0x7FC00000
MS_REMOUNT, MS_BIND, MS_MOVE = 32, 4096, 8192
MS_PROPAGATION = (1 << 17) | (1 << 18) | (1 << 19) | (1 << 20)  # unbindable private slave shared (1 << 15 is MS_SILENT)
MS_MGC_VAL, MS_MGC_MSK = 0xC0ED0000, 0xFFFF0000  # the old magic: the kernel drops those bits when they are exactly it
SHM_REMAP = 0o40000
NR_MMAP, NR_MPROTECT, NR_MUNMAP, NR_MREMAP, NR_SHMAT = 9, 10, 11, 25, 30
NR_MOUNT, NR_REMAP_FILE_PAGES, NR_PKEY_MPROTECT = 165, 216, 329
ZONE_HI = (0x2000, 0x3000)  # high words of the addresses kept clear: 32 TiB up to the page (48 TiB)
LEN_HI = 0x1000  # lengths from 16 TiB up could reach the page from below the zone


def _ins(code, k, jt=0, jf=0):
    return struct.pack("HBBI", code, jt, jf, k)


def program(deny=None, families=True):
    """The filter as a list of 8-byte sock_filter instructions (x86_64). ``families``: check
    socket()'s and socketpair()'s family (off only in tests, ``socket-families``)."""
    deny = sorted(set((deny or DENY_X86_64).values()))
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    head = [_ins(LD_ABS_W, 4), _ins(JEQ, ARCH_X86_64, 1, 0), _ins(RET, enosys), _ins(LD_ABS_W, 0)]
    # Tail, laid out after the checks: [0] EPERM, [1] unshare flags, [5] clone flags, [9] socket families.
    tail = [
        _ins(RET, eperm),
        _ins(LD_ABS_W, 16), _ins(JSET, CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWTIME, 0, 1),
        _ins(RET, eperm), _ins(RET, RET_ALLOW),
        _ins(LD_ABS_W, 16), _ins(JSET, CLONE_NEWCGROUP | CLONE_NEWUTS, 0, 1),
        _ins(RET, eperm), _ins(RET, RET_ALLOW),
        # the family is an int: the low word of the first argument is all the kernel reads
        _ins(LD_ABS_W, _arg(0)), _ins(JEQ, AF_UNIX, 4, 0), _ins(JEQ, AF_INET, 3, 0), _ins(JEQ, AF_INET6, 2, 0),
        _ins(JEQ, AF_NETLINK, 1, 0), _ins(RET, RET_ERRNO | errno.EAFNOSUPPORT), _ins(RET, RET_ALLOW),
    ]
    checks = [("ge", X32_BIT, 0)] + [("eq", nr, 0) for nr in deny]
    checks += [("eq", NR_UNSHARE, 1), ("eq", NR_CLONE, 5)]
    if families:
        checks += [("eq", NR_SOCKET, 9), ("eq", NR_SOCKETPAIR, 9)]
    return _relayout(head, checks, tail)


def _relayout(head, checks, tail):
    n = len(checks)
    # After the checks: [a] JEQ clone3 -> enosys (+1) else allow (+0); [b] RET allow; [c] RET enosys.
    fixed = [_ins(JEQ, NR_CLONE3, 1, 0), _ins(RET, RET_ALLOW), _ins(RET, RET_ERRNO | errno.ENOSYS)]
    body = []
    for i, (op, k, target) in enumerate(checks):
        dist = (n - i - 1) + len(fixed) + target
        if dist > 255:
            raise ValueError("seccomp program too long for short jumps")
        body.append(_ins(JGE if op == "ge" else JEQ, k, dist, 0))
    return head + body + fixed + tail


def _arg(i, hi=False):
    return 16 + 8 * i + (4 if hi else 0)


def _assemble(lines):
    """Lines are (code, k, jt, jf) with jump targets as label names (None: the next line),
    or a label name alone; returns the instructions."""
    where, n = {}, 0
    for line in lines:
        if isinstance(line, str):
            where[line] = n
        else:
            n += 1
    out, i = [], 0
    for line in lines:
        if isinstance(line, str):
            continue
        code, k, jt, jf = line
        rel = [0 if t is None else where[t] - i - 1 for t in (jt, jf)]
        if not all(0 <= r <= 255 for r in rel):
            raise ValueError("seccomp program jump out of range")
        out.append(_ins(code, k, *rel))
        i += 1
    return out


def guard_program(addr, allowed, tmpfs, store_opts):
    """The mount guard (``mountguard.py``): a new filesystem only by the page's own type
    strings (``allowed``: addresses answered by the keeper; ``tmpfs`` only with
    ``store_opts``); nothing mapped over the page at ``addr``."""
    hi = addr >> 32
    if not ZONE_HI[0] <= hi <= ZONE_HI[1] or any(a >> 32 != hi for a in (*allowed, tmpfs, store_opts)):
        raise ValueError("the mount page must lie in the guarded zone")
    ld = lambda off: (LD_ABS_W, off, None, None)  # noqa: E731
    # On its own too (the main filter refuses these as well): no other ABI, no fd-based mount API.
    lines = [ld(4), (JEQ, ARCH_X86_64, None, "enosys"), ld(0), (JGE, X32_BIT, "enosys", None),
             (JEQ, NR_MOUNT, "mount", None)]
    lines += [(JEQ, DENY_X86_64[name], "eperm", None)
              for name in ("fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr")]
    lines += [(JEQ, nr, "range", None) for nr in (NR_MMAP, NR_MUNMAP, NR_MPROTECT, NR_PKEY_MPROTECT, NR_REMAP_FILE_PAGES)]
    lines += [(JEQ, NR_MREMAP, "mremap", None), (JEQ, NR_SHMAT, "shmat", "allow")]
    # The flags as the kernel reads them: with the magic in the high bits, only the low ones.
    lines += ["mount", ld(_arg(3)), (AND, MS_MGC_MSK, None, None), (JEQ, MS_MGC_VAL, None, "plain"),
              ld(_arg(3)), (AND, 0xFFFF, None, None), (JSET, 0, None, "flags"),  # (always jumps)
              "plain", ld(_arg(3)),
              "flags", (JSET, MS_BIND, "allow", None), (JSET, MS_REMOUNT, "eperm", None),
              (JSET, MS_MOVE | MS_PROPAGATION, "allow", None),
              ld(_arg(2, True)), (JEQ, hi, None, "eperm"), ld(_arg(2))]
    lines += [(JEQ, a & 0xFFFFFFFF, "notify", None) for a in allowed]
    lines += [(JEQ, tmpfs & 0xFFFFFFFF, None, "eperm"), ld(_arg(4, True)), (JEQ, hi, None, "eperm"),
              ld(_arg(4)), (JEQ, store_opts & 0xFFFFFFFF, "notify", "eperm")]
    # Address in arg 0, length in arg 1 (mmap, munmap, mprotect, pkey_mprotect, remap_file_pages).
    lines += ["range", ld(_arg(0, True)), (JGE, ZONE_HI[0], None, "len"), (JGT, ZONE_HI[1], "len", "eperm"),
              "len", ld(_arg(1, True)), (JGE, LEN_HI, "eperm", "allow")]
    lines += ["mremap", ld(_arg(0, True)), (JGE, ZONE_HI[0], None, "lens"), (JGT, ZONE_HI[1], "lens", "eperm"),
              "lens", ld(_arg(1, True)), (JGE, LEN_HI, "eperm", None), ld(_arg(2, True)), (JGE, LEN_HI, "eperm", None),
              ld(_arg(4, True)), (JGE, ZONE_HI[0], None, "allow"), (JGT, ZONE_HI[1], "allow", "eperm")]
    lines += ["shmat", ld(_arg(2)), (JSET, SHM_REMAP, "eperm", "allow")]
    lines += ["allow", (RET, RET_ALLOW, None, None), "eperm", (RET, RET_ERRNO | errno.EPERM, None, None),
              "enosys", (RET, RET_ERRNO | errno.ENOSYS, None, None),
              "notify", (RET, RET_USER_NOTIF, None, None)]
    return _assemble(lines)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _load(instructions, flags):
    code = b"".join(instructions)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Fprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "no_new_privs")
    SYS_SECCOMP, SET_MODE_FILTER = 317, 1
    rc = libc.syscall(SYS_SECCOMP, SET_MODE_FILTER, flags, ctypes.byref(prog))
    if rc < 0:
        raise OSError(ctypes.get_errno(), "seccomp")
    return rc


def install(weak=()):
    """Load the filter for every thread of this process; returns a line for ``%smol status``.
    ``weak``: tests only, ``socket-families`` leaves out the socket family check."""
    if os.uname().machine != "x86_64":
        return "off: no filter for this CPU architecture (%s)" % os.uname().machine
    families = "socket-families" not in weak
    _load(program(families=families), 1)  # SECCOMP_FILTER_FLAG_TSYNC
    return "on (%d refused syscalls, namespace flags%s checked)" % (
        len(DENY_X86_64), " and socket families" if families else "")


def install_guard(addr, allowed, tmpfs, store_opts):
    """Load the mount guard for every thread; returns its notification listener (the keeper's)."""
    if os.uname().machine != "x86_64":
        raise OSError(errno.ENOSYS, "no mount guard for this CPU architecture")
    TSYNC, NEW_LISTENER, TSYNC_ESRCH = 1, 8, 16
    return _load(guard_program(addr, allowed, tmpfs, store_opts), TSYNC | NEW_LISTENER | TSYNC_ESRCH)
