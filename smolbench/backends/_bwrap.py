"""The bubblewrap command line of a sandbox machine: what it sees, and as whom it runs.

The sandbox never holds host root. When the kernel runs as root, bwrap is started
as a dedicated unprivileged host uid (``SANDBOX_UID``, owning no host files), so
uid 0 inside means nothing on the host; otherwise it runs as the kernel's own uid.
Host paths are opened here, by the kernel, and handed to bwrap as file
descriptors (``--ro-bind-fd``); bwrap still resolves them by path as the sandbox
uid, so a root kernel stages the folders that uid can't pass (``_stage``). The
machine's /etc holds only what Python and common libraries read.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .. import signing
from ..errors import SmolbenchError
from ..guest import AGENT_FILES, GUEST_DIR
from ..spec import MachineSpec
from . import _stage
from ._limits import thread_env
from ._netproxy import proxy_env

# Host root entries a default sandbox sees read-only; home, /root, /etc, /var, /opt, /srv,
# /mnt and the rest stay hidden unless a Smolfile volume declares them.
HOST_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# The host /etc entries a machine gets (when present): loader, time zone, TLS roots,
# name service and MIME tables. Never passwd/shadow/sudoers/ssh/pip credentials.
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "nsswitch.conf",
               "host.conf", "gai.conf", "protocols", "services", "mime.types", "os-release",
               "debian_version", "alternatives", "ssl/certs", "ssl/openssl.cnf", "ca-certificates",
               "ca-certificates.conf", "fonts", "locale.alias", "magic", "magic.mime", "matplotlibrc")
# Entries of a rootfs image that are never bound from the image itself.
SPECIAL_DIRS = {"proc", "dev", "sys", "tmp", "run", "lost+found"}
GUEST_RUN = "/run/smolbench"  # the machine's own run folder (guest/contain.py RUN)
GUEST_STORE = "/run/smolbench-layers"  # its copy-on-write layers (guest/contain.py STORE)
GUEST_AGENT = "/run/smolbench-agent"
GUEST_LIB = "/run/smolbench-lib"
GUEST_PACKAGES = "/run/smolbench-packages"  # the Smolfile's packages, installed on the host (read-only)
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage"
SANDBOX_UID = int(os.environ.get("SMOLBENCH_SANDBOX_UID", "1999999999"))
# Test-only: containment steps to leave out, to show a probe catches the escape.
WEAKEN_VAR = "SMOLBENCH_TEST_WEAKEN"


def sandbox_ids() -> tuple[int, int]:
    """The host uid and gid a sandbox runs as: never root."""
    if os.geteuid() == 0:
        return SANDBOX_UID, SANDBOX_UID
    return os.geteuid(), os.getegid()


def weakened() -> frozenset[str]:
    """Containment steps a test asked to skip (never set outside tests)."""
    return frozenset(w for w in os.environ.get(WEAKEN_VAR, "").split(",") if w)


@dataclass
class Plan:
    """A bwrap command line and the host file descriptors it refers to."""

    argv: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)  # "/proc/self/fd/N" -> host path, for messages
    sources: list[str] = field(default_factory=list)  # host paths bwrap resolves (resolved), to stage
    grants: int | None = None  # the write end of the machine keeper's grants pipe (mountguard.py)

    def bind_fd(self, host: str, guest: str, readonly: bool = True) -> None:
        try:
            fd = os.open(host, os.O_PATH | os.O_CLOEXEC)
        except PermissionError:
            raise SmolbenchError(f"this kernel (uid {os.geteuid()}) can't reach {host} (a folder above it is not "
                                 "traversable): make its parent folders traversable (`chmod o+x`), or put it elsewhere") from None
        self.fds.append(fd)
        self.source(host, write=not readonly)
        self.paths[f"/proc/self/fd/{fd}"] = host
        self.argv += ["--ro-bind-fd" if readonly else "--bind-fd", str(fd), guest]

    def source(self, host: str | Path, write: bool = False) -> None:
        """A host path the sandbox uid must read (or write): staged for a root kernel, checked here."""
        real = os.path.realpath(host)
        uid, gid = sandbox_ids()
        if not _stage.readable(real, uid, gid, write):
            st = os.stat(real)
            what, able, fix = ("write", "writable", "o+rwX") if write else ("read", "readable", "o+rX")
            raise SmolbenchError(f"the sandbox uid {uid} can't {what} {host} (owner uid {st.st_uid}, mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}): make it {able} to others (`chmod {fix}`), "
                                 "or put it elsewhere")
        self.sources.append(real)

    def data(self, content: bytes, guest: str) -> None:
        """A read-only file made from ``content`` (no host path: nothing to resolve or reach)."""
        fd = os.memfd_create("smolbench", os.MFD_CLOEXEC)
        os.write(fd, content)
        os.lseek(fd, 0, os.SEEK_SET)
        self.fds.append(fd)
        self.argv += ["--ro-bind-data", str(fd), guest]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _cloudpickle_dir() -> Path | None:
    try:
        import cloudpickle
    except ImportError:
        return None
    return Path(cloudpickle.__file__).resolve().parent


def python_prefixes() -> list[str]:
    """The notebook's Python installation(s) outside the system directories."""
    out = set()
    for prefix in (sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)):
        if not any(prefix == f"/{d}" or prefix.startswith(f"/{d}/") for d in HOST_SYSTEM_DIRS):
            out.add(prefix)
    # A prefix inside another is bound with it.
    return sorted(p for p in out if not any(p != q and p.startswith(q + "/") for q in out))


