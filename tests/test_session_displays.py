"""What a Session.run cell displays reaches its RunResult: a script has no view to show it in.

`s.run("display(...)")` lost every display (and the gate's notes on what it held back): the
Session's cell had no event handler, so only text, the value and pulls came back.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import smolbench

MAGIC = re.compile(r"%%?smol|(?<![\w-])--[a-z]")


def test_a_run_brings_back_what_it_displayed_and_the_gate_s_notes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        r = s.run("from IPython.display import HTML\nfor i in range(3): display(i)\nprint('done')")
        assert r.stdout == "done\n"
        assert [d["text/plain"] for d in r.displays] == ["0", "1", "2"] and r.notes == []
        # what a machine may not run in the user's browser is dropped, and the run says so
        r = s.run("display(HTML('<b>bold</b><script>alert(1)</script>'))")
        [shown] = r.displays
        assert "<script" not in shown.get("text/html", "") and "alert" not in shown.get("text/html", "")
        # the agent never sends a script; code in the machine can, through it
        r = s.run("display.__self__._agent.send({'t': 'display', 'data': {'application/javascript': 'alert(1)', "
                  "'text/plain': 'J'}})")
        assert [dict(d) for d in r.displays] == [{"text/plain": "J"}]
        assert len(r.notes) == 1 and "application/javascript" in r.notes[0] and "not shown" in r.notes[0], r.notes
        assert not MAGIC.search(r.notes[0]), r.notes  # in the Session's words
        # past the cell's number of displays: counted, said once
        monkeypatch.setattr(smolbench.gate.limits.LIMITS, "displays", 5)
        r = s.run("for i in range(50): display(i)")
        assert len(r.displays) == 5
        assert any("45 more displays not shown" in n for n in r.notes), r.notes
        assert not any(MAGIC.search(n) for n in r.notes), r.notes
