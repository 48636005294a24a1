"""Can this host run smol microVMs? A cached, bounded boot probe, and /dev/kvm in plain words.

``smol.local_availability()`` only checks what it can without booting (an
engine for this platform, /dev/kvm present): on a nested hypervisor that
cannot run the guest kernel it still says yes. So :func:`probe_smol` boots a
tiny machine for real, runs ``true`` in it and deletes it. The boot runs in a
subprocess in its own session with a hard timeout, so a hung engine can't
hang the kernel: on timeout the whole process group is killed and the probe
machine deleted by name. A failed boot takes 6-30 s, so the verdict is cached
in ``cache_dir()/probe.json``, keyed by everything that changes it.
"""

from __future__ import annotations

import contextlib
import grp
import importlib.util
import json
import os
import pwd
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._pkgtrust import read_plain
from ..gate.frames import loads

KVM = "/dev/kvm"
CACHE_FILE = "probe.json"
CACHE_LIMIT = 1 << 20  # bytes of probe.json read: a verdict is ~200 bytes a key; a larger file is dropped
CACHE_TTL = 7 * 24 * 3600.0  # seconds a verdict is trusted even when the key still matches
SKIP_ENV = "SMOLBENCH_SMOL_PROBE"  # "skip": answer no without booting; "force": boot even on kvm-pvm
TIMEOUT_ENV = "SMOLBENCH_SMOL_PROBE_TIMEOUT"
DEFAULT_TIMEOUT = 45.0  # seconds; a nested, emulated host needs about 200
PROBE_MEMORY = 256  # MiB of the test machine
KVM_PVM = "/sys/module/kvm_pvm"  # nested paravirtual KVM: smol's guest kernel can't run on it
PROBE_LABEL = "smolbench-probe"
_MARK = "SMOLBENCH_PROBE "

# Runs in the probe subprocess: stdlib + smol only, prints one marked JSON line.
_PROBE_CODE = r"""
import json, sys, time
name, ready = sys.argv[1], float(sys.argv[2])
started = time.monotonic()
out = {"ok": False, "code": None, "message": ""}
machine = None
try:
    from smol import ConnectOptions, Machine, MachineConfig, ResourceSpec
    conn = ConnectOptions(target="local")
    config = MachineConfig(
        name=name,
        labels={"smolbench-probe": "1"},
        resources=ResourceSpec(cpus=1, memory_mb=256, network=False),
        ready_timeout_seconds=ready,
    )
    machine = Machine.create(config, conn)
    result = machine.exec(["true"])
    out = {"ok": result.exit_code == 0, "code": None,
           "message": "exit code %d" % result.exit_code}
except BaseException as exc:
    out = {"ok": False, "code": getattr(exc, "code", type(exc).__name__), "message": str(exc)}
finally:
    try:
        if machine is not None:
            machine.delete()
        else:
            Machine.delete_by_name(name, ConnectOptions(target="local"))
    except BaseException:
        pass
out["seconds"] = time.monotonic() - started
sys.stdout.write("SMOLBENCH_PROBE " + json.dumps(out) + "\n")
sys.stdout.flush()
"""

_DELETE_CODE = r"""
import sys
from smol import ConnectOptions, Machine
Machine.delete_by_name(sys.argv[1], ConnectOptions(target="local"))
"""


def cache_path() -> Path:
    """Where verdicts are cached: ``probe.json`` in smolbench's cache directory."""
    try:
        from ..images import cache_dir
    except ImportError:  # pragma: no cover - images.py always ships with the package
        env = os.environ.get("SMOLBENCH_CACHE")
        base = Path(env).expanduser() if env else Path.home() / ".cache" / "smolbench"
    else:
        base = cache_dir()
    return base / CACHE_FILE


def _smol_version() -> str:
    try:
        from importlib.metadata import version

        return version("smolmachines")
    except Exception:
        return "unknown"


def _kvm_stamp() -> str:
    try:
        st = os.stat(KVM)
    except OSError:
        return "missing"
    return f"{stat.S_IMODE(st.st_mode):04o}:{st.st_gid}"


def cache_key() -> str:
    """The cache key: host, kernel, smolmachines version, /dev/kvm mode+gid, and the user."""
    parts = (
        socket.gethostname(),
        os.uname().release,
        _smol_version(),
        _kvm_stamp(),
        f"uid={os.geteuid()}",
    )
    return "|".join(parts)