def made_etc(name: str, uid: int, gid: int) -> dict[str, str]:
    """The /etc files made for this machine (name -> content)."""
    return {
        "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nsmolbench:x:{uid}:{gid}:smolbench machine:/workspace:/bin/sh\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsmolbench:x:{gid}:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost {hostname(name)}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "hostname": hostname(name) + "\n",
    }


def hostname(name: str) -> str:
    return f"smol-{name}"[:63]


def as_sandbox_uid(argv: list[str]) -> list[str]:
    """``argv`` run as the sandbox uid/gid with no supplementary groups (the kernel is root).
    A prefix, not ``subprocess(user=...)``: the limits' cgroup join runs first, as root."""
    uid, gid = sandbox_ids()
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all", "--", *argv]
    code = (f"import os, sys; os.setgroups([]); os.setresgid({gid}, {gid}, {gid}); os.setresuid({uid}, {uid}, {uid}); "
            "os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-I", "-S", "-c", code, *argv]


def disk_mib(spec: MachineSpec) -> int:
    """The machine's files budget: the Smolfile's ``disk``, else half its memory (files live in
    memory and, under a cgroup, count as it: see ``MachineSpec.files_mib``)."""
    return spec.files_mib


def run_folder_mib(spec: MachineSpec) -> int:
    """The run folder's size: a save stage (namespace <= memory; the workspace streams out through
    a fifo), a restore's (namespace, workspace <= disk) and sockets."""
    return spec.memory + disk_mib(spec) + 16


