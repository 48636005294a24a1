"""`%smol up` and `%smol checkpoint restore` with a session that has no active machine: one that
still has live machines is never taken down behind the user's back, one that has none (its root
lost, or every machine deleted) is taken down before a new one replaces it. Real kernel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, ok, one_line, stream_text

GROUPS = "import json\nprint(json.dumps(list(map(str, __import__('smolbench')._magics.workbench.backend.limiter._groups.values()))))"


def test_up_with_machines_alive_but_none_active_refuses_and_deletes_nothing(tmp_path: Path) -> None:
    """After a restore beside a running root and `%smol delete r1-…` (the active one), root lives
    and nothing is active: `%smol up` took the session down (root with it) and started anew."""
    with NotebookSession(tmp_path, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend process"))
        ok(s.run("%%smol\nx = 41"))
        ok(s.run("%smol checkpoint save c"))
        ok(s.run("%smol checkpoint restore c"))
        ok(s.run("%smol delete r1-c"))
        refused = one_line(s.run("%smol up --backend process"))
        status = stream_text(ok(s.run("%smol status")))
        ok(s.run("%smol use root"))
        kept = stream_text(ok(s.run("%%smol\nprint(x + 1)")))
        ok(s.run("%smol down"))
    assert refused.endswith("machines are still up (root): `%smol use root`, or `%smol down` first"), refused
    assert "none (`%smol use NODE` picks one)" in status, status
    assert kept == "42\n", kept


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_restore_after_everything_was_deleted_ends_the_last_backend_first(open_tmp: Path) -> None:
    """The restore built a new session and left the old one's backend (its cgroups, proxy, run
    folders) to the kernel's exit."""
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%smol checkpoint save c"))
        groups = [Path(g) for g in json.loads(stream_text(ok(s.run(GROUPS))))]
        ok(s.run("%smol delete root"))
        ok(s.run("%smol checkpoint restore c"))
        left = [g for g in groups if g.exists()]
        ran = stream_text(ok(s.run("%%smol\nprint(1 + 1)")))
        ok(s.run("%smol down"))
    if not groups:
        pytest.skip("no cgroups on this host: nothing held beside the machines to see")
    assert not left, left
    assert ran == "2\n", ran
