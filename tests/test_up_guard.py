"""`%smol up` and `%smol checkpoint restore` with a session that has no active machine: one that
still has live machines is never taken down behind the user's back, one that has none (its root
lost, or every machine deleted) is taken down before a new one replaces it. Real kernel."""

from __future__ import annotations

from pathlib import Path

from nbhelpers import NotebookSession, ok, one_line, stream_text


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