def _read_cache() -> dict[str, Any]:
    """The cached verdicts, or {}: probe.json read as a plain file only, bounded, without following a
    link or waiting (a fifo there hung every ``--backend auto`` start), its JSON no deeper than json's
    recursion (``"[" * 2000`` was a RecursionError, not a bad cache)."""
    try:
        raw = read_plain(cache_path(), CACHE_LIMIT + 1)
        data = loads(raw) if len(raw) <= CACHE_LIMIT else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cached(key: str) -> tuple[bool, str] | None:
    entry = _read_cache().get(key)
    if not isinstance(entry, dict):
        return None
    if time.time() - float(entry.get("checked", 0)) > CACHE_TTL:
        return None
    ok, reason = entry.get("ok"), entry.get("reason")
    if not isinstance(ok, bool) or not isinstance(reason, str):
        return None
    return ok, reason


def _store(key: str, ok: bool, reason: str, seconds: float) -> None:
    path = cache_path()
    data = _read_cache()
    data[key] = {"ok": ok, "reason": reason, "seconds": round(seconds, 2), "checked": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a probe next time


def _python(code: str, *args: str) -> list[str]:
    """``python -c code args`` isolated (-I: no working folder on sys.path, no PYTHON* variables,
    no user site; run in "/"), with smol's folder added last when the kernel found it elsewhere."""
    spec = importlib.util.find_spec("smol")
    where = os.path.dirname(os.path.dirname(spec.origin)) if spec is not None and spec.origin else ""
    boot = "import sys; sys.argv[1] and sys.path.append(sys.argv[1]); del sys.argv[1]\n"
    return [sys.executable, "-I", "-c", boot + code, where, *args]


def _run_bounded(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``argv`` in its own session; kill the whole group after ``timeout`` s.

    Returns (exit code or None on timeout, stdout+stderr). Output goes to a
    temporary file, not a pipe, so a grandchild holding it open can't block us.
    """
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/",
        )
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        return code, out.read().decode(errors="replace")


def _boot(timeout: float) -> tuple[bool, str, float]:
    """Boot, exec and delete one tiny machine in a subprocess; (ok, reason, seconds)."""
    from .smol_errors import explain

    name = f"smolbench-probe-{secrets.token_hex(4)}"
    ready = max(3.0, min(timeout * 0.8, timeout - 5.0))
    started = time.monotonic()
    code, output = _run_bounded(_python(_PROBE_CODE, name, f"{ready:.1f}"), timeout)
    seconds = time.monotonic() - started
    if code is None:
        # The probe was killed mid-way: make sure its machine is gone too.
        _run_bounded(_python(_DELETE_CODE, name), 20.0)
        return (
            False,
            f"a {PROBE_MEMORY} MiB test microVM did not boot within the probe's {timeout:.0f} s "
            f"(a slow, nested host may need {TIMEOUT_ENV}=900): use --backend sandbox or --target cloud",
            seconds,
        )
    verdict: dict[str, Any] | None = None
    for line in output.splitlines():
        if line.startswith(_MARK):
            with contextlib.suppress(ValueError):
                verdict = json.loads(line[len(_MARK) :])
    if verdict is None:
        last = next((ln for ln in reversed(output.splitlines()) if ln.strip()), "no output")
        return (
            False,
            f"the smol boot probe crashed ({last.strip()[:160]}): run `smolbench doctor`",
            seconds,
        )
    if verdict.get("ok"):
        took = float(verdict.get("seconds") or seconds)
        return (
            True,
            f"a {PROBE_MEMORY} MiB test microVM booted, ran `true` and was deleted in {took:.1f} s "
            f"(probe limit {timeout:.0f} s)",
            seconds,
        )
    err = explain(
        str(verdict.get("code") or "SMOLVM_ERROR"),
        str(verdict.get("message") or ""),
        fallback="use --backend sandbox or --target cloud (`smolbench doctor` shows /dev/kvm)",
    )
    return False, f"a test microVM failed to boot here: {err}", seconds


def probe_timeout() -> float:
    """The boot probe's limit in seconds: ``$SMOLBENCH_SMOL_PROBE_TIMEOUT``, else 45."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        value = DEFAULT_TIMEOUT
    return value if value > 0 else DEFAULT_TIMEOUT


def quick_verdict() -> tuple[bool, str] | None:
    """A no from cheap checks alone (no boot), or None when only a boot can tell."""
    mode = os.environ.get(SKIP_ENV, "").strip().lower()
    if mode == "skip":
        return False, f"probe skipped by {SKIP_ENV}=skip"
    if mode != "force" and os.path.isdir(KVM_PVM):
        return False, (
            "/dev/kvm here is kvm-pvm, a nested paravirtual hypervisor that can't run smol's guest "
            f"kernel: use --backend sandbox or --target cloud ({SKIP_ENV}=force tries a boot anyway)"
        )
    return None


def probe_smol(
    timeout: float | None = None,
    use_cache: bool = True,
    announce: Callable[[str], None] | None = None,
) -> tuple[bool, str]:
    """Whether smol microVMs really boot here, and one line saying why (or what to do).

    ``timeout`` defaults to ``$SMOLBENCH_SMOL_PROBE_TIMEOUT`` (45 s). Cheap checks come
    first (``SMOLBENCH_SMOL_PROBE=skip``, a kvm-pvm host), so a host that can't boot
    microVMs answers at once. ``announce`` is told, before a real boot probe starts,
    that the user is about to wait for it.
    """
    quick = quick_verdict()
    if quick is not None:
        return quick
    limit = probe_timeout() if timeout is None else timeout
    try:
        import smol
    except ImportError:
        return (
            False,
            "the smol SDK is not installed: pip install smolmachines (or use --backend sandbox)",
        )
    from .smol_errors import explain

    available, code, reason = smol.local_availability()
    if not available:
        return False, explain(code or "HYPERVISOR_UNAVAILABLE", reason or "")
    key = cache_key()
    if use_cache:
        hit = _cached(key)
        if hit is not None:
            return hit
    if announce is not None:
        announce(f"smolbench: checking once whether microVMs boot on this host (up to {limit:.0f} s; the answer is remembered)…")
    ok, why, seconds = _boot(limit)
    _store(key, ok, why, seconds)
    return ok, why


def kvm_diagnosis() -> list[str]:
    """Plain-words lines about /dev/kvm and the ``kvm`` group, for ``smolbench doctor``."""
    lines: list[str] = []
    try:
        kvm_group: grp.struct_group | None = grp.getgrnam("kvm")
    except KeyError:
        kvm_group = None
    try:
        st = os.stat(KVM)
    except FileNotFoundError:
        lines.append(
            f"{KVM} does not exist: load the kvm module (sudo modprobe kvm_intel, or kvm_amd), "
            "or on a cloud VM enable nested virtualisation"
        )
        st = None
    except OSError as exc:
        lines.append(f"{KVM} can't be inspected: {exc.strerror}")
        st = None
    if st is not None:
        mode = stat.S_IMODE(st.st_mode)
        owner = _user_name(st.st_uid)
        group = _group_name(st.st_gid)
        kind = "a character device" if stat.S_ISCHR(st.st_mode) else "NOT a character device"
        lines.append(f"{KVM} exists ({kind}), owner {owner}, group {group}, mode {mode:04o}")
        good = kvm_group is not None and st.st_gid == kvm_group.gr_gid and mode & 0o060 == 0o060
        if good:
            lines.append(
                f"{KVM} is group kvm with group read-write (mode {mode:04o}): as smol needs"
            )
        else:
            lines.append(
                f"{KVM} should be group kvm, mode 0660 (smol's helper drops to a user that keeps "
                "only the kvm group): sudo chgrp kvm /dev/kvm && sudo chmod 0660 /dev/kvm"
            )
        can = os.access(KVM, os.R_OK | os.W_OK)
        lines.append(f"this user {'can' if can else 'can NOT'} open {KVM} read-write")
    if kvm_group is None:
        lines.append("there is no 'kvm' group: create it with sudo groupadd --system kvm")
    else:
        lines.append(f"the 'kvm' group exists (gid {kvm_group.gr_gid})")
        if os.geteuid() != 0 and kvm_group.gr_gid not in os.getgroups():
            lines.append(
                "you are not in the 'kvm' group: sudo usermod -aG kvm $USER, then log in again"
            )
    if os.path.isdir("/sys/module/kvm_pvm"):
        lines.append(
            "KVM here comes from kvm-pvm (a nested, paravirtual hypervisor): smol's guest kernel "
            "may not boot on it even though /dev/kvm opens"
        )
    return lines


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
