"""Checks of what a caller hands the public API: one line naming the argument and the fix.

The magics parse text into these types already; a script calling :class:`smolbench.Session`
can pass anything, and a wrong type must not surface as a ``TypeError`` from deep inside
(or, worse, after a machine was claimed for a fork that then can't start).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .errors import SmolbenchError

SEED_MAX = 2**63 - 1  # seeds are ledger integers (SQLite's are 64-bit)


def whole(value: Any, what: str, lo: int | None = None, hi: int | None = None, example: str = "",
          api_what: str | None = None, api_example: str | None = None) -> int:
    """``value`` as a whole number within [lo, hi] (never a bool or a float), else one line
    (``api_what``, ``api_example``: what the Session calls it and its example, when ``what``
    and ``example`` are the magics' words: ``--retries``, ``--retries 1``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _said(f"must be a whole number, got {_shown(value)}", what, example, api_what, api_example)
    if lo is not None and value < lo or hi is not None and value > hi:
        span = f"from {lo} to {hi}" if lo is not None and hi is not None else (f"at least {lo}" if lo is not None
                                                                                  else f"at most {hi}")
        raise _said(f"must be {span}, got {value}", what, example, api_what, api_example)
    return value


def _said(rest: str, what: str, example: str, api_what: str | None, api_example: str | None) -> SmolbenchError:
    def line(who: str, eg: str) -> str:
        return f"{who} {rest}" + (f": e.g. {eg}" if eg else "")

    api = None if api_what is None and api_example is None else line(api_what or what, api_example or example)
    return SmolbenchError(line(what, example), api=api)


def optional_whole(value: Any, what: str, lo: int | None = None, hi: int | None = None, example: str = "") -> int | None:
    return None if value is None else whole(value, what, lo, hi, example)


def seed(value: Any, what: str = "a seed", api_what: str | None = None) -> int:
    return whole(value, what, -SEED_MAX, SEED_MAX, api_what=api_what)


def seeds(values: Any, what: str = "seeds") -> list[int] | None:
    """A list of seeds (any iterable of whole numbers, not a string), or None."""
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise SmolbenchError(f"{what} must be a list of whole numbers, got {_shown(values)}: e.g. seeds=range(16)")
    return [seed(v, f"each of {what}") for v in values]


def code(value: Any, what: str = "code") -> str:
    if not isinstance(value, str):
        raise SmolbenchError(f"{what} must be Python source as a str, got {_shown(value)}: e.g. run('x = 1')")
    return value


def names(value: Any, what: str) -> list[str]:
    """Variable names: a list, or one string (``"a"`` or ``"a,b"``)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise SmolbenchError(f"{what} must be variable names, got {_shown(value)}: e.g. {what}=['data', 'env']")
    for v in value:
        if not isinstance(v, str) or not v.isidentifier():
            raise SmolbenchError(f"{what} {_shown(v)} is not a variable name: give names like data or env")
    return list(value)


def mapping(value: Any, what: str, example: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SmolbenchError(f"{what} must be a dict of variable names to values, got {_shown(value)}: e.g. {example}")
    return value


def path(value: Any, what: str, example: str) -> str | None:
    """A file path (a str or os.PathLike), or None."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        got = os.fspath(value)
        if isinstance(got, str) and got:
            return got
    raise SmolbenchError(f"{what} must be a file path, got {_shown(value)}: e.g. {example}")


def text(value: Any, what: str, example: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise SmolbenchError(f"{what} must be a str, got {_shown(value)}: e.g. {example}")


def callback(value: Any, what: str, signature: str) -> Callable[..., Any] | None:
    if value is None or callable(value):
        return value
    raise SmolbenchError(f"{what} must be a function {signature}, got {_shown(value)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


KEEP_POLICIES = ("best", "all", "none")


def fanout(n: Any, seeds: list[int] | None, seed_base: Any, timeout: float | None,
           concurrency: int | None, keep: str, kind: str = "fork") -> int:
    """``n`` branches of a fork (``kind``) or episodes, checked with its options: one line for each bad one."""
    from .gate import limits

    if isinstance(n, bool) or not isinstance(n, int):
        raise SmolbenchError(f"the number of branches must be a whole number, got {n!r}: e.g. `%%smol {kind} 16`",
                             api=f"the number of branches must be a whole number, got {n!r}: e.g. "
                             f"`Session.{kind}(16, code)`")
    if n < 1:
        raise SmolbenchError(f"the number of branches must be at least 1, got {n}: e.g. `%%smol {kind} 16`",
                             api=f"the number of branches must be at least 1, got {n}: e.g. `Session.{kind}(16, code)`")
    if n > limits.MAX_BRANCHES and kind == "episodes":
        cap = limits.MAX_BRANCHES
        nxt = seed_base + cap if type(seed_base) is int else cap
        raise SmolbenchError(f"{n} episodes is above the cap of {cap} in one run: run {cap}, then the next with "
                             f"`--seed-base {nxt}`", api=f"{n} episodes is above the cap of {cap} in one run: run "
                             f"{cap}, then the next with seed_base={nxt}")
    if n > limits.MAX_BRANCHES:
        raise SmolbenchError(f"{n} branches is above the cap of {limits.MAX_BRANCHES}: fork fewer, or fork in stages with `%smol use`",
                             api=f"{n} branches is above the cap of {limits.MAX_BRANCHES}: fork fewer, or fork in stages "
                             "with `Session.use(node)`")
    if seeds is not None and len(seeds) < n:
        raise SmolbenchError(f"--seeds gives {len(seeds)} seeds for {n} branches: give at least {n} (e.g. --seeds 0:{n})",
                             api=f"seeds gives {len(seeds)} seeds for {n} branches: give at least {n} (e.g. "
                             f"seeds=range({n}))")
    for s in (seeds or [])[:n]:  # ledger integers: a bigger one failed after the parent was claimed
        seed(s, "each of --seeds", "each of seeds")
    seed(seed_base, "--seed-base", "seed_base")
    seed(seed_base + n - 1, f"--seed-base {seed_base} + {n - 1}", f"seed_base={seed_base} + {n - 1}")
    limits.seconds(timeout)
    if concurrency is not None and concurrency < 1:
        raise SmolbenchError(f"--concurrency must be at least 1, got {concurrency}",
                             api=f"concurrency must be at least 1, got {concurrency}")
    if keep not in KEEP_POLICIES:
        raise SmolbenchError(f"--keep must be one of {', '.join(KEEP_POLICIES)}, got {keep!r}",
                             api=f"keep must be one of {', '.join(KEEP_POLICIES)}, got {keep!r}")
    return n
