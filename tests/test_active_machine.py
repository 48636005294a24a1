"""What the kernel says about its active machine and checkpoint badges (the sidebar shows
the same words): a delete says where the active machine went, ``%smol status`` never
says "no machine is up" while machines live, and removing a checkpoint takes its badge
only (a node's other checkpoint takes its place). Real kernel (nbclient), process backend."""

from __future__ import annotations

import re
from pathlib import Path

from nbhelpers import NotebookSession, stream_text

BADGES = "wb = __import__('smolbench')._magics.workbench\nprint(wb.tree['root'].checkpoint, wb.tree['root.1'].checkpoint)"


def test_deletes_say_where_the_active_machine_went_and_badges_follow_checkpoints(tmp_path: Path) -> None:
    with NotebookSession(tmp_path) as s:
        s.run("%load_ext smolbench")
        s.run("%smol up --backend process")
        s.run("%%smol fork 2 --keep all --quiet\nreward = SEED")
        for name, node in (("a", "root"), ("b", "root"), ("c", "root.1")):
            s.run(f"%smol checkpoint save {name} --node {node}")
        first = stream_text(s.run(BADGES))
        s.run("%smol checkpoint rm b")
        after_b = stream_text(s.run(BADGES))
        s.run("%smol checkpoint rm a")
        after_a = stream_text(s.run(BADGES))
        s.run("%smol use root.1")
        deleted = stream_text(s.run("%smol delete root.1"))
        status = stream_text(s.run("%smol status"))
        s.run("%smol checkpoint restore c")
        s.run("%smol delete r1-c")
        orphaned_status = stream_text(s.run("%smol status"))
        s.run("%smol down")

    assert first.split() == ["b", "c"]  # the newest checkpoint of each node
    assert after_b.split() == ["a", "c"]  # b gone: root still has a; root.1's c untouched
    assert after_a.split() == ["None", "c"]
    assert deleted.strip() == "smolbench: deleted root.1; root.1 was active: the active machine is now root"
    assert re.search(r"^active\s+root$", status, re.M), status
    # the restored machine had no parent: none is active, and status says so (root still lives)
    assert "no machine is up" not in orphaned_status
    assert "none (`%smol use NODE` picks one)" in orphaned_status



def test_save_takes_its_node_before_or_after_the_name(tmp_path: Path) -> None:
    """A user's kernel: `%smol checkpoint save --node root.3 pick` (and `--node=root.0 pick0`) was
    "unrecognized arguments: pick" while `save pick --node root.1` worked."""
    with NotebookSession(tmp_path) as s:
        s.run("%load_ext smolbench")
        s.run("%smol up --backend process")
        s.run("%%smol fork 2 --keep all --quiet\nreward = SEED")
        saved = [stream_text(s.run(f"%smol checkpoint save {words}"))
                 for words in ("--node root.1 pick", "--node=root.0 pick0", "pick2 --node root.1", "--force --node root.0 pick")]
        s.run("%smol down")
    assert [line.split(" (")[0] for line in saved] == [
        "smolbench: saved checkpoint pick of root.1", "smolbench: saved checkpoint pick0 of root.0",
        "smolbench: saved checkpoint pick2 of root.1", "smolbench: saved checkpoint pick of root.0"], saved


def test_a_delete_that_leaves_nothing_says_up_not_use(tmp_path: Path) -> None:
    """A user's kernel: after `%smol delete root` left nothing, the line said "`%smol use NODE`
    picks one" with nothing left to pick."""
    with NotebookSession(tmp_path) as s:
        s.run("%load_ext smolbench")
        s.run("%smol up --backend process")
        s.run("%%smol fork 2 --keep all --quiet\nreward = SEED")
        deleted = stream_text(s.run("%smol delete root"))
        status = stream_text(s.run("%smol status"))
        moved = stream_text(s.run("print(__import__('smolbench')._magics.workbench.moved)"))  # the tree view's line
        s.run("%smol down")
    said = "root was active: no machine is left (`%smol up` starts one)"
    assert re.fullmatch(rf"smolbench: deleted (root\.[01], ){{2}}root; {re.escape(said)}\n", deleted), deleted
    assert moved == said + "\n" and "use NODE" not in status and "`%smol up` starts one" in status
