"""Machine text shown beside the host's own: a machine's line can't reach past itself.

JupyterLab and Notebook 7 act on a stream's control characters when they show it: a
backspace erases the character before it, a carriage return goes back to the start of
its line, and an ANSI SGR code sets a style that lasts, across lines, until a reset. A
fork's output puts each branch's name before each of its lines, and the host writes its
own notes on the same streams; so a branch must not erase its name or write over it, and
no machine may style (hide: black on black) the lines that come after its own.
"""

from __future__ import annotations

import re

RESET = "\x1b[0m"
# ANSI escapes (CSI with its parameters, or ESC and one character), the C0 controls a text box
# shows as garbage, the C1 ones (\x9b starts a CSI on terminals that take 8-bit codes) and
# bidi overrides and isolates (text shown reordered); a line end and a tab stay.
_CONTROLS = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b.?|[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

TEST_WEAKEN: set[str] = set()  # "terminal": tests show a branch's line reaching past itself without this
NAME_TEXT = 256  # characters of one name a machine sends (a variable a restore skipped) kept in a host line
LISTED = 20  # names a host line lists before saying how many more there are


def closed(text: str) -> str:
    """``text`` with any style it starts ended where it ends (an ANSI reset after it)."""
    if "\x1b" not in text or "terminal" in TEST_WEAKEN:
        return text
    body = text.rstrip("\r\n")
    return body + RESET + text[len(body):]  # before the line end: a line of its own would show


def plain(text: str) -> str:
    """``text`` for a box that shows text as it is (a widget's log): no escapes or controls."""
    return _CONTROLS.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


_STYLE = re.compile(r"\x1b\[[0-9;]*m")  # a colour (SGR): the host's own, or one a machine wrote


def printable(text: str) -> str:
    """``text`` (a machine's traceback, in a note Python prints on a terminal) with its line
    ends and tabs, without colours, and anything else a terminal would act on (escapes,
    controls, C1 codes, bidi overrides) shown escaped, as ``\\x1b``."""
    lines = _STYLE.sub("", text).replace("\r\n", "\n").split("\n")
    return "\n".join(line if line.replace("\t", " ").isprintable() else
                     "".join(ch if ch.isprintable() or ch == "\t" else ch.encode("unicode_escape").decode("ascii")
                             for ch in line) for line in lines)


def one_line(text: str, limit: int = NAME_TEXT) -> str:
    """A machine's short text (a variable's name in a warning) for inside one host line:
    whatever a terminal or a text box would act on (escapes, controls, line ends, bidi
    overrides) shown escaped, as ``\\x1b``, and the whole cut to ``limit`` characters."""
    cut = text[:limit]  # first: escaping costs by the character
    if not cut.isprintable():
        cut = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in cut)
    return cut if len(cut) <= limit and len(text) <= limit else cut[: limit - 1] + "…"


def listed(names: list[str], first: int = LISTED) -> str:
    """Names (each :func:`one_line` already) for one host line: the first few, then how many more."""
    shown = ", ".join(names[:first])
    return shown if len(names) <= first else f"{shown} … and {len(names) - first} more"


def _backspaced(line: str) -> str:
    """What the notebook shows of ``line``'s backspaces, done here: each erases the character
    before it, and none reaches before the line's start (where the branch's name is)."""
    kept: list[str] = []
    for ch in line:
        if ch != "\b":
            kept.append(ch)
        elif kept:
            kept.pop()
    return "".join(kept)


def _own_line(piece: str) -> tuple[str, str]:
    """A line's text kept to itself (its backspaces resolved within it, any style it starts
    ended at its end), and its line end."""
    body = piece.rstrip("\r\n")
    end = piece[len(body):]
    if "terminal" not in TEST_WEAKEN:
        if "\b" in body:
            body = _backspaced(body)
        if "\x1b" in body:
            body += RESET
    return body, end


def kept_to_lines(text: str) -> str:
    """``text`` (an error's message or traceback) with each line kept to itself: a fork's
    errors are shown one after another, and a branch's must not hide or erase the next
    branch's, or the host's lines around them."""
    if "\b" not in text and "\x1b" not in text:
        return text
    return "".join(body + end for body, end in map(_own_line, text.splitlines(True)))


def prefixed(branch: str, text: str) -> str:
    """``text`` as whole lines, each after ``[branch] ``, none able to reach the name or the
    lines after it; ends with a line end."""
    out = []
    for piece in text.splitlines(True):  # also at a lone "\r": the line written over gets its name again
        body, end = _own_line(piece)
        out.append(f"[{branch}] {body}" + (end or "\n"))
    text = "".join(out)
    return text if text.endswith("\n") else text + "\n"
