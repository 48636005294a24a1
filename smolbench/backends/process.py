"""The process backend: the guest agent as a plain host process. NO isolation.

For hosts without bubblewrap (and without KVM): cells run with the kernel's own
user, files and network. It is labelled ``process`` everywhere (up line, status,
ledger, widget) and ``%smol up`` says loudly what that means. Limits still
apply (a cgroup per machine where one is writable, else rlimits), and
``%smol down`` still kills everything a machine started, double-forked
``setsid`` daemons included: the agent runs under a small keeper (``_reaper``,
a child subreaper) that every orphan is reparented to, so the whole machine
stays one process tree, which is killed until empty (the keeper also does this
itself if the kernel dies); the machine's cgroup, where there is one, is emptied
too; and a per-machine marker in the environment is a last net.
"""

from __future__ import annotations

import builtins
import os
import sys
import uuid
from pathlib import Path

from ..guest import GUEST_DIR
from ..spec import MachineSpec
from . import _procs
from ._agenthost import AgentHostBackend
from .base import MachineRef
from .sandbox import _cloudpickle_dir

MARKER = "SMOLBENCH_PROCESS_MACHINE"
ISOLATION = ("NONE: plain host processes (no bubblewrap); cells can read and write your files, "
             "use the network and see your processes")


class ProcessBackend(AgentHostBackend):
    """Machines as plain processes on this host (no isolation); branches by ``os.fork()``."""

    name = "process"
    nproc_per_machine = False  # no user namespace: RLIMIT_NPROC counts all of this user's processes

    @property
    def isolation(self) -> str:
        return ISOLATION

    def _command(self, spec: MachineSpec, name: str, run_dir: Path, workspace: Path,
                 agent_args: builtins.list[str], packages: Path | None = None) -> tuple[builtins.list[str], str, str]:
        argv = [sys.executable, "-I", "-S", str(Path(__file__).with_name("_reaper.py")), str(os.getpid()), "--",
                sys.executable, "-u", str(GUEST_DIR / "agent.py"), "--socket", str(run_dir / f"{name}.sock"),
                "--name", name, "--workdir", str(workspace), "--ready", str(run_dir / f"{name}.ready"),
                "--no-mount-ns", *agent_args]
        cp = _cloudpickle_dir()
        if cp:
            argv += ["--lib", str(cp.parent)]
        if packages is not None:  # no isolation here: the cache is on the sys.path as it is
            argv += ["--packages", str(packages)]
        return argv, str(run_dir), str(workspace)

    def _nproc(self, spec: MachineSpec) -> int:
        return _user_tasks() + spec.pids  # RLIMIT_NPROC counts this user's other processes too

    def _host_env(self, spec: MachineSpec, name: str) -> dict[str, str]:
        env = super()._host_env(spec, name)
        env[MARKER] = self._marker(name)
        return env

    def _marker(self, name: str) -> str:
        token = getattr(self, "_token", None)
        if token is None:
            token = self._token = uuid.uuid4().hex
        return f"{token}-{name}"

    def _kill_root(self, ref: MachineRef, proc: object) -> None:
        super()._kill_root(ref, proc)  # type: ignore[arg-type]
        # Anything that left the tree (its parent died first) but kept the marker.
        for _ in range(3):
            left = _procs.with_env(MARKER, self._marker(ref.name))
            if not left:
                break
            _procs.kill_all(left)


def _user_tasks() -> int:
    """Tasks (threads included) this user has now: RLIMIT_NPROC counts them all."""
    uid, total = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1").strip())
    return total
