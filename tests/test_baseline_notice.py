"""A restore of a checkpoint saved on another baseline says, in its one line, what differs
and how to restore it where it matches: it named two opaque hashes (`host@b4a6…` vs
`host@9a0f…`) and no way on."""

from __future__ import annotations

from smolbench.gate import restoring

FIX = "; restore it where its Smolfile is: `%smol down`, then `%smol up --smolfile PATH` and restore again"


def test_the_baseline_warning_ends_with_the_fix_and_names_what_differs() -> None:
    same_image = restoring.baseline_notice("lesson1", "host@b4a6c0ffee00", "host@9a0f12345678", True)
    assert same_image == (
        "the file says lesson1 was saved on baseline host@b4a6c0ffee00, not this machine's host@9a0f12345678 "
        "(the same image host: its Smolfile's packages, env, init, network or limits differ): its variables and "
        "files are back, but what its cells installed or relied on may differ" + FIX)
    other = restoring.baseline_notice("lesson1", "python:3.12@b4a6c0ffee00", "host@9a0f12345678", False)
    assert other is not None and other.startswith("its ledger row says lesson1 ")
    assert "(its image python:3.12, this machine's host):" in other and other.endswith(FIX)
    # a claim that is not IMAGE@HASH says nothing of what differs; text from a file stays one line
    odd = restoring.baseline_notice("x", "\x1b]0;t\x07@\n" + "a" * 300, "host@9a0f12345678", True)
    assert odd is not None and odd.isprintable() and len(odd) < 600 and odd.endswith(FIX), odd
    assert "\\x1b]0;t\\x07" in odd
    assert restoring.baseline_notice("x", "host@9a0f12345678", "host@9a0f12345678", True) is None
