"""What a machine's cell displays, as Jupyter shows the same code: matplotlib figures as PNG,
IPython's display and its objects (``_repr_mimebundle_``, Javascript) reaching the notebook.

Before: ``plt.show()`` showed nothing (Agg), a Figure only its repr, ``display(fig)`` the
same; ``from IPython.display import display`` printed ``<IPython.core.display.HTML object>``.
"""

from __future__ import annotations

import base64
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

import smolbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    with smolbench.Session(backend="sandbox", ledger="ledger.db", on_notice=lambda line: None) as s:
        yield s


def _png(bundle: Any) -> bytes:
    return base64.b64decode(bundle["image/png"])


def test_matplotlib_figures_show_as_png(sandbox: smolbench.Session) -> None:
    pytest.importorskip("matplotlib")  # the machine runs the host's Python: a test dependency
    s = sandbox
    r = s.run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\nprint(plt.get_fignums())")
    assert r.error is None and r.stdout == "[]\n", r  # shown, then closed
    [shown] = r.displays
    assert _png(shown).startswith(b"\x89PNG\r\n\x1a\n")

    # a Figure as the last value: its PNG (shown once, not again as an open figure)
    r = s.run("fig, ax = plt.subplots()\nax.plot([3, 1])\nfig")
    assert r.error is None and r.display is not None and r.displays == [], r
    assert _png(r.display).startswith(b"\x89PNG") and r.display["text/plain"].startswith("<Figure size")

    # display(fig), and a figure left open at the cell's end: each shown once, then closed
    r = s.run("fig, ax = plt.subplots()\nax.plot([1])\ndisplay(fig)\nplt.figure()\nplt.bar([1], [2])\n"
              "print('made')\nlen(plt.get_fignums())")
    assert r.error is None and r.stdout == "made\n" and r.value == 2, r
    assert len(r.displays) == 2 and all(_png(d).startswith(b"\x89PNG") for d in r.displays)
    assert s.run("len(plt.get_fignums())").value == 0

    # a Figure made without pyplot
    r = s.run("from matplotlib.figure import Figure\nf = Figure()\nf.subplots().plot([1, 2])\ndisplay(f)")
    [shown] = r.displays
    assert _png(shown).startswith(b"\x89PNG")


def test_ipython_display_and_its_objects_reach_the_notebook(sandbox: smolbench.Session) -> None:
    pytest.importorskip("IPython")
    s = sandbox
    # IPython's display, imported by the cell: shown (cleaned), not printed as a repr
    r = s.run("from IPython.display import display, HTML, Javascript\n"
              "display(HTML('<b>bold</b><script>alert(1)</script>'))")
    assert r.error is None and r.stdout == "", r
    [shown] = r.displays
    assert "<b>bold</b>" in shown["text/html"] and "script" not in shown["text/html"] and "alert" not in shown["text/html"]

    # an object with _repr_mimebundle_ ((data, metadata)): its HTML and its text
    r = s.run("class M:\n    def _repr_mimebundle_(self, include=None, exclude=None):\n"
              "        return {'text/html': '<i>mine</i>', 'text/plain': 'M!'}, {}\nM()")
    assert r.error is None and r.display is not None, r
    assert "<i>mine</i>" in r.display["text/html"] and r.display["text/plain"] == "M!"
    r = s.run("import IPython.display\nIPython.display.display(M())\n"
              "IPython.display.display({'text/plain': 'raw', 'text/html': '<u>r</u>'}, raw=True)")
    assert [d["text/plain"] for d in r.displays] == ["M!", "raw"] and "<u>r</u>" in r.displays[1]["text/html"]

    # Javascript: sent, and the host's gate drops it with its note
    r = s.run("display(Javascript('alert(1)'))")
    assert r.error is None and [dict(d) for d in r.displays] == [{"text/plain": "<IPython.core.display.Javascript object>"}]
    assert len(r.notes) == 1 and "application/javascript" in r.notes[0] and "not shown" in r.notes[0], r.notes


def test_an_image_bomb_from_a_cell_is_dropped_with_a_note_and_a_real_plot_still_shows(sandbox: smolbench.Session) -> None:
    """The attack (tests/test_gate_images.py): a PNG of ~70 bytes whose header says 60,000 x
    60,000 would make the user's tab allocate 14 GB to decode it, each time the notebook opens."""
    pytest.importorskip("matplotlib")
    r = sandbox.run(
        "import struct, zlib\nfrom IPython.display import display, Image\nimport matplotlib.pyplot as plt\n"
        "def chunk(k, b): return struct.pack('>I', len(b)) + k + b + struct.pack('>I', zlib.crc32(k + b))\n"
        "bomb = (b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', 60000, 60000, 8, 2, 0, 0, 0))\n"
        "        + chunk(b'IDAT', zlib.compress(b'\\0')) + chunk(b'IEND', b''))\n"
        "display(Image(data=bomb, format='png'))\n"
        "plt.plot([1, 2])\nplt.show()")
    assert r.error is None, r
    [plot] = [_png(d) for d in r.displays if "image/png" in d]  # the plot, not the bomb
    width, height = struct.unpack(">II", plot[16:24])
    assert 100 < width < 2000 and 100 < height < 2000, (width, height)  # a figure, cropped to its drawing
    [note] = r.notes
    assert "image/png output (60,000 x 60,000 pixels, over the limit of 50 megapixels" in note and "not shown" in note


def test_a_fork_s_branches_share_one_allowance_of_pixels(sandbox: smolbench.Session) -> None:
    """A fork's branches show their images in one output area: each branch had the cell's
    whole allowance (250 megapixels), so a fork of 16 could have the tab decode 16 GB. Each of
    4 branches here shows three images of 49 megapixels (each under the per-image limit):
    only five of the twelve fit the one allowance; each branch that lost one says so."""
    shown: list[str] = []
    notes: list[str] = []

    def seen(branch: str, ev: Any) -> None:
        if ev.kind == "display" and "image/png" in ev.data:
            shown.append(branch)
        elif ev.kind == "stream" and ev.note and "not shown" in ev.text:
            notes.append(ev.text)

    sandbox.fork(4, (
        "import struct, zlib\nfrom IPython.display import display, Image\n"
        "def chunk(k, b): return struct.pack('>I', len(b)) + k + b + struct.pack('>I', zlib.crc32(k + b))\n"
        "big = (b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', 7000, 7000, 8, 2, 0, 0, 0))\n"
        "       + chunk(b'IDAT', zlib.compress(b'\\0')) + chunk(b'IEND', b''))\n"
        "for _ in range(3):\n    display(Image(data=big, format='png'))\nreward = 1"), keep="none", on_output=seen)
    assert len(shown) == 5, shown
    # a branch says so once, on its first image dropped: every branch that lost one
    lost = {b for b in ("root.0", "root.1", "root.2", "root.3") if shown.count(b) < 3}
    assert len(notes) == len(lost) and all("the cell's images pass 250 megapixels in all" in n for n in notes), notes
    assert {n.split()[1] for n in notes} == lost, (notes, shown)
