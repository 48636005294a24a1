"""A file's SHA-256, by descriptor: the one way checkpoints, wheels and artifacts are hashed."""

from __future__ import annotations

import hashlib
import os

_CHUNK = 1 << 20


def sha256_fd(fd: int) -> tuple[str, int]:
    """(hex SHA-256, bytes read) of the open file ``fd`` from its start; its offset is left as it was."""
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, _CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest(), offset
