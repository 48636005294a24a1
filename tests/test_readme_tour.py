"""The README's tour runs as written: every ```python cell of README.md before "## Set up" and
in "## A 60-second tour", in order, through a real kernel started in a fresh folder. Each
`# → TEXT` comment names what its cell shows; the test finds TEXT in that cell's output.
So the tour can't drift from the product again."""

from __future__ import annotations

import re
from pathlib import Path

from nbhelpers import NotebookSession, error_text, plain_texts, stream_text

README = Path(__file__).parent.parent / "README.md"


def tour_cells(text: str) -> list[str]:
    """The python cells of the README's opening and of its tour section, in order."""
    head = text.split("## Set up on a fresh machine", 1)[0]
    tour = text.split("## A 60-second tour", 1)[1].split("\n## ", 1)[0]
    return [c.strip("\n") for part in (head, tour) for c in re.findall(r"```python\n(.*?)```", part, re.S)]


def promised(cell: str) -> list[str]:
    """What a cell's `# → TEXT` comments say it shows."""
    return [m.strip() for m in re.findall(r"#\s*→\s*(.+)$", cell, re.M)]


def test_the_readme_tour_runs_as_written_from_a_fresh_folder(tmp_path: Path) -> None:
    cells = tour_cells(README.read_text())
    assert len(cells) >= 6 and cells[0].startswith("%load_ext smolbench")
    assert sum(len(promised(c)) for c in cells) >= 6
    with NotebookSession(tmp_path, timeout=300) as s:
        for source in cells:
            cell = s.run(source)
            errors = error_text(cell)
            assert not errors, f"README cell failed:\n{source}\n{errors}"
            shown = stream_text(cell) + stream_text(cell, "stderr") + "\n".join(plain_texts(cell))
            for text in promised(source):
                assert text in shown, f"README cell\n{source}\npromised {text!r}; it showed:\n{shown}"
        assert "deleted" in shown  # the last cell took every machine down

