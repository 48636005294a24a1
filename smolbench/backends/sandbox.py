"""The sandbox backend: the guest agent in a bubblewrap sandbox (no KVM needed).

Namespace isolation, not a VM: the machine has its own root filesystem (the
host's system directories read-only, or a pinned rootfs image), its own /tmp,
/run and workspace, no network unless asked, and no view of the host's home.
It shares the host kernel. A live branch is an ``os.fork()`` of the warm agent
inside the same sandbox, with its own socket and private copies of the
workspace and /tmp. Talking to the agent, branching, limits and deleting are
shared with the process backend (``_agenthost``); this module is the sandbox.

Without ``bwrap`` on the host this backend refuses to start and says how to
install it; the ``process`` backend is the no-isolation alternative.
"""

from __future__ import annotations

import builtins
import os
import shutil
import sys
from pathlib import Path

from ..errors import BackendUnavailable
from ..guest import AGENT_FILES, GUEST_DIR
from ..spec import MachineSpec
from . import _limits
from ._agenthost import AgentHostBackend

# Host root entries a default sandbox sees (read-only); the rest (home, /root,
# /mnt, /work, /srv, ...) stays hidden unless a Smolfile volume declares it.
HOST_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt", "var")
# Entries of a rootfs image that are never bound from the image itself.
SPECIAL_DIRS = {"proc", "dev", "sys", "tmp", "run", "lost+found"}
GUEST_RUN = "/run/smolbench"
GUEST_AGENT = "/run/smolbench-agent"
GUEST_LIB = "/run/smolbench-lib"
CHECKPOINT_SUFFIX = ".smolcheckpoint"


def bwrap_path() -> str | None:
    """The bubblewrap binary, if installed."""
    return shutil.which("bwrap")


def _cloudpickle_dir() -> Path | None:
    try:
        import cloudpickle
    except ImportError:
        return None
    return Path(cloudpickle.__file__).resolve().parent


class SandboxBackend(AgentHostBackend):
    """Machines as bubblewrap sandboxes on this host; branches by ``os.fork()``."""

    name = "sandbox"

    def __init__(self, *, runtime_dir: str | None = None) -> None:
        bwrap = bwrap_path()
        if not bwrap:
            raise BackendUnavailable(
                "the sandbox backend needs bubblewrap, which is not installed: "
                "`apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap` (Fedora), "
                "or use `--backend process` (no isolation)")
        super().__init__(runtime_dir=runtime_dir)
        self._bwrap = bwrap

    @property
    def isolation(self) -> str:
        return "bubblewrap sandbox: namespace isolation (own rootfs, /tmp, pid and network namespaces), not a VM; shares the host kernel"

    def _command(self, spec: MachineSpec, name: str, run_dir: Path, workspace: Path,
                 agent_args: builtins.list[str]) -> tuple[builtins.list[str], str, str]:
        from ..images import resolve_rootfs

        rootfs = resolve_rootfs(spec.image)
        cp = _cloudpickle_dir()
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0",
                "--cap-add", "CAP_SYS_ADMIN", "--die-with-parent", "--new-session"]
        if spec.network_enabled:
            argv.append("--share-net")
        if rootfs is None:
            python = sys.executable
            for entry in HOST_SYSTEM_DIRS:
                argv += _bind_entry(Path("/"), entry)
            # The notebook's own Python may live in a hidden place (a home directory):
            # expose just its installation, read-only.
            for prefix in sorted({sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}):
                if not any(prefix == f"/{d}" or prefix.startswith(f"/{d}/") for d in HOST_SYSTEM_DIRS):
                    argv += ["--ro-bind", prefix, prefix]
        else:
            python = "/usr/bin/python3"
            for entry in sorted(os.listdir(rootfs)):
                if entry not in SPECIAL_DIRS:
                    argv += _bind_entry(rootfs, entry)
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run",
                 "--bind", str(run_dir), GUEST_RUN, "--bind", str(workspace), spec.workdir]
        for fname in AGENT_FILES:
            argv += ["--ro-bind", str(GUEST_DIR / fname), f"{GUEST_AGENT}/{fname}"]
        if cp:
            argv += ["--ro-bind", str(cp), f"{GUEST_LIB}/cloudpickle"]
        for vol in spec.volumes:
            argv += ["--ro-bind" if vol.readonly else "--bind", vol.host, vol.guest]
        argv += ["--hostname", f"smol-{name}"[:63], "--chdir", spec.workdir, "--clearenv"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": spec.workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "SMOLBENCH_MACHINE": name, **_limits.thread_env(spec),
               **spec.env_dict}
        for key, val in env.items():
            argv += ["--setenv", key, val]
        argv += [python, "-u", f"{GUEST_AGENT}/agent.py", "--socket", f"{GUEST_RUN}/{name}.sock",
                 "--name", name, "--workdir", spec.workdir, "--ready", f"{GUEST_RUN}/{name}.ready", *agent_args]
        if cp:
            argv += ["--lib", GUEST_LIB]
        return argv, GUEST_RUN, spec.workdir


def _bind_entry(root: Path, entry: str) -> list[str]:
    src = root / entry
    if src.is_symlink():
        return ["--symlink", os.readlink(src), f"/{entry}"]
    if src.is_dir():
        return ["--ro-bind", str(src), f"/{entry}"]
    return []
