"""Shared by tests that watch a Workbench's observers: can the ledger be read right now?"""

from __future__ import annotations

import threading

from smolbench.ledger import Ledger


def readable_now(ledger: Ledger, timeout: float = 2.0) -> bool:
    """Whether another thread (the kernel's main thread, reading the ledger while it holds a
    view's lock) can take the ledger's lock now, within ``timeout`` seconds."""
    got: list[bool] = []

    def read() -> None:
        ok = ledger._lock.acquire(timeout=timeout)
        if ok:
            ledger._lock.release()
        got.append(ok)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    return got[0]
