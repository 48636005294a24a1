"""A session whose machines were all deleted by hand still ends: `down` (or the `with` block's
end) closed its backend only when machines were left, so what the backend holds beside its
machines (the session's cgroups, an egress proxy) stayed until the process ended, and an `up`
after it made a second backend beside the first."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


def _groups(s: object) -> list[Path]:
    backend = s.workbench.backend  # type: ignore[attr-defined]
    return [Path(g) for g in backend.limiter._groups.values()]


def test_a_session_emptied_by_hand_closes_its_backend_at_its_end(open_tmp: Path) -> None:
    import smolbench

    with smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db") as s:
        groups = _groups(s)
        s.delete("root")
        backend = s.workbench.backend  # type: ignore[union-attr]
    if not groups:
        pytest.skip("no cgroups on this host: nothing held beside the machines to see")
    assert not [g for g in groups if g.exists()], groups
    assert backend.limiter._groups == {}


def test_an_up_after_everything_was_deleted_ends_the_last_backend_first(open_tmp: Path) -> None:
    import smolbench

    s = smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db").up()
    try:
        first, groups = s.workbench.backend, _groups(s)  # type: ignore[union-attr]
        s.delete("root")
        s.up()
        assert s.workbench.backend is not first  # type: ignore[union-attr]
        if groups:
            assert not [g for g in groups if g.exists()], groups
        assert s.run("1 + 1").value == 2
    finally:
        s.down()
