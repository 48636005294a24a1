"""What the widget tests share: a Workbench up on a real sandbox machine, its views closed and
the machine deleted after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from smolbench import _loop
from smolbench.backends.sandbox import SandboxBackend
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.widgets import close_views
from smolbench.workbench import Workbench


@contextmanager
def workbench_up(ledger: Path) -> Iterator[Workbench]:
    """A Workbench up (its root machine running), recording into ``ledger``."""
    bench = Workbench(SandboxBackend(), MachineSpec(), Ledger(ledger))
    _loop.run(bench.up())
    try:
        yield bench
    finally:
        close_views(bench)
        _loop.run(bench.down(), timeout=60)
        bench.ledger.close()
