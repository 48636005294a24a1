"""A copied folder's ledger row names the backend a restore with nothing up brings up: that word
is data, not an option line (``%smol up --backend {it}``) nor a Session's backend."""

from __future__ import annotations

from pathlib import Path

import pytest
from IPython.core.magic_arguments import parse_argstring

from smolbench._magicargs import _up_args
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf


@pytest.mark.parametrize("said", ["sandbox --ray evil.example:6379", "sandbox --net on --allow 0.0.0.0/0",
                                  "sandbox --backend process", "sandbox --smolfile /tmp/theirs", "bogus", "",
                                  "SMOL", "sandbox\x1b[2J"])
def test_a_rows_backend_is_one_of_smolbenchs(tmp_path: Path, said: str) -> None:
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        led.add_checkpoint("theirs", "someone", "root", "checkpoints/theirs.smolcheckpoint", said, 1, 0, [])
        got = Shelf(led).backend_for("theirs")
    finally:
        led.close()
    assert got in ("sandbox", "smol", "cluster")
    args = parse_argstring(_up_args, f"--backend {got}")  # what %smol checkpoint restore runs with it
    assert args.backend == got and args.ray is None and args.net is None and args.allow is None
    assert args.smolfile is None


@pytest.mark.parametrize("said, backend", [("smol", "smol"), ("sandbox", "sandbox"), ("process", "sandbox"),
                                           (None, "sandbox")])
def test_a_rows_known_backend_is_kept(tmp_path: Path, said: str | None, backend: str) -> None:
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        led.add_checkpoint("mine", "someone", "root", "checkpoints/mine.smolcheckpoint", said, 1, 0, [])  # type: ignore[arg-type]
        assert Shelf(led).backend_for("mine") == backend
    finally:
        led.close()


def test_a_checkpoint_named_with_the_suffix_in_another_case_is_restored_by_name(tmp_path: Path) -> None:
    """``%smol checkpoint save run.SMOLCHECKPOINT`` is a valid name; restoring it by that name
    took it for a file (a copy that changed the suffix's case) and said there was none."""
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        assert shelf.names_file("other.SMOLCHECKPOINT")  # no such checkpoint: a file, as is_path says
        led.add_checkpoint("run.SMOLCHECKPOINT", "me", "root", "checkpoints/run.SMOLCHECKPOINT.smolcheckpoint",
                           "smol", 1, 0, [])
        assert not shelf.names_file("run.SMOLCHECKPOINT")
        assert shelf.backend_for("run.SMOLCHECKPOINT") == "smol"
        assert shelf.names_file("./run.SMOLCHECKPOINT") and shelf.names_file("x.smolcheckpoint")
    finally:
        led.close()
