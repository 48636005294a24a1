"""Parse a Smolfile (TOML) into a :class:`~smolbench.spec.MachineSpec`.

Example::

    image = "debian:bookworm"      # or "./rootfs", or an OCI ref on the smol backend
    cpus = 2
    memory = "2G"                  # or an integer number of MiB; at most the host's RAM
    pids = 256                     # processes and threads at once (a fork bomb stops here)
    disk = "1G"                    # workspace + /tmp budget (sandbox default: half of memory)
    init_timeout = 300             # seconds all of init may take
    max_alive = 8                  # kept idle machines alive at once (least recently used go first)
    net = false
    workdir = "/workspace"
    init = ["echo ready"]
    packages = ["gymnasium==1.0.0", "numpy<3"]   # pip requirements, installed once on the host
    volumes = [{ host = "data", guest = "/data", readonly = true }]

    [env]
    SEED = "0"

    [network]
    allow_hosts = ["pypi.org", "files.pythonhosted.org:443"]
    allow_cidrs = ["10.0.0.0/8", "127.0.0.2/32:8080"]   # a port is optional

    [branch]
    enabled = true

    [episodes]
    fresh = "zygote"   # or "boot": every episode boots its own machine

Every problem raises :class:`~smolbench.errors.SmolfileError` with one line
naming the file, the line, the key, the problem and the fix.
"""

from __future__ import annotations

import difflib
import errno
import os
import posixpath
import re
import sys
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, NoReturn

from smolbench import signing
from smolbench._pkgtrust import read_plain
from smolbench.backends._host import host_cpus, host_memory_mib
from smolbench.errors import SmolbenchError, SmolfileError
from smolbench.images import has_python, home_path, is_path_image, is_valid_image_name
from smolbench.netpolicy import PolicyError, host_problem, parse_cidr
from smolbench.packages import requirement_problem
from smolbench.spec import MachineSpec, Volume

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

TOP_KEYS = (
    "branch",
    "cluster",
    "cpus",
    "disk",
    "env",
    "episodes",
    "image",
    "init",
    "init_timeout",
    "max_alive",
    "memory",
    "net",
    "network",
    "packages",
    "pids",
    "volumes",
    "workdir",
)
TABLES = ("branch", "cluster", "env", "episodes", "network")
CLUSTER_KEYS = ("address",)  # [cluster] address = "auto": machines run on a Ray cluster (smolbench.cluster)
NETWORK_KEYS = ("allow_cidrs", "allow_hosts")
BRANCH_KEYS = ("enabled",)
EPISODES_KEYS = ("fresh",)  # [episodes] fresh = "zygote" | "boot" (smolbench/zygote.py)
EPISODES_FRESH = ("zygote", "boot")
VOLUME_KEYS = ("guest", "host", "readonly")

MAX_CPUS = 64
MIN_MEMORY = 128  # MiB
MIN_DISK = 16  # MiB
MIN_PIDS = 16  # the agent itself needs a few threads
MAX_PIDS = 32768
MAX_INIT_TIMEOUT = 86400.0
MAX_ALIVE = 1024

