"""The honest fallback when smol can't checkpoint a whole machine: its workspace and namespace.

smol 1.32 refuses ``checkpoint()`` for a machine booted from a local image (a
rootfs directory or a ``docker save`` archive: "host-backed image layers").
Then the agent saves what the sandbox backend saves (the picklable namespace
and the workspace files) and the host keeps them in a ``.smolcheckpoint`` that
is a gzip tar with a marker; restoring boots a fresh machine and loads them.
The bytes came from the machine: the host only stores them and hands them back
to a machine; it never unpacks them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import tarfile
from collections.abc import Iterator
from typing import IO, Any

from ..errors import SmolbenchError
from ..gate import archive, frames
from ..gate.archive import UnsafeCheckpoint
from ..gate.limits import LIMITS, human

MARKER = "smolbench-state.json"
KIND = "smolbench-smol-state"
PARTS = ("namespace.pkl", "workspace.tar")
STATE_ONLY = (
    "smol can't checkpoint a machine booted from a local image (host-backed image layers), so this "
    "checkpoint holds the workspace and namespace only, as on the sandbox: processes and RAM are not saved "
    "(a machine from a registry image is captured whole)"
)


def write_state(path: str, machine: str, parts: dict[str, bytes]) -> int:
    """Write ``parts`` (agent save files) as a state checkpoint at ``path``; its size."""
    with new_file(path) as fh, tarfile.open(fileobj=fh, mode="w:gz") as tar:
        for name, data in [(MARKER, json.dumps({"kind": KIND, "machine": machine}).encode()),
                           *((n, parts[n]) for n in PARTS)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return os.path.getsize(path)


def write_pointer(path: str, pointer: dict[str, Any]) -> None:
    """Write a cloud checkpoint's pointer file (JSON) at ``path``."""
    with new_file(path) as fh:
        fh.write(json.dumps(pointer).encode())


@contextlib.contextmanager
def new_file(path: str) -> Iterator[IO[bytes]]:
    """A file written under a new name of its own and renamed to ``path`` once whole: never
    through a link at ``path`` or at a part name (a copied folder's), never half written."""
    part = f"{path}.{secrets.token_hex(6)}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


def is_state(path: str) -> bool:
    """True when ``path`` is a state checkpoint (a gzip tar), not a smol machine checkpoint."""
    try:
        with open(path, "rb") as fh:
            return fh.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def read_state(path: str) -> dict[str, bytes]:
    """The agent save files of the state checkpoint at ``path`` (one-line errors if damaged)."""
    left = LIMITS.checkpoint  # decompressed bytes held, counted as they are read
    try:
        with archive.open_tar(path) as tar:
            out: dict[str, bytes] = {}
            for member in tar:
                if member.name in (MARKER, *PARTS) and member.isfile():
                    fh = tar.extractfile(member)
                    if fh is not None:
                        out[member.name] = fh.read(left + 1)
                        left -= len(out[member.name])
                        if left < 0:
                            raise UnsafeCheckpoint(f"checkpoint {os.path.basename(path)} unpacks to more than the "
                                                   f"checkpoint limit of {human(LIMITS.checkpoint)}: stopped there")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise SmolbenchError(
            f"checkpoint {path} is corrupt or truncated ({exc}): delete it with `%smol checkpoint rm`"
        ) from None
    try:
        kind = frames.loads(out.get(MARKER, b"{}")).get("kind")  # strict UTF-8, as written
    except (ValueError, AttributeError):
        kind = None
    if kind != KIND or any(part not in out for part in PARTS):
        raise SmolbenchError(f"{path} is not a smol checkpoint: restore it with the backend that made it")
    return {part: out[part] for part in PARTS}
