"""A background fork (`%%smol fork N --bg`) as its user sees it: a cancel that lands while
its branches are still being made, and the notices it gives while other cells run."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from nbhelpers import NotebookSession, notices, ok, plain_texts, stream_text

from smolbench.backends.process import ProcessBackend
from smolbench.ledger import Ledger
from smolbench.result import reason
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench


def test_a_fork_cancelled_while_its_branches_are_made_says_cancelled_not_branching_failed(tmp_path: Path) -> None:
    """`h.cancel()` straight after `%%smol fork 4 --bg`: every row said "branching failed:" with
    no reason (a CancelledError's empty text), where a later cancel says "cancelled"."""
    backend = ProcessBackend(runtime_dir=str(tmp_path))
    wb = Workbench(backend, MachineSpec(), Ledger(tmp_path / "ledger.db"))

    async def main() -> Any:
        await wb.up()
        try:
            branching, cancelled, branch = asyncio.Event(), asyncio.Event(), backend.branch

            async def held(*args: Any, **kwargs: Any) -> Any:  # the cancel lands while the branches are made
                branching.set()
                await cancelled.wait()
                return await branch(*args, **kwargs)

            backend.branch = held  # type: ignore[method-assign]
            result = wb.new_fork(4, keep="all")
            fork = asyncio.ensure_future(wb.fork(result, "reward = SEED", lambda b, e: None, keep="all"))
            await branching.wait()
            fork.cancel()
            cancelled.set()
            with pytest.raises(asyncio.CancelledError):
                await fork
            assert [m.name for m in backend.list()] == ["root"]  # the branches made meanwhile went
            return result
        finally:
            await wb.down()

    result = asyncio.run(asyncio.wait_for(main(), 120))
    rows = list(result.rows.values())
    assert [(r["status"], r["error"]) for r in rows] == [("cancelled", "cancelled")] * 4
    assert {reason(r) for r in rows} == {"cancelled"} and "branching failed" not in repr(result) + result._repr_html_()
    nodes = wb.ledger.nodes().set_index("id").loc[[f"root.{i}" for i in range(4)]]
    assert list(nodes.status) == ["cancelled"] * 4 and list(nodes.error) == ["cancelled"] * 4


EVICTED = re.compile(r"smolbench: deleted idle kept machine root\.[01] \(least recently used")


def test_a_background_forks_notice_shows_with_its_results_not_under_a_later_cell(tmp_path: Path) -> None:
    """A user's kernel: the --max-alive eviction a background fork made was said under the next
    `%%smol` cell (even `%smol replay root.0`, as if the replay had deleted it), and nowhere
    else. It belongs to the fork: `h.wait()` says it (once) and the handle's table keeps it."""
    with NotebookSession(tmp_path) as nb:
        for source in ("%load_ext smolbench", "%smol up --backend process --max-alive 2",
                       "%%smol fork 2 --keep all --quiet\nreward = SEED"):
            ok(nb.run(source))
        ok(nb.run("%%smol fork 2 --bg --out h\nreward = SEED"))
        waited = ok(nb.run("h.wait()"))
        again = ok(nb.run("h.wait(); None"))
        ok(nb.run("%smol tree"))
        later = ok(nb.run('%%smol\nprint("a smol cell")'))
        shown = ok(nb.run("h"))
        ok(nb.run("%smol down"))
    assert len(EVICTED.findall(stream_text(waited))) == 1, waited.outputs
    assert not EVICTED.search(notices(again)) and notices(later) == "a smol cell\n"
    assert EVICTED.search(plain_texts(shown)[-1])
