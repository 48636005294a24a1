"""The gate's limits: sizes, counts and times, per kernel, changed with ``%smol config``.

The defaults keep what one kernel holds for machines' replies to a few hundred MB at
most (a laptop with 16 GB can't run out by accident): one reply line is at most
``max-frame`` bytes and ``max-items`` JSON values (each value costs the kernel ~50-250
bytes once decoded); unfinished lines of all machines together hold at most
``in-flight`` bytes; a cell shows at most ``output-limit`` bytes and ``displays`` displays.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from ..errors import SmolbenchError

KB, MB, GB = 1000, 1000**2, 1000**3
NUMBER_LIMIT = 1e300  # rewards and metrics must be finite and within +-NUMBER_LIMIT
MAX_BRANCHES = 1024


@dataclass
class Limits:
    """What the host accepts from a machine (sizes in bytes, times in seconds)."""

    max_frame: int = 64 * MB  # one reply line, including pulled values
    max_items: int = 1_000_000  # JSON values in one reply line (numbers, strings, lists, ...)
    in_flight: int = 256 * MB  # unfinished reply lines held for all machines together
    output: int = 5 * MB  # output shown per cell (per branch); the rest goes to a log
    displays: int = 200  # displays shown per cell (per branch); the rest are counted
    log: int = 200 * MB  # of that rest, how much is kept in .smolbench/outputs/ (gate.output.log_folder)
    line: int = 256 * 1024  # characters of one line shown; longer lines are cut
    grace: float = 3.0  # after an interrupt, seconds before a cell's machine is killed
    checkpoint: int = 2 * GB  # what a checkpoint may hold (namespace + workspace), read by real size


LIMITS = Limits()
NAMES = {"max-frame": "max_frame", "max-items": "max_items", "in-flight": "in_flight", "output-limit": "output",
         "displays": "displays", "log-limit": "log", "line-limit": "line", "grace": "grace",
         "checkpoint-limit": "checkpoint"}
CEILINGS = {"grace": 3600.0, "max_items": 10**9, "displays": 10**6, "line": 10**9}  # sizes: 1000 GB
COUNTS = {"max_items": "JSON values", "displays": "displays per cell", "line": "characters"}


def parse_size(text: str) -> int:
    """``10M``, ``512K``, ``2G``, ``1000`` -> bytes (decimal units, like ``ls -h --si``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise SmolbenchError(f"{text!r} is not a size: use e.g. 512K, 10M or 2G")
    unit = (m.group(2) or "").upper()
    base = 1024 if "I" in unit else 1000
    mult = {"K": base, "M": base**2, "G": base**3}.get(unit[:1], 1)
    value = int(float(m.group(1)) * mult)
    if value < 1:
        raise SmolbenchError(f"{text!r} is too small: give at least 1 byte")
    return value


def parse_count(text: str, key: str) -> int:
    """A whole number of at least 1 (``1000``, ``1_000_000``, ``2M`` = 2,000,000)."""
    m = re.fullmatch(r"\s*(\d[\d_,]*)\s*([KM]?)\s*", text, re.IGNORECASE)
    if not m or int(m.group(1).replace("_", "").replace(",", "")) < 1:
        raise SmolbenchError(f"{key} must be a whole number of at least 1, got {text!r}: e.g. %smol config {key} 1000")
    return int(m.group(1).replace("_", "").replace(",", "")) * {"": 1, "K": 1000, "M": 1000**2}[m.group(2).upper()]


def human(n: float) -> str:
    """Bytes as a short decimal size: 812 MB, 4.1 KB, 17 bytes."""
    if n < KB:
        return f"{int(n)} bytes"
    for unit, size in (("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 10 else f"{v:.1f} {unit}"
    return f"{int(n)} bytes"  # pragma: no cover


def seconds(text: str | float | None, option: str = "--timeout") -> float | None:
    """A positive finite number of seconds, or a one-line error naming ``option``."""
    if text is None:
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(text, bool) or not math.isfinite(value) or value <= 0:
        arg = option[2:].replace("-", "_") if option.startswith("--") else None  # --timeout: the Session's timeout=
        raise SmolbenchError(f"{option} must be a positive number of seconds, got {text!r}: e.g. {option} 30",
                             api=arg and f"{arg} must be a positive number of seconds, got {text!r}: e.g. {arg}=30")
    return value


def configure(key: str, value: str) -> str:
    """Set one limit from ``%smol config KEY VALUE``; returns how it now reads."""
    attr = NAMES.get(key)
    if attr is None:
        raise SmolbenchError(f"unknown setting {key!r}: one of {', '.join(NAMES)}")
    got: float
    if attr == "grace":
        got = seconds(value, key) or 0.0
    else:
        got = parse_count(value, key) if attr in COUNTS else parse_size(value)
    top = CEILINGS.get(attr, 1000 * GB)
    if got > top:  # past these a limit is no limit, and a typo should not make it one
        shown_top = f"{top:g} s" if attr == "grace" else f"{top:,}" if attr in COUNTS else human(top)
        raise SmolbenchError(f"{key} {value} is above the most it can be set to ({shown_top}): give a smaller value")
    setattr(LIMITS, attr, got)
    return describe()


def describe() -> str:
    """The current limits, one per line."""
    out = []
    width = max(map(len, NAMES))
    for key, attr in NAMES.items():
        v = getattr(LIMITS, attr)
        if attr == "grace":
            out.append(f"{key:<{width}} {v:g} s")
        elif attr in COUNTS:
            out.append(f"{key:<{width}} {v:,} {COUNTS[attr]}")
        else:
            out.append(f"{key:<{width}} {human(v)}")
    return "\n".join(out)


def snapshot() -> dict[str, float]:
    """The limits as plain values (a node agent applies the kernel's with ``apply``)."""
    return {f.name: getattr(LIMITS, f.name) for f in fields(Limits)}


def apply(values: dict[str, float]) -> None:
    """Take limits from ``snapshot()`` of another process (the kernel driving this node agent)."""
    for f in fields(Limits):
        v = values.get(f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 2**62:  # nan and inf fail too
            continue
        setattr(LIMITS, f.name, float(v) if f.name == "grace" else int(v))


def reset() -> None:
    """Back to the defaults (tests)."""
    for f in fields(Limits):
        setattr(LIMITS, f.name, f.default)
