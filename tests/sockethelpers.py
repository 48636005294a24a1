"""A Unix socket of the host's, for tests of a machine pointing the host at it."""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def host_socket() -> Iterator[tuple[Path, list[bytes]]]:
    """A listening Unix socket in a fresh folder the machine's uid may pass (0711), and what each
    connection to it sent first; the folder is removed afterwards (with what else was put there)."""
    base = Path(tempfile.mkdtemp(prefix="smolbench-sock-"))
    base.chmod(0o711)
    got: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(base / "host.sock"))
    srv.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                got.append(conn.recv(4096))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield base / "host.sock", got
    finally:
        srv.close()
        shutil.rmtree(base, ignore_errors=True)
