"""One-line "did you mean" errors for a mistyped ``%smol`` command or ``%%smol`` word, and the
closest of any set of names (``smolbench.gym``'s env names)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

CELL_WORDS = ("fork", "episodes")  # what may follow %%smol before its options
LINE_WORDS = ("up", "status", "down", "tree", "use", "delete", "ledger", "plot", "replay", "checkpoint", "trust",
              "config")
_GLUED = re.compile(r"^(fork|episodes)(\d+)$")


def _suggest(word: str, choices: tuple[str, ...]) -> str | None:
    """``word`` with a count glued on split off (``fork16``), else the closest of ``choices``."""
    glued = _GLUED.match(word)
    if glued:
        return f"{glued.group(1)} {glued.group(2)}"
    return closest(word, choices)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` closest to ``word``, if close enough to be what was meant."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def cell_word_error(line: str) -> str | None:
    """Why ``%%smol LINE`` can't start (one line with the likely fix), or None if it may.

    A ``%%smol`` cell takes options only, or ``fork N`` / ``episodes N``; a first word that
    is neither is a typo of those most of the time (``fork16``, ``frok 4``).
    """
    words = line.split()
    if not words or words[0].startswith("-") or words[0] in CELL_WORDS:
        return None
    word, rest = words[0], words[1:]
    fix = _suggest(word, CELL_WORDS)
    if fix is not None:
        return f"unknown %%smol word {word!r}: did you mean `%%smol {' '.join([fix, *rest])}`?"
    return (f"unknown %%smol word {word!r}: a %%smol cell takes `fork N`, `episodes N` or options "
            "(--timeout, --push, --pull) (see %smol?)")


def line_word_error(word: str) -> str:
    """The one line for an unknown ``%smol WORD`` command, with the closest command."""
    close = closest(word, LINE_WORDS)
    hint = f"did you mean `%smol {close}`? " if close else ""
    return f"unknown %smol command {word!r}: {hint}one of {', '.join(LINE_WORDS)} (see %smol?)"
