"""What a fan-out whose branches fail shows: identical errors once ("the same error in 4
episodes: ...", with one traceback), distinct ones each, the first few as before; and a view of
episodes that have not started yet doesn't say "0 nodes · 0 machines alive" beside a live root."""

from __future__ import annotations

import re
from pathlib import Path

from nbhelpers import NotebookSession, error_output, error_text, ok, plain_texts

from smolbench.errors import CompositeError, RemoteError


def _remote(node: str, evalue: str, line: int = 2) -> RemoteError:
    frame = f'  File "<In [3]@{node}>", line {line}, in <module>\n    raise ValueError({evalue!r})\n'
    return RemoteError("ValueError", evalue, [frame], node=node)


def _text(err: CompositeError) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err._render_traceback_()))


def test_identical_errors_are_shown_once_naming_their_branches() -> None:
    errors = [_remote(f"ep1.{i}", "broken env") for i in range(4)]
    text = _text(CompositeError("4 of 4 episodes failed", errors, unit="episodes"))
    assert "the same error in 4 episodes: ep1.0, ep1.1, ep1.2, ep1.3" in text, text
    assert text.count("Traceback") == 1 and text.count("ValueError: broken env") == 1, text
    assert "more" not in text, text


def test_distinct_errors_stay_and_only_the_first_few_groups_are_shown() -> None:
    errors = [_remote("root.0", "a"), _remote("root.1", "b"), _remote("root.2", "a"), _remote("root.3", "a", line=3),
              "[root.4] timeout: ran longer than --timeout 1 s", _remote("root.5", "c"), _remote("root.6", "d"),
              _remote("root.7", "e")]
    text = _text(CompositeError("8 of 8 branches failed", errors))
    assert "the same error in 2 branches: root.0, root.2" in text, text  # root.3 failed on another line
    assert "[root.1] Traceback" in text and "[root.3] Traceback" in text, text
    assert "[root.4] timeout: ran longer than --timeout 1 s" in text, text
    assert "[root.5]" not in text and "... 3 more (root.5, root.6, root.7)" in text, text
    many = [_remote(f"ep1.{i}", "x") for i in range(30)]
    text = _text(CompositeError("30 of 30 episodes failed", many, unit="episodes"))
    assert "the same error in 30 episodes: ep1.0, ep1.1, ep1.2, ep1.3, ep1.4, ep1.5, ep1.6, ep1.7 and 22 more" in text, text


def test_failed_episodes_through_a_kernel(open_tmp: Path) -> None:
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend process"))
        cell = nb.run("%%smol episodes 4\nraise ValueError('broken env')")
        good = ok(nb.run("%%smol episodes 2\nreward = SEED"))  # (a `%smol down` would update their views)
    assert error_output(cell) is not None
    text = error_text(cell)
    assert text.startswith("CompositeError: 4 of 4 episodes failed (4 error); first: [ep1.0] error: ValueError: broken env"), text
    assert "the same error in 4 episodes: ep1.0, ep1.1, ep1.2, ep1.3" in text and text.count("Traceback") == 1, text
    for texts in (plain_texts(cell), plain_texts(good)):
        heads = [t for t in texts if t.startswith("smolbench episodes of")]
        assert heads and not any("0 nodes" in t or "0 machines alive" in t for t in heads), heads
        assert heads[0].endswith("starting · active machine root"), heads
        assert "their machines deleted · active machine root" in heads[-1], heads
