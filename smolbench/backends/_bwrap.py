"""The bubblewrap command line of a sandbox machine: what it sees, and as whom it runs.

The sandbox never holds host root. When the kernel runs as root, bwrap is started
as a dedicated unprivileged host uid (``SANDBOX_UID``, owning no host files), so
uid 0 inside means nothing on the host; otherwise it runs as the kernel's own uid.
Host paths are opened here, by the kernel, and handed to bwrap as file
descriptors (``--ro-bind-fd``), so a Python under a root-only directory still
works. The machine's /etc holds only what Python and common libraries read.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..guest import AGENT_FILES, GUEST_DIR
from ..spec import MachineSpec

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

    def bind_fd(self, host: str, guest: str, readonly: bool = True) -> None:
        fd = os.open(host, os.O_PATH | os.O_CLOEXEC)
        self.fds.append(fd)
        self.paths[f"/proc/self/fd/{fd}"] = host
        self.argv += ["--ro-bind-fd" if readonly else "--bind-fd", str(fd), guest]

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


def write_etc(folder: Path, name: str, uid: int, gid: int, net: bool) -> list[tuple[Path, str]]:
    """Files made for this machine: (host file, guest path)."""
    folder.mkdir(mode=0o755)
    files = {
        "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nsmolbench:x:{uid}:{gid}:smolbench machine:/workspace:/bin/sh\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsmolbench:x:{gid}:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost {hostname(name)}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "hostname": hostname(name) + "\n",
    }
    out = []
    for fname, text in files.items():
        (folder / fname).write_text(text)
        out.append((folder / fname, f"/etc/{fname}"))
    if net and os.path.exists("/etc/resolv.conf"):
        out.append((Path("/etc/resolv.conf"), "/etc/resolv.conf"))
    return out


def hostname(name: str) -> str:
    return f"smol-{name}"[:63]


def plan(spec: MachineSpec, name: str, bwrap: str, run_dir: Path, rootfs: Path | None) -> Plan:
    """The bwrap command for machine ``name`` whose host folder is ``run_dir``."""
    uid, gid = sandbox_ids()
    weak = weakened()
    p = Plan([bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"])
    if "host-root" in weak:  # the old, broken configuration: uid 0 inside is host root
        p.argv += ["--uid", "0", "--gid", "0", "--cap-add", "CAP_SYS_ADMIN"]
    else:
        p.argv += ["--cap-drop", "ALL"]
    if spec.network_enabled:
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
            for host, guest in write_etc(run_dir / "etc", name, uid, gid, spec.network_enabled):
                p.bind_fd(str(host), guest)
            p.argv += ["--symlink", "/tmp", "/var/tmp"]
    else:
        python = "/usr/bin/python3"
        for entry in sorted(os.listdir(rootfs)):
            if entry not in SPECIAL_DIRS:
                p.argv += _bind_entry(rootfs, entry)
    p.argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run",
               "--dir", GUEST_RUN, "--dir", GUEST_STORE, "--dir", spec.workdir]
    p.bind_fd(str(run_dir / "m"), GUEST_RUN, readonly=False)
    for fname in AGENT_FILES:
        p.bind_fd(str(GUEST_DIR / fname), f"{GUEST_AGENT}/{fname}")
    cp = _cloudpickle_dir()
    if cp:
        p.bind_fd(str(cp), f"{GUEST_LIB}/cloudpickle")
    keep = []
    if rootfs is None:
        # The notebook's own Python may live in a hidden place (a home, /root, /tmp):
        # bind just its installation, read-only, at the same path.
        for prefix in python_prefixes():
            p.bind_fd(prefix, prefix)
            if prefix == "/tmp" or prefix.startswith("/tmp/"):
                keep.append(prefix)
    for vol in spec.volumes:
        p.bind_fd(vol.host, vol.guest, readonly=vol.readonly)
    if "host-root" not in weak:
        p.argv += ["--remount-ro", "/run", "--remount-ro", "/"]
    p.argv += ["--hostname", hostname(name), "--chdir", "/", "--clearenv"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": spec.workdir, "USER": "smolbench", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "SMOLBENCH_MACHINE": name, **spec.env_dict}
    for key, val in env.items():
        p.argv += ["--setenv", key, val]
    p.argv += [python, "-u", f"{GUEST_AGENT}/agent.py", "--socket", f"{GUEST_RUN}/s", "--name", name,
               "--workdir", spec.workdir, "--ready", f"{GUEST_RUN}/ready"]
    if cp:
        p.argv += ["--lib", GUEST_LIB]
    if "host-root" not in weak:
        p.argv += ["--contain"] + [f"--keep={k}" for k in keep]
        if spec.disk_mib:
            p.argv += ["--disk-mib", str(spec.disk_mib)]
        if spec.network_enabled:
            p.argv.append("--net")
        if weak:
            p.argv.append("--weaken=" + ",".join(sorted(weak)))
    return p


def _bind_entry(root: Path, entry: str) -> list[str]:
    src = root / entry
    if src.is_symlink():
        return ["--symlink", os.readlink(src), f"/{entry}"]
    if src.is_dir():
        return ["--ro-bind", str(src), f"/{entry}"]
    return []

