"""Every install line we print or document names our distribution, ``jupyterlab-smolbench``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_install_line_names_our_distribution_not_the_index_s_unrelated_smolbench() -> None:
    """PyPI's ``smolbench`` is somebody else's project: a line that says ``pip install
    'smolbench[gym]'`` installs their code. Ours is ``jupyterlab-smolbench``."""
    root = ROOT
    texts = [root / "README.md", *root.glob("docs/*.md"), *root.glob("notebooks/*.ipynb"), *root.glob("smolbench/**/*.py"),
             *root.glob("scripts/*")]
    wrong = [f"{p.relative_to(root)}: {m[0]}" for p in texts if p.is_file()
             for m in re.finditer(r"(?<!never `)pip install\s+['\"]?smolbench\b\S*", p.read_text(errors="replace"))]
    assert not wrong, "install lines naming PyPI's unrelated smolbench:\n" + "\n".join(wrong)
