"""A machine's stream text can't reach past its own line (gate/terminal.py).

The attack on each line: a branch erases or overwrites the ``[branch]`` name the host put
before it, or starts a style that hides the lines after its own. The browser test
(test_browser_terminal.py) shows the same in JupyterLab, and the weakened gate failing.
"""

from __future__ import annotations

from smolbench.gate import terminal


def test_backspaces_erase_only_the_branch_s_own_characters() -> None:
    assert terminal.prefixed("root.1", "\b" * 9 + "[root.0] reward=999\n") == "[root.1] [root.0] reward=999\n"
    assert terminal.prefixed("root.1", "abc\b\bX\n") == "[root.1] aX\n"  # what the notebook shows of it


def test_a_carriage_return_starts_a_line_that_has_the_name_again() -> None:
    shown = terminal.prefixed("root.1", "50%\r100%\n")
    assert shown == "[root.1] 50%\r[root.1] 100%\n"


def test_a_style_ends_with_its_line_and_the_text_always_ends_a_line() -> None:
    assert terminal.prefixed("b", "\x1b[30;40mdark\nnext") == "[b] \x1b[30;40mdark\x1b[0m\n[b] next\n"
    assert terminal.closed("\x1b[8mgone\n") == "\x1b[8mgone\x1b[0m\n"  # before the line end: no empty line
    assert terminal.closed("plain\n") == "plain\n"


def test_weakened_the_line_reaches_the_name_and_the_next_lines() -> None:
    terminal.TEST_WEAKEN.add("terminal")
    try:
        assert terminal.prefixed("root.1", "\b\b\x1b[8mx\n") == "[root.1] \b\b\x1b[8mx\n"
        assert terminal.closed("\x1b[8m") == "\x1b[8m"
    finally:
        terminal.TEST_WEAKEN.discard("terminal")


def test_a_text_box_gets_the_text_without_escapes_or_controls() -> None:
    assert terminal.plain("\x1b[31mred\x1b[0m\b\x07 50%\r100%\r\n") == "red 50%\n100%\n"
    # C1 controls (\x9b: an 8-bit CSI) and bidi overrides and isolates go too (outside audit)
    assert terminal.plain("a\x9b2Jb\x85c\u202edcba\u2066x\u2069 é ✓") == "a2Jbcdcbax é ✓"


def test_an_error_s_lines_keep_their_styles_and_backspaces_to_themselves() -> None:
    tb = "File x\n  \x1b[30;40mdark\n\b\b\bx\n"
    assert terminal.kept_to_lines(tb) == "File x\n  \x1b[30;40mdark\x1b[0m\nx\n"
    assert terminal.kept_to_lines("plain\ntext") == "plain\ntext"
