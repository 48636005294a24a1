"""With nothing up, `%smol checkpoint list` and `%smol checkpoint restore` read the same folder's
checkpoints: the one the notebook is in now. Before, the list kept the folder it first read
(opened once, by a relative path) after `os.chdir`, as the teaching notebook does between its
teacher's and students' parts, while a restore looked in the new one: "mine" was listed, then
"no checkpoint named 'mine'"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, notices, ok

import smolbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def test_the_list_follows_the_notebook_s_folder_as_restore_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for folder, name in (("teacher", "lesson"), ("student", "mine")):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        with smolbench.Session(backend="sandbox", on_notice=lambda line: None) as s:
            s.run(f"x = {name!r}")
            s.checkpoint_save(name)
    monkeypatch.chdir(tmp_path)
    with NotebookSession(tmp_path / "teacher", timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        assert "lesson" in notices(ok(nb.run("%smol checkpoint list")))
        ok(nb.run(f"import os\nos.chdir({str(tmp_path / 'student')!r})"))
        listed = notices(ok(nb.run("%smol checkpoint list")))
        assert "mine" in listed and "lesson" not in listed, listed
        ok(nb.run("%smol checkpoint restore mine"))
        assert "'mine'" in notices(ok(nb.run("%%smol\nprint(repr(x))")))
        ok(nb.run("%smol down"))


def test_saving_a_node_that_never_was_names_the_live_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "node 'root.3' is not alive" (as for a deleted one), where `use` says it is unknown."""
    monkeypatch.chdir(tmp_path)
    with smolbench.Session(backend="sandbox", on_notice=lambda line: None) as s:
        with pytest.raises(smolbench.SmolbenchError, match=r"^unknown node 'root\.3': live nodes are root "):
            s.checkpoint_save("x", node="root.3")