def plan(spec: MachineSpec, name: str, bwrap: str, rootfs: Path | None,
         agent_args: list[str] = (), sized: bool = True, packages: Path | None = None) -> Plan:  # type: ignore[assignment]
    """The bwrap command for machine ``name``. ``sized``: every filesystem in memory a machine
    can write gets a size (off only when a test switches the limits off). ``packages``: the
    host's installed tree of the Smolfile's packages, bound read-only at ``GUEST_PACKAGES``."""
    p = Plan([bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"])
    try:
        _fill(p, spec, name, rootfs, agent_args, sized, packages)
    except BaseException:
        p.close()
        raise
    return p


def _fill(p: Plan, spec: MachineSpec, name: str, rootfs: Path | None, agent_args: list[str], sized: bool,
          packages: Path | None) -> None:
    uid, gid = sandbox_ids()
    weak = weakened()
    if "host-root" in weak:  # the old, broken configuration: uid 0 inside is host root
        p.argv += ["--uid", "0", "--gid", "0", "--cap-add", "CAP_SYS_ADMIN"]
    else:
        p.argv += ["--cap-drop", "ALL"]
    if "net-share" in weak:  # the old, broken configuration: the host's network, loopback and all
        p.argv.append("--share-net")
    if rootfs is None:
        python = sys.executable
        system = HOST_SYSTEM_DIRS + (("etc", "var", "opt") if "host-root" in weak else ())
        for entry in system:
            p.argv += _bind_entry(Path("/"), entry)
        if "host-root" not in weak:
            for entry in ETC_ENTRIES:
                src = Path("/etc") / entry
                if src.is_symlink() and not entry.startswith("ssl/"):
                    p.argv += ["--symlink", os.readlink(src), f"/etc/{entry}"]
                elif src.exists():
                    p.argv += ["--ro-bind", str(src), f"/etc/{entry}"]
            for fname, text in made_etc(name, uid, gid).items():
                p.data(text.encode(), f"/etc/{fname}")
            if "net-share" in weak and os.path.exists("/etc/resolv.conf"):
                p.argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
            p.argv += ["--symlink", "/tmp", "/var/tmp"]
    else:
        python = "/usr/bin/python3"
        p.source(rootfs)
        signing.check_image(os.path.realpath(rootfs))  # every entry of it is bound: never one holding the key
        for entry in sorted(os.listdir(rootfs)):
            if entry not in SPECIAL_DIRS:
                _bind_image_entry(p, rootfs, entry)
    # The machine's run folder (its socket) is a tmpfs of its own: the host reaches it through
    # /proc/PID/root, so no host folder is writable from inside.
    p.argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run",
               "--dir", GUEST_STORE, "--dir", spec.workdir, "--perms", "0700"]
    if sized:
        p.argv += ["--size", str(run_folder_mib(spec) << 20)]
    p.argv += ["--tmpfs", GUEST_RUN]
    for fname in AGENT_FILES:
        p.data((GUEST_DIR / fname).read_bytes(), f"{GUEST_AGENT}/{fname}")
    cp = _cloudpickle_dir()
    if cp:
        p.bind_fd(str(cp), f"{GUEST_LIB}/cloudpickle")
    if packages is not None:  # read-only, like the agent: a cell can't change what every branch imports
        p.bind_fd(str(packages), GUEST_PACKAGES)
    keep = []
    if rootfs is None:
        # The notebook's own Python may live in a hidden place (a home, /root, /tmp):
        # bind just its installation, read-only, at the same path.
        for prefix in python_prefixes():
            key_dir = signing.key_overlap(prefix)
            if key_dir is not None:  # (as the user's own uid, a machine could read it there)
                raise SmolbenchError(f"this Python's installation {prefix}, which sandboxes bind read-only, holds the "
                                     f"folder of your checkpoint key ({key_dir}): a machine could read the key and "
                                     f"sign checkpoints as yours; set $SMOLBENCH_STATE to a folder outside {prefix}")
            p.bind_fd(prefix, prefix)
            if prefix == "/tmp" or prefix.startswith("/tmp/"):
                keep.append(prefix)
    for vol in spec.volumes:
        signing.check_volume(vol.host, vol.readonly, vol.guest)  # its real path now (a part of it may have been made a link since parsing)
        p.bind_fd(vol.host, vol.guest, readonly=vol.readonly)
        signing.check_volume(os.readlink(f"/proc/self/fd/{p.fds[-1]}"), vol.readonly, vol.guest)  # and what was opened to be bound
    # The warm heap in transparent huge pages: a fork copies ~100 PMD entries per 200 MiB
    # instead of ~51,200 PTEs, and a branch forks twice (keeper, then agent). glibc reads the
    # THP mode from sysfs, so that folder (settings only) is bound read-only.
    if os.path.isdir(THP_SYSFS):
        p.argv += ["--ro-bind", THP_SYSFS, THP_SYSFS]
    if "host-root" not in weak:
        p.argv += ["--remount-ro", "/run", "--remount-ro", "/"]
        if sized:  # bwrap's /dev is a tmpfs of no size; its devices and /dev/shm are mounts of their own
            p.argv += ["--remount-ro", "/dev"]
    p.argv += ["--hostname", hostname(name), "--chdir", "/", "--clearenv"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": spec.workdir, "USER": "smolbench", "LANG": "C.UTF-8",
           "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
           "PYTHONDONTWRITEBYTECODE": "1", "SMOLBENCH_MACHINE": name, **thread_env(spec)}
    if spec.policy.enabled and "net-share" not in weak:  # the only way out: the egress proxy (_netproxy)
        env.update(proxy_env())
    env.update(SMOLBENCH_NET_POLICY=spec.policy.describe(), **spec.env_dict)
    for key, val in env.items():
        p.argv += ["--setenv", key, val]
    p.argv += [python, "-u", f"{GUEST_AGENT}/agent.py", "--socket", f"{GUEST_RUN}/s", "--name", name,
               "--workdir", spec.workdir, "--ready", f"{GUEST_RUN}/ready"]
    if cp:
        p.argv += ["--lib", GUEST_LIB]
    if packages is not None:
        p.argv += ["--packages", GUEST_PACKAGES]
    p.argv += list(agent_args)
    if "host-root" not in weak:
        p.argv += ["--contain"] + [f"--keep={k}" for k in keep]
        # The host grants one branch store per branch it orders; only the keeper reads this.
        read, p.grants = os.pipe()
        os.set_blocking(p.grants, False)
        p.fds.append(read)
        p.argv.append(f"--grants-fd={read}")
        if sized or spec.disk_mib:
            p.argv += ["--disk-mib", str(disk_mib(spec) if sized else spec.disk_mib)]
        if "net-share" in weak:
            p.argv.append("--net")
        if weak:
            p.argv.append("--weaken=" + ",".join(sorted(weak)))


def _bind_image_entry(p: Plan, rootfs: Path, entry: str) -> None:
    """An entry of a rootfs image, bound by descriptor: a built image's ``rootfs`` is the checked folder
    itself (``/proc/self/fd/N``, images.held_rootfs), which bwrap could not resolve by that path. Its
    reach for the sandbox uid is the image folder's (``source``, staged): an entry of its own may be 0700."""
    src = rootfs / entry
    if src.is_symlink():
        p.argv += ["--symlink", os.readlink(src), f"/{entry}"]
    elif src.is_dir():
        fd = os.open(src, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
        p.fds.append(fd)
        p.paths[f"/proc/self/fd/{fd}"] = str(src)
        p.argv += ["--ro-bind-fd", str(fd), f"/{entry}"]


def _bind_entry(root: Path, entry: str) -> list[str]:
    src = root / entry
    if src.is_symlink():
        return ["--symlink", os.readlink(src), f"/{entry}"]
    if src.is_dir():
        return ["--ro-bind", str(src), f"/{entry}"]
    return []

