"""MachineSpec: what a machine is made from, independent of the backend."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from .netpolicy import NetPolicy

# The parts of a machine that decide whether a restored checkpoint's variables and files behave
# as they did (each compared by a short hash; the image by its name): what its Smolfile installs
# and runs, not what a session allows (network) or how big a machine is (limits).
RESTORE_PARTS = ("packages", "env", "init", "workdir", "volumes")


@dataclass(frozen=True)
class Volume:
    """A host directory mounted into the machine (only when declared)."""

    host: str
    guest: str
    readonly: bool = True


@dataclass(frozen=True)
class MachineSpec:
    """Everything a backend needs to create a machine.

    ``image`` is ``None`` for the backend's default image: the host's own root
    filesystem read-only on the sandbox backend, the SDK's default on smol.
    """

    image: str | None = None
    cpus: int = 1
    memory: int = 1024  # MiB
    net: bool = False
    allow_hosts: tuple[str, ...] = ()
    allow_cidrs: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    workdir: str = "/workspace"
    init: tuple[str, ...] = ()
    volumes: tuple[Volume, ...] = ()
    branch: bool = True
    pids: int = 256  # processes and threads the machine may have at once
    disk_mib: int | None = None  # workspace + /tmp budget; None: the backend's default (sandbox: files_mib)
    init_timeout: float = 300.0  # seconds all of ``init`` may take
    max_alive: int = 8  # kept (idle) machines alive at once; more are deleted, least recently used first
    episodes_fresh: str = "zygote"  # [episodes] fresh: "zygote" (branches of a pristine machine) or "boot"
    packages: tuple[str, ...] = ()  # pip requirement strings, installed on the host and mounted read-only
    source: str | None = field(default=None, compare=False)  # Smolfile path, for messages

    @property
    def env_dict(self) -> dict[str, str]:
        """The environment as a plain dict."""
        return dict(self.env)

    @property
    def network_enabled(self) -> bool:
        """True when the machine may reach any network at all."""
        return self.net or bool(self.allow_hosts) or bool(self.allow_cidrs)

    @property
    def files_mib(self) -> int:
        """The budget for files a sandbox keeps in memory (workspace, /tmp, /dev/shm): the
        Smolfile's ``disk``, else half of ``memory``. Under a cgroup those files count as the
        machine's memory, so a default disk as big as memory let a full disk kill the machine
        for memory; half leaves the machine room to live, and a full disk fails with ENOSPC.
        Not in ``baseline()``: the Smolfile is the same, only the default's meaning moved."""
        return self.disk_mib or self.default_files_mib

    @property
    def default_files_mib(self) -> int:
        """:attr:`files_mib` when the Smolfile sets no ``disk``: half of ``memory`` (16 MiB at least)."""
        return max(self.memory // 2, 16)

    @property
    def policy(self) -> NetPolicy:
        """The network policy (off / on / allow-list), the same on every backend."""
        return NetPolicy.from_lists(self.net, self.allow_hosts, self.allow_cidrs)

    def parts(self) -> dict[str, str]:
        """A short hash of each of :data:`RESTORE_PARTS` of this machine (volumes by where they
        are mounted, not by the host folder), which a checkpoint's record and row carry, and a
        restore compares with its own machine's. Not its network policy or limits: a session's
        ``--allow`` or ``memory`` changes what a machine may do, not what its namespace needs."""
        data: dict[str, object] = {"packages": list(self.packages), "env": sorted(self.env), "init": list(self.init),
                                   "workdir": self.workdir, "volumes": sorted(v.guest for v in self.volumes)}
        return {k: part_hash(data[k]) for k in RESTORE_PARTS}

    def machine(self) -> dict[str, object]:
        """What a checkpoint's record says of the machine that saved it (its ``image``,
        :meth:`parts`, ``packages`` as written, ``memory`` and ``cpus``)."""
        return {"image": self.image, "parts": self.parts(), "packages": list(self.packages),
                "memory": self.memory, "cpus": self.cpus}

    def baseline(self) -> str:
        """A short, stable identifier of this baseline (recorded in the ledger)."""
        data = asdict(self)
        for key in ("source", "init_timeout", "max_alive", "episodes_fresh"):  # policy, not what the machine is
            data.pop(key, None)
        if not data["packages"]:  # baselines from before the key existed stay the same
            del data["packages"]
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.image or 'host'}@{digest}"


def part_hash(value: object) -> str:
    """The short hash of one of :meth:`MachineSpec.parts` (JSON of ``value``)."""
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:12]
