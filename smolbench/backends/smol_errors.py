"""smol SDK errors as one line each: what to do first, then what smol said.

Kept apart from the backend so the probe can use it without the backend's imports.
"""

from __future__ import annotations

import re

from smol import wrap_native_error

from ..errors import BackendUnavailable, InfraError, SmolbenchError
from ..gate.terminal import one_line

ERROR_HINTS: dict[str, str] = {
    "KVM_UNAVAILABLE": "no usable KVM here: use --backend sandbox or --target cloud",
    "HYPERVISOR_UNAVAILABLE": "no usable hypervisor here: use --backend sandbox or --target cloud",
    "UNSUPPORTED_PLATFORM": (
        "smol has no local engine for this OS/CPU: use --backend sandbox or --target cloud"
    ),
    "RUNTIME_NOT_INSTALLED": (
        "the smol engine failed to load: pip install --force-reinstall smolmachines, "
        "or use --backend sandbox"
    ),
    "UNAUTHORIZED": (
        "the smol cloud rejected the token: set a valid SMOL_CLOUD_TOKEN (or run `smol auth login`)"
    ),
    "AUTH": "the smol cloud rejected the token: set a valid SMOL_CLOUD_TOKEN (or run `smol auth login`)",
    "FORBIDDEN": "smol refused this: check the account behind SMOL_CLOUD_TOKEN may do it",
    "CONNECTION": "could not reach the smol cloud: check the network (and SMOL_CLOUD_URL, if set)",
    "NETWORK_ERROR": "could not reach the smol cloud: check the network (and SMOL_CLOUD_URL, if set)",
    "TIMEOUT": "the machine did not answer in time: retry, or give it more memory/cpus in the Smolfile",
    "NOT_FOUND": "the machine is gone: `%smol up` to make a new one",
    "VM_NOT_FOUND": "the machine is gone: `%smol up` to make a new one",
    "MOUNT_ERROR": "a Smolfile volume could not be mounted: check its host directory exists",
    "STORAGE_ERROR": "smol could not write the machine's disk: free disk space on the host",
    "INVALID_STATE": "the machine is not running: `%smol down` and `%smol up` again",
    "INTERRUPTED": "the machine was stopped while a command ran: `%smol up` again",
    "MACHINE_INTERRUPTED": "the machine went away mid-command: `%smol status`, then `%smol up`",
    "CANCELLED": "the command was cancelled",
    "CONFIG_ERROR": "smol rejected the machine's settings: fix the Smolfile",
    "INVALID_CONFIG": "smol rejected the machine's settings: fix the Smolfile",
    "NOT_SUPPORTED": "smol can't do this on this target",
}
KVM_EACCES = (
    "no permission to open /dev/kvm: set it to group kvm, mode 0660 "
    "(sudo chgrp kvm /dev/kvm && sudo chmod 0660 /dev/kvm; smol's helper keeps only the kvm "
    "group) and add your user to the kvm group, or use --backend sandbox"
)
NO_TOKEN = (
    "no smol cloud token: export SMOL_CLOUD_TOKEN=<your smk_ key> (or run `smol auth login`), "
    "or use --target local"
)
PULL_FAILED = (
    "the image could not be pulled (smol pulls it from inside the machine): check the image "
    "name, and allow network (net = true) for its first pull"
)
UNAVAILABLE_CODES = frozenset(
    {
        "KVM_UNAVAILABLE",
        "HYPERVISOR_UNAVAILABLE",
        "UNSUPPORTED_PLATFORM",
        "RUNTIME_NOT_INSTALLED",
        "UNAUTHORIZED",
        "AUTH",
    }
)


NOT_READY = (
    "the machine was not ready within smol's fixed {limit} wait for its guest agent: give it less "
    "memory (e.g. memory = 512 in the Smolfile) or a smaller image"
)
BOOT_SLOW = (
    "the machine did not boot within {limit}: give it less memory or a smaller image, or allow "
    "more time with SMOLBENCH_SMOL_BOOT_TIMEOUT=SECONDS"
)
HOST_BACKED = "host-backed image layers"  # smol's refusal to checkpoint a local-image machine


def _kind(code: str, message: str, fallback: str | None = None) -> tuple[str, bool]:
    """(hint, means-the-backend-is-unavailable) for one SDK error."""
    low = message.lower()
    waited = re.search(r"did not become ready within (\d+(?:\.\d+)?) ?s", low)
    if waited:
        limit = f"{float(waited.group(1)):g} s"
        return (NOT_READY if "agent" in low else BOOT_SLOW).format(limit=limit), False
    if "dependent fork" in low:
        return "the machine still has live branches: delete them first (`%smol delete NODE` takes the branches too)", False
    if HOST_BACKED in low:
        return (
            "smol can't checkpoint a machine booted from a local image (a rootfs directory or an "
            "archive): use an image from a registry for full-machine checkpoints"
        ), False
    if "kvm" in low and ("permission denied" in low or "eacces" in low):
        return KVM_EACCES, True
    if code == "INVALID_CONFIG" and "api_key" in message:
        return NO_TOKEN, True
    if "pull" in low and code not in UNAVAILABLE_CODES:
        return PULL_FAILED, False
    hint = ERROR_HINTS.get(code)
    if hint is None:
        return fallback or f"smol failed ({code}): run `smolbench doctor`", False
    return hint, code in UNAVAILABLE_CODES


def detail(message: str, limit: int = 160) -> str:
    """What smol or a machine said, for inside one host line: whitespace collapsed, and
    escapes and other controls shown escaped (a rewritten relay's stderr is the machine's)."""
    text = " ".join(message.split())
    return one_line(text, limit)


def explain(code: str, message: str, fallback: str | None = None) -> str:
    """One line for an SDK error: what to do first, then what smol said.

    ``fallback`` is the advice for a code the table doesn't know.
    """
    hint, _ = _kind(code, message, fallback)
    said = detail(message)
    return f"{hint} [smol {code}: {said}]" if said else f"{hint} [smol {code}]"


# A machine that did not come up, or went away, for reasons of the host or smol.
INFRA_CODES = frozenset(
    {"TIMEOUT", "INTERRUPTED", "MACHINE_INTERRUPTED", "NOT_FOUND", "VM_NOT_FOUND", "SMOLVM_ERROR",
     "STORAGE_ERROR"}
)


def translate(err: BaseException) -> SmolbenchError:
    """An SDK exception as the SmolbenchError a user sees: BackendUnavailable when this host
    can't run smol at all, InfraError when a machine failed to boot or died (retryable)."""
    smol_err = wrap_native_error(err)
    message = str(smol_err)
    hint, unavailable = _kind(smol_err.code, message)
    if unavailable:
        cls: type[SmolbenchError] = BackendUnavailable
    elif smol_err.code in INFRA_CODES and hint != PULL_FAILED and "dependent fork" not in message.lower():
        cls = InfraError
    else:
        cls = SmolbenchError
    return cls(explain(smol_err.code, message))
