"""What cells say, read back through a real ipykernel (nbclient): typos get a did-you-mean,
news is normal output (not pink stderr), a failed branch's reason is in the table and the
summary with ``--allow-errors``, ties pick one best everywhere, a tree's text form reads as
words, and an error that comes from ``./Smolfile`` names it. One kernel for all of it (the
process backend and tiny forks: cheap on a shared host)."""

from __future__ import annotations

import re
from pathlib import Path

from nbhelpers import NotebookSession, error_output, plain_texts, stream_text

from smolbench.server import ledgerview
from smolbench.widgets.static import FOLD_RULE, tree_html


def _error_line(cell: object) -> tuple[str, str]:
    err = error_output(cell)  # type: ignore[arg-type]
    assert err is not None, getattr(cell, "outputs", cell)
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback))
    return err.ename, text


def test_typos_news_failure_reasons_ties_and_text_forms(open_tmp: Path) -> None:
    with NotebookSession(open_tmp, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        up = nb.run("%smol up --backend process --max-alive 1")
        assert error_output(up) is None, up.outputs

        # a typo of `fork N`: one line with the fix, not argparse's "unrecognized arguments"
        # (IPython shows a UsageError as one stderr line)
        text = stream_text(nb.run("%%smol fork16\nreward = 1"), "stderr")
        assert text == "UsageError: unknown %%smol word 'fork16': did you mean `%%smol fork 16`?\n", text
        text = stream_text(nb.run("%%smol frok 4 --keep none\nreward = 1"), "stderr")
        assert text == "UsageError: unknown %%smol word 'frok': did you mean `%%smol fork 4 --keep none`?\n", text
        text = stream_text(nb.run("%smol stauts"), "stderr")
        assert text.startswith("UsageError: unknown %smol command 'stauts': did you mean `%smol status`? "), text

        # --allow-errors: why each branch failed is in the cell (the summary line and the table)
        fork = nb.run("%%smol fork 4 --allow-errors --keep none\n"
                      "if SEED == 1:\n    raise MemoryError()\n"
                      "if SEED == 2:\n    raise ValueError('arm 2 is broken')\nreward = SEED")
        assert error_output(fork) is None
        texts = "\n".join(plain_texts(fork))
        summary = next(t for t in plain_texts(fork) if t.startswith("fork of 4"))
        assert "failed: [root.1] MemoryError: machine ran out of memory (limit" in summary, summary
        assert "(and 1 more: see the table)" in summary, summary
        assert "ValueError: arm 2 is broken" in texts, texts
        html = "\n".join(o["data"].get("text/html", "") for o in fork.outputs if "data" in o)
        assert "why it failed" in html and "arm 2 is broken" in html and "ran out of memory" in html

        # a tie: the result, the fork view's ★best and the ledger's run summary (the sidebar's
        # Replay) all pick the first branch in natural order
        tie = nb.run("%%smol fork 12 --keep none --out tie\nreward = 1.0")
        assert error_output(tie) is None
        best = stream_text(nb.run("print(tie.best['branch'])")).strip()
        assert best == "root.4", best  # root.0-3 were the fork above
        tree = plain_texts(nb.run("%smol tree"))[-1].split("\n", 1)[0]  # its text form, in words
        assert re.fullmatch(r"smolbench .*: 17 nodes · 1 machine alive · active machine root · best reward 3 on root\.3",
                            tree), tree
        # news ("deleted idle kept machine ...", "replicated to node ...") is normal output
        nb.run("%%smol fork 1 --keep all\nreward = 1")
        second = nb.run("%%smol fork 1 --keep all\nreward = 1")
        assert "smolbench: deleted idle kept machine root." in stream_text(second, "stdout"), second.outputs
        assert "deleted idle kept machine" not in stream_text(second, "stderr")

        nb.run("%smol down")

    runs = ledgerview.runs(open_tmp / ".smolbench" / "ledger.db", limit=10)["runs"]
    tied = next(r for r in runs if r["n"] == 12)
    assert tied["best_node"] == "root.4", tied  # not root.9, the last in text order


def test_errors_from_the_folder_smolfile_name_it(open_tmp: Path) -> None:
    with NotebookSession(open_tmp, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        (open_tmp / "Smolfile").write_text("cpus = 0\n")
        _, text = _error_line(nb.run("%smol up --backend process"))
        assert "./Smolfile line 1: 'cpus' must be an integer >= 1" in text, text
        (open_tmp / "Smolfile").write_text('[cluster]\naddress = "nowhere"\n')
        _, text = _error_line(nb.run("%smol up --backend process"))
        assert "bad Ray address 'nowhere' (the [cluster] address of ./Smolfile)" in text, text
        assert ".;" not in text


def test_a_large_fan_never_folds_away_errors_or_running_branches_and_says_how_it_folds() -> None:
    kids = [{"id": f"root.{k}", "parent": "root", "status": "ok", "reward": float(k), "alive": False}
            for k in range(16)]
    for k in (0, 1, 2):  # the lowest rewards would be folded first: these raised
        kids[k].update(status="error", reward=None, error="ValueError: boom")
    kids[3].update(status="running", reward=None, alive=True)
    root = {"id": "root", "parent": None, "status": "idle", "reward": None, "alive": True}
    page = tree_html([root, *kids], active="root", best_path=["root", "root.15"], title="t")
    shown = set(re.findall(r'data-id="(root\.\d+)"', page))
    assert {"root.0", "root.1", "root.2", "root.3", "root.15"} <= shown, shown
    folded = 16 - len(shown)
    assert f"… {folded} more branches of root ({FOLD_RULE})" in page
    # a deleted machine is never tagged "kept"
    kids[15]["kept"] = True
    page = tree_html([root, *kids], active="root", best_path=["root", "root.15"], title="t")
    row = re.search(r'data-id="root\.15".*?</tr>', page)
    assert row and "kept" not in row.group(0), row


def test_cluster_status_words_for_isolation_and_image() -> None:
    """What `%smol status` says for a cluster's nodes (their data, no Ray needed): the kinds
    per node, no pointer to `%smol status` itself, and an image default instead of None."""
    from smolbench.cluster.backend import ClusterBackend, Node

    backend = ClusterBackend("10.0.0.5:6379")
    for i, kind in enumerate(["sandbox", "sandbox", "smol"]):
        backend.nodes[f"n{i}" * 8] = Node(f"n{i}" * 8, agent=None, slots=4, backend=kind)
    assert backend.isolation == "per node: sandbox on 2 nodes, smol on 1 node"
    assert "%smol status" not in backend.isolation
    assert backend.image_default == ("(each node's backend default: sandbox: host system, read-only; "
                                     "smol: python:3.12-slim)")