_MEMORY_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)
_MEMORY_UNITS = {"": Decimal(1), "K": Decimal(1) / 1024, "M": Decimal(1), "G": Decimal(1024)}
_MEMORY_UNITS["T"] = Decimal(1024 * 1024)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER_RE = re.compile(r"\s*(\[\[?)\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY_RE = re.compile(r"\s*([A-Za-z0-9_.\-\"' ]+?)\s*=")
_TOML_POS_RE = re.compile(r"\s*\(at line (\d+), column (\d+)\)|\s*\(at end of document\)")


def _describe(value: Any) -> str:
    """A value as a short phrase for messages, spelled the TOML way."""
    if isinstance(value, bool):
        return f"boolean {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value}"
    if isinstance(value, str):
        text = value if len(value) <= 60 else value[:57] + "..."
        return f"string {text!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _allowed(key: str, allowed: tuple[str, ...]) -> str:
    """`` (did you mean 'x'?); allowed keys: ...`` for an unknown key."""
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; allowed keys: {', '.join(allowed)}"


_KEY_PART_RE = re.compile(r'\s*("[^"]*"|\'[^\']*\'|[^."\']+)\s*(?:\.|$)')


def _key_parts(raw: str) -> tuple[str, ...]:
    """A dotted TOML key's parts; a quoted part keeps its dots (``"A.B"`` is one name)."""
    return tuple(m.group(1).strip().strip("\"'") for m in _KEY_PART_RE.finditer(raw.strip()) if m.group(1))


# Folders every machine mounts for itself: a volume there (or above one) hides them, and the
# machine failed to start with an error that named neither.
MACHINE_PATHS = ("/proc", "/sys", "/dev", "/run/smolbench", "/run/smolbench-layers", "/run/smolbench-agent",
                 "/run/smolbench-lib")

class _Lines:
    """Where keys are in the raw text: a simple line scan, good enough for messages."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.where: dict[tuple[str, ...], int] = {}
        section: tuple[str, ...] = ()
        arrays: dict[tuple[str, ...], int] = {}
        in_multiline = False
        for number, line in enumerate(self.lines, start=1):
            if in_multiline:
                if (line.count('"""') + line.count("'''")) % 2:
                    in_multiline = False
                continue
            header = _HEADER_RE.match(line)
            if header:
                path = _key_parts(header.group(2))
                if header.group(1) == "[[":
                    index = arrays.get(path, -1) + 1
                    arrays[path] = index
                    self.where.setdefault(path, number)
                    path = (*path, str(index))
                section = path
                self.where.setdefault(path, number)
                continue
            key = _KEY_RE.match(line)
            if key:
                parts = _key_parts(key.group(1))
                for end in range(1, len(parts) + 1):  # a dotted key makes its tables on its line
                    self.where.setdefault((*section, *parts[:end]), number)
            if (line.count('"""') + line.count("'''")) % 2:
                in_multiline = True

    def line_of(self, *path: str) -> int | None:
        """The line of ``path`` (or of its nearest enclosing key/table found)."""
        for end in range(len(path), 0, -1):
            number = self.where.get(path[:end])
            if number is not None:
                return number
        return None

    def line_of_value(self, value: str, *path: str) -> int | None:
        """The line at or after ``path``'s line that contains ``value`` (for array entries)."""
        start = self.line_of(*path)
        if start is None:
            return None
        for number in range(start, min(start + 200, len(self.lines)) + 1):
            if value in self.lines[number - 1]:
                return number
        return start


class _Parser:
    def __init__(self, text: str, source: str, base_dir: str | None) -> None:
        text = text.removeprefix("\ufeff")  # a byte order mark some editors write: TOML has no use for it
        self.source = source
        self.base_dir = Path(base_dir if base_dir is not None else os.getcwd()).expanduser()
        self.lines = _Lines(text)
        self.text = text

    def fail(self, message: str, line: int | None = None) -> NoReturn:
        where = f"{self.source} line {line}" if line is not None else self.source
        raise SmolfileError(f"{where}: {message}".replace("\n", " "))

    def fail_at(self, message: str, *path: str) -> NoReturn:
        self.fail(message, self.lines.line_of(*path))

    def _home(self, text: str, what: str, *at: str) -> Path:
        """``text`` with ``~`` expanded, or this Smolfile's one line for a ``~user`` there is none of."""
        try:
            return home_path(text, what)
        except SmolbenchError as exc:
            self.fail_at(str(exc), *at)

    # -- parsing -------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        try:
            return tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as exc:
            message = str(exc).replace("\n", " ").strip()
            line: int | None = None
            match = _TOML_POS_RE.search(message)
            if match:
                if match.group(1):
                    line = int(match.group(1))
                    column = match.group(2)
                    message = _TOML_POS_RE.sub("", message) + f" (column {column})"
                else:
                    line = max(len(self.lines.lines), 1)
                    message = _TOML_POS_RE.sub("", message) + " (at end of file)"
            fix = "fix the TOML syntax there"
            if message.startswith("Invalid value"):
                fix += ' (strings need quotes: image = "debian:bookworm")'
            self.fail(f"TOML syntax error: {message}; {fix}", line)

    def parse(self) -> MachineSpec:
        data = self.load()
        for key, value in data.items():
            if key in TOP_KEYS:
                continue
            if isinstance(value, dict) or (
                isinstance(value, list) and value and all(isinstance(v, dict) for v in value)
            ):
                close = difflib.get_close_matches(key, TABLES + ("volumes",), n=1, cutoff=0.6)
                hint = f" (did you mean [{close[0]}]?)" if close else ""
                self.fail_at(
                    f"unknown table [{key}]{hint}; allowed tables: [branch], [cluster], [env], [episodes], [network], "
                    "[[volumes]]",
                    key,
                )
            self.fail_at(f"unknown key {key!r}{_allowed(key, TOP_KEYS)}", key)

        spec: dict[str, Any] = {"source": self.source}
        if "image" in data:
            spec["image"] = self.image(data["image"])
        if "cpus" in data:
            spec["cpus"] = self.cpus(data["cpus"])
        if "memory" in data:
            spec["memory"] = self.memory(data["memory"])
        if "pids" in data:
            spec["pids"] = self.bounded_int(data["pids"], "pids", MIN_PIDS, MAX_PIDS, "processes and threads")
        if "disk" in data:
            spec["disk_mib"] = self.size(data["disk"], "disk", MIN_DISK, "; the workspace and /tmp live in memory")
        if "init_timeout" in data:
            spec["init_timeout"] = self.seconds(data["init_timeout"], "init_timeout")
        if "max_alive" in data:
            spec["max_alive"] = self.bounded_int(data["max_alive"], "max_alive", 1, MAX_ALIVE, "kept machines")
        if "net" in data:
            spec["net"] = self.boolean(data["net"], "net")
        if "env" in data:
            spec["env"] = self.env(data["env"])
        if "workdir" in data:
            spec["workdir"] = self.abspath(data["workdir"], "'workdir'", "workdir")
        if "init" in data:
            spec["init"] = self.init(data["init"])
        if "volumes" in data:
            spec["volumes"] = self.volumes(data["volumes"])
        if "packages" in data:
            spec["packages"] = self.packages(data["packages"])
        if "network" in data:
            network = self.table(data["network"], "network", NETWORK_KEYS)
            if "allow_hosts" in network:
                spec["allow_hosts"] = self.allow_hosts(network["allow_hosts"])
            if "allow_cidrs" in network:
                spec["allow_cidrs"] = self.allow_cidrs(network["allow_cidrs"])
        if "cluster" in data:  # where machines run, not what they are: not part of the spec (or its baseline)
            self.cluster(data["cluster"])
        if "branch" in data:
            branch = self.table(data["branch"], "branch", BRANCH_KEYS)
            if "enabled" in branch:
                spec["branch"] = self.boolean(branch["enabled"], "enabled", "branch")
        if "episodes" in data:
            episodes = self.table(data["episodes"], "episodes", EPISODES_KEYS)
            if "fresh" in episodes:
                fresh = episodes["fresh"]
                if fresh not in EPISODES_FRESH:
                    self.fail_at(f"[episodes] fresh must be \"zygote\" (each episode a branch of a pristine machine) or "
                                 f"\"boot\" (each its own boot), got {_describe(fresh)}", "episodes", "fresh")
                spec["episodes_fresh"] = fresh
        return MachineSpec(**spec)

    # -- keys ----------------------------------------------------------------

    def cluster(self, value: Any) -> dict[str, Any]:
        table = self.table(value, "cluster", CLUSTER_KEYS)
        addr = table.get("address", "auto")
        if not isinstance(addr, str) or not addr.strip():
            self.fail_at(f"[cluster] address must be a string like \"auto\" or \"10.0.0.5:6379\", got {_describe(addr)}",
                         "cluster", "address")
        if addr.startswith("ray://"):
            from .cluster.address import RAY_CLIENT_LINE

            self.fail_at(f"[cluster] address {addr!r}: {RAY_CLIENT_LINE}", "cluster", "address")
        return {"address": addr.strip()}

    def table(self, value: Any, name: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail_at(
                f"{name!r} must be a table (a [{name}] section), got {_describe(value)}", name
            )
        for key in value:
            if key not in allowed:
                self.fail_at(f"unknown key {key!r} in [{name}]{_allowed(key, allowed)}", name, key)
        return value

    def boolean(self, value: Any, key: str, *section: str) -> bool:
        if not isinstance(value, bool):
            where = f"[{section[0]}] " if section else ""
            self.fail_at(
                f"{where}{key!r} must be true or false (no quotes), got {_describe(value)}",
                *section,
                key,
            )
        return value

    def image(self, value: Any) -> str:
        if not isinstance(value, str):
            self.fail_at(
                '\'image\' must be a string like "debian:bookworm" or "./rootfs", '
                f"got {_describe(value)}",
                "image",
            )
        if not value.strip():
            self.fail_at("'image' is empty; remove the key to use the backend's default", "image")
        if "\0" in value:
            self.fail_at("'image' contains a NUL byte; fix the string", "image")
        if is_path_image(value):
            path = self._home(value, "'image'", "image")
            if not path.is_absolute():
                path = self.base_dir / path
            path = path.resolve()
            if not path.is_dir():
                self.fail_at(
                    f"'image' rootfs directory {str(path)!r} does not exist; "
                    "create it or fix the path (relative paths start at the Smolfile's directory)",
                    "image",
                )
            if not has_python(path):
                self.fail_at(
                    f"'image' rootfs directory {str(path)!r} has no usr/bin/python3; "
                    'install python3 in it, or use an image name like "debian:bookworm"',
                    "image",
                )
            try:
                signing.check_image(path)
            except SmolbenchError as exc:
                self.fail_at(f"'image': {exc}", "image")
            return str(path)
        if not is_valid_image_name(value):
            self.fail_at(
                f"'image' {value!r} is neither an image name nor a path; use a name like "
                '"debian:bookworm" or "python:3.12-slim", or a rootfs directory starting '
                "with ./, ../, / or ~",
                "image",
            )
        return value

    def cpus(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            hint = ""
            if isinstance(value, str) and value.strip().isdigit():
                hint = f" (write cpus = {value.strip()}, without quotes)"
            self.fail_at(f"'cpus' must be an integer >= 1, got {_describe(value)}{hint}", "cpus")
        if value < 1:
            self.fail_at(f"'cpus' must be an integer >= 1, got {value}", "cpus")
        if value > MAX_CPUS:
            self.fail_at(f"'cpus' must be an integer <= {MAX_CPUS}, got {value}", "cpus")
        cores = host_cpus()
        if value > cores:
            self.fail_at(
                f"'cpus' is more than this host's {cores} cores, got {value}; write cpus = {cores} or less",
                "cpus",
            )
        return value

    def memory(self, value: Any) -> int:
        return self.size(value, "memory", MIN_MEMORY)

    def size(self, value: Any, key: str, minimum: int, why: str = "") -> int:
        """A size in MiB: an integer, or a string like "512M" / "2G"; at most the host's RAM."""
        example = f'write {key} = 2048 (MiB) or {key} = "2G"'
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            self.fail_at(
                f"'{key}' must be an integer number of MiB or a string like \"2G\", "
                f"got {_describe(value)}; {example}",
                key,
            )
        if isinstance(value, str):
            match = _MEMORY_RE.fullmatch(value)
            if not match:
                self.fail_at(
                    f"'{key}' {value!r} is not a size; use a number with an optional unit "
                    f'K, M, G or T (like "512M" or "2G"); {example}',
                    key,
                )
            try:
                mib = Decimal(match.group(1)) * _MEMORY_UNITS[match.group(2).upper()]
            except InvalidOperation:  # pragma: no cover - the regex admits only numbers
                self.fail_at(f"'{key}' {value!r} is not a size; {example}", key)
            if mib != mib.to_integral_value():
                self.fail_at(f"'{key}' {value!r} is not a whole number of MiB; {example}", key)
            size = int(mib)
        else:
            size = value
        shown = f"{value!r}{' (' + str(size) + ' MiB)' if isinstance(value, str) else ''}"
        if size < minimum:
            self.fail_at(
                f"'{key}' must be at least {minimum} MiB, got {shown}; write {key} = {minimum} or more",
                key,
            )
        host = host_memory_mib()
        if size > host:
            self.fail_at(
                f"'{key}' is more than this host's RAM ({host} MiB{why}), got {shown}; "
                f"write {key} = {host} or less",
                key,
            )
        return size

    def bounded_int(self, value: Any, key: str, low: int, high: int, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            hint = ""
            if isinstance(value, str) and value.strip().isdigit():
                hint = f" (write {key} = {value.strip()}, without quotes)"
            self.fail_at(f"'{key}' must be a whole number of {what}, got {_describe(value)}{hint}", key)
        if not low <= value <= high:
            fix = low if value < low else high
            self.fail_at(
                f"'{key}' must be from {low} to {high} {what}, got {value}; write {key} = {fix}", key
            )
        return value

    def seconds(self, value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail_at(
                f"'{key}' must be a number of seconds, got {_describe(value)}; write {key} = 600",
                key,
            )
        if not 0 < value <= MAX_INIT_TIMEOUT:
            self.fail_at(
                f"'{key}' must be more than 0 and at most {MAX_INIT_TIMEOUT:g} seconds, "
                f"got {value}; write {key} = 600",
                key,
            )
        return float(value)

    def env(self, value: Any) -> tuple[tuple[str, str], ...]:
        if not isinstance(value, dict):
            self.fail_at(
                f"'env' must be a table of NAME = \"value\" strings (an [env] section), "
                f"got {_describe(value)}",
                "env",
            )
        pairs: list[tuple[str, str]] = []
        for name, item in value.items():
            if not _ENV_NAME_RE.fullmatch(name):
                self.fail_at(
                    f"[env] name {name!r} is not a valid variable name; use letters, digits "
                    "and _ (not starting with a digit)",
                    "env",
                    name,
                )
            if not isinstance(item, str):
                message = f"[env] value of {name!r} must be a string, got {_describe(item)}"
                if isinstance(item, (bool, int, float)):
                    shown = str(item).lower() if isinstance(item, bool) else str(item)
                    message += f'; quote it: {name} = "{shown}"'
                self.fail_at(message, "env", name)
            if "\0" in item:
                self.fail_at(f"[env] value of {name!r} contains a NUL byte", "env", name)
            pairs.append((name, item))
        return tuple(sorted(pairs))

    def abspath(self, value: Any, what: str, *path: str) -> str:
        if not isinstance(value, str):
            self.fail_at(
                f'{what} must be an absolute path string like "/workspace", got {_describe(value)}',
                *path,
            )
        if not value.startswith("/"):
            fix = "/" + value.lstrip("./") if value.strip("./") else "/workspace"
            self.fail_at(
                f"{what} must be an absolute path inside the machine, got {value!r}; write {fix!r}",
                *path,
            )
        if "\0" in value:
            self.fail_at(f"{what} contains a NUL byte", *path)
        return posixpath.normpath(value)

    def init(self, value: Any) -> tuple[str, ...]:
        commands = [value] if isinstance(value, str) else value
        if not isinstance(commands, list):
            self.fail_at(
                "'init' must be a shell command string or an array of them, "
                f"got {_describe(value)}",
                "init",
            )
        for index, command in enumerate(commands, start=1):
            if not isinstance(command, str):
                self.fail_at(
                    f"'init' entry {index} must be a shell command string, "
                    f"got {_describe(command)}",
                    "init",
                )
            if not command.strip():
                self.fail_at(f"'init' entry {index} is empty; remove it", "init")
        return tuple(commands)

    def packages(self, value: Any) -> tuple[str, ...]:
        example = 'packages = ["gymnasium==1.0.0", "numpy"]'
        if not isinstance(value, list):
            self.fail_at(f"'packages' must be an array of pip requirement strings like {example}, "
                         f"got {_describe(value)}", "packages")
        result: list[str] = []
        for index, item in enumerate(value, start=1):
            if not isinstance(item, str):
                self.fail_at(f"'packages' entry {index} must be a requirement string like \"gymnasium==1.0.0\", "
                             f"got {_describe(item)}", "packages")
            problem = requirement_problem(item)
            if problem:
                line = self.lines.line_of_value(item, "packages") if item.strip() else self.lines.line_of("packages")
                self.fail(f"'packages' entry {item!r} {problem}", line)
            if item.strip() not in result:
                result.append(item.strip())
        return tuple(result)

    def volumes(self, value: Any) -> tuple[Volume, ...]:
        example = 'volumes = [{ host = "data", guest = "/data" }]'
        if not isinstance(value, list):
            self.fail_at(
                f"'volumes' must be an array of tables like {example}, got {_describe(value)}",
                "volumes",
            )
        volumes: list[Volume] = []
        guests: set[str] = set()
        for index, item in enumerate(value):
            number = index + 1
            at = ("volumes", str(index))
            if not isinstance(item, dict):
                self.fail_at(
                    f'volume {number} must be a table like {{ host = "data", guest = "/data" '
                    f"}}, got {_describe(item)}",
                    *at,
                )
            for key in item:
                if key not in VOLUME_KEYS:
                    self.fail_at(
                        f"unknown key {key!r} in volume {number}{_allowed(key, VOLUME_KEYS)}",
                        *at,
                        key,
                    )
            for key, meaning in (
                ("host", "a host directory, relative to the Smolfile"),
                ("guest", "an absolute path inside the machine"),
            ):
                if key not in item:
                    self.fail_at(f"volume {number} is missing {key!r} ({meaning})", *at)
            host = item["host"]
            if not isinstance(host, str) or not host.strip() or "\0" in host:
                self.fail_at(
                    f"volume {number} 'host' must be a directory path string, "
                    f"got {_describe(host)}",
                    *at,
                    "host",
                )
            host_path = self._home(host, f"volume {number} 'host'", *at, "host")
            if not host_path.is_absolute():
                host_path = self.base_dir / host_path
            host_path = host_path.resolve()
            if not host_path.is_dir():
                self.fail_at(
                    f"volume {number} host directory {str(host_path)!r} does not exist; "
                    "create it or fix 'host' (relative paths start at the Smolfile's directory)",
                    *at,
                    "host",
                )
            guest = self.abspath(item["guest"], f"volume {number} 'guest'", *at, "guest")
            if guest == "/":
                self.fail_at(
                    f"volume {number} 'guest' cannot be '/'; mount it at a directory like '/data'",
                    *at,
                    "guest",
                )
            taken = next((r for r in MACHINE_PATHS if guest == r or guest.startswith(r + "/") or r.startswith(guest + "/")),
                         None)
            if taken is not None:
                self.fail_at(
                    f"volume {number} 'guest' {guest!r} is where the machine keeps its own {taken}: "
                    "mount it at a directory like '/data'",
                    *at,
                    "guest",
                )
            if guest in guests:
                self.fail_at(
                    f"volume {number} 'guest' {guest!r} is already used by another volume; "
                    "give each volume its own guest path",
                    *at,
                    "guest",
                )
            guests.add(guest)
            readonly = item.get("readonly", True)
            if not isinstance(readonly, bool):
                self.fail_at(
                    f"volume {number} 'readonly' must be true or false (no quotes), "
                    f"got {_describe(readonly)}",
                    *at,
                    "readonly",
                )
            exposed = signing.volume_refusal(str(host_path), True)  # the ledger's folder: the Workbench's to check
            if exposed is not None:
                self.fail_at(f"volume {number} is refused: {exposed}", *at, "host")
            volumes.append(Volume(host=str(host_path), guest=guest, readonly=readonly))
        return tuple(volumes)

    def string_list(self, value: Any, key: str) -> list[str]:
        if not isinstance(value, list):
            self.fail_at(
                f"[network] {key!r} must be an array of strings, got {_describe(value)}",
                "network",
                key,
            )
        for item in value:
            if not isinstance(item, str):
                self.fail_at(
                    f"[network] {key!r} must be an array of strings, found {_describe(item)}",
                    "network",
                    key,
                )
        return value

    def allow_hosts(self, value: Any) -> tuple[str, ...]:
        hosts = self.string_list(value, "allow_hosts")
        result: list[str] = []
        for host in hosts:
            problem = host_problem(host)
            if problem:
                line = self.lines.line_of_value(f"{host}", "network", "allow_hosts")
                self.fail(f"[network] allow_hosts entry {host!r} {problem}", line)
            if host not in result:
                result.append(host)
        return tuple(result)

    def allow_cidrs(self, value: Any) -> tuple[str, ...]:
        cidrs = self.string_list(value, "allow_cidrs")
        result: list[str] = []
        for cidr in cidrs:
            try:
                rule = parse_cidr(cidr)
            except PolicyError as exc:
                line = self.lines.line_of_value(f"{cidr}", "network", "allow_cidrs")
                self.fail(f"[network] allow_cidrs entry {cidr!r} {exc}", line)
            if str(rule) not in result:
                result.append(str(rule))
        return tuple(result)


def parse_smolfile(text: str, source: str = "Smolfile", base_dir: str | None = None) -> MachineSpec:
    """Parse Smolfile ``text`` into a MachineSpec.

    ``source`` names the file in error messages (and is kept in
    ``MachineSpec.source``); relative paths (``image``, volume ``host``) start at
    ``base_dir``, the current directory by default.
    """
    return _Parser(text, source, base_dir).parse()


def shown(path: str | os.PathLike[str]) -> str:
    """How errors name a Smolfile: ``./Smolfile`` for one in the current folder (so a file
    the user forgot about is recognisable), else the path as given."""
    text = str(path)
    return text if os.sep in text or text.startswith("~") else f".{os.sep}{text}"


SMOLFILE_LIMIT = 1 << 20  # bytes: a Smolfile is a few hundred; a larger file is not one (a link to /dev/zero grew forever)


def read_bytes(file: Path) -> bytes:
    """The Smolfile ``file``'s bytes: a link the user made to it is resolved first, then the real file is
    read as a plain file only (never waiting: a fifo there hung ``Session()`` and ``%smol up``) and at
    most :data:`SMOLFILE_LIMIT` bytes of it. OSError: EINVAL when it is not a plain file, EFBIG when larger."""
    data = read_plain(os.path.realpath(file), SMOLFILE_LIMIT + 1)
    if len(data) > SMOLFILE_LIMIT:
        raise OSError(errno.EFBIG, "larger than 1 MiB")
    return data


def unreadable(exc: OSError) -> tuple[str, str]:
    """Why a Smolfile can't be read (``exc``), and the fix, for one line."""
    if isinstance(exc, FileNotFoundError):
        return "no such Smolfile", "create it or fix the path"
    if exc.errno == errno.EINVAL:
        return "not a plain file (a fifo, a device or a folder)", "point at a Smolfile that is a regular file"
    if exc.errno == errno.EFBIG:
        return f"larger than {SMOLFILE_LIMIT >> 20} MiB, too big to be a Smolfile", "point at the right file, or trim it"
    return f"cannot read the Smolfile ({exc.strerror})", "check its permissions"


def smolfile_text(data: bytes, name: str) -> str:
    """A Smolfile's bytes as text, newlines as ``read_text`` gives them; one line if not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SmolfileError(f"{name}: not UTF-8 text; save the Smolfile as UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _read_smolfile(file: Path, name: str) -> str:
    try:
        data = read_bytes(file)
    except OSError as exc:
        why, fix = unreadable(exc)
        raise SmolfileError(f"{name}: {why}; {fix}") from None
    return smolfile_text(data, name)


def load_cluster(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Smolfile's ``[cluster]`` table, checked ({} when it has none)."""
    file = Path(path).expanduser()
    parser = _Parser(_read_smolfile(file, shown(path)), shown(path), str(file.resolve().parent))
    data = parser.load()
    return parser.cluster(data["cluster"]) if "cluster" in data else {}


def load_smolfile(path: str | os.PathLike[str]) -> MachineSpec:
    """Read and parse the Smolfile at ``path`` (relative paths start at its directory)."""
    file = Path(path).expanduser()
    name = shown(path)
    text = _read_smolfile(file, name)
    return parse_smolfile(text, source=name, base_dir=str(file.resolve().parent))
