"""A mistyped env name as one line with the fix: the closest name the machine knows.

``make("CartPol")`` names nothing defined in the session's machine, ``make("CartPol-v1")``
(or ``smolbench serve --gym CartPol-v1``) nothing in its gymnasium's registry: the
machine's own NameError (or gymnasium's NameNotFound) said so without the fix. The names
it knows are asked of the machine (its callables, its gymnasium's ids; the host's
registry if it can't say) and come back as data: each is checked to be a Python name or
a gymnasium id of at most :data:`LONGEST` characters, and only :data:`MOST` of each kind
are looked at, before the closest goes into the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .._didyoumean import closest
from .registered import ENV_ID, env_id_of

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name defined in the session's machine
MOST = 2000  # names of each kind looked at, at most
LONGEST = 100  # characters of a name that may be suggested, at most
LOOKUP_ERRORS = ("NameNotFound", "VersionNotFound", "NamespaceNotFound")  # gymnasium's, for an id it doesn't have
# The machine's names: its session's callables and its gymnasium's ids, bounded there too.
NAMES_CELL = f"""\
def _smolgym_names(g):
    names = [k for k, v in list(g.items()) if type(k) is str and not k.startswith("_") and callable(v)]
    try:
        import gymnasium
        ids = [k for k in list(gymnasium.registry) if type(k) is str]
    except Exception:
        ids = None
    return {{"names": [k for k in names if len(k) <= {LONGEST}][:{MOST}],
            "ids": None if ids is None else [k for k in ids if len(k) <= {LONGEST}][:{MOST}]}}
_smolgym_out = _smolgym_names(globals())
del _smolgym_names
"""


@dataclass
class Unknown:
    """What the machine did not know: a name defined there, or a gymnasium id."""

    asked: str
    is_id: bool


def unknown(env: Any, error: Any) -> Unknown | None:
    """What building ``env`` failed to find, if the machine's ``error`` (its data: compared,
    not shown) says it was the name or id asked for; else None."""
    if not isinstance(error, dict):
        return None
    ename, evalue = error.get("ename"), error.get("evalue")
    if isinstance(env, str):
        return Unknown(env, False) if ename == "NameError" and evalue == f"name {env!r} is not defined" else None
    env_id = env_id_of(env)
    return Unknown(env_id, True) if env_id is not None and ename in LOOKUP_ERRORS else None


def known(data: Any) -> tuple[list[str], list[str] | None]:
    """The machine's answer to :data:`NAMES_CELL`, checked: its Python names and its gymnasium
    ids (None: it could not say)."""
    if not isinstance(data, dict):
        return [], None
    names, ids = data.get("names"), data.get("ids")
    return _checked(names, _is_name), (_checked(ids, _is_id) if isinstance(ids, list) else None)


def _checked(values: Any, fits: Any) -> list[str]:
    if not isinstance(values, list):
        return []
    return [v for v in values[:MOST] if isinstance(v, str) and len(v) <= LONGEST and fits(v)]


def _is_name(value: str) -> bool:
    return NAME_RE.fullmatch(value) is not None


def _is_id(value: str) -> bool:
    """An id make() takes as one (a Python name is taken for a name defined in the machine)."""
    return ENV_ID.fullmatch(value) is not None and NAME_RE.fullmatch(value) is None


def host_ids() -> list[str]:
    """This host's gymnasium ids (the fallback where the machine could not say its own)."""
    try:
        import gymnasium

        return _checked(list(gymnasium.registry), _is_id)
    except Exception:
        return []


def suggestion(asked: str, names: list[str], ids: list[str]) -> str | None:
    """The closest of ``names`` and ``ids`` to ``asked``; of an id's versions, the one asked
    for if there is one, else the latest."""
    fix = closest(asked, names + ids)
    if fix is None or fix not in ids or "-v" not in fix:
        return fix
    base = fix.rpartition("-v")[0]
    versions = {int(v) for i in ids for b, _, v in [i.rpartition("-v")] if b == base and v.isdigit()}
    if not versions:
        return fix
    want = asked.rpartition("-v")[2]
    version = int(want) if want.isdigit() and int(want) in versions else max(versions)
    return f"{base}-v{version}"


def misnamed(what: Unknown, data: Any) -> str:
    """The one line for ``what``, with the closest name from ``data`` (the machine's answer to
    :data:`NAMES_CELL`, or None where it gave none)."""
    names, ids = known(data)
    if ids is None:
        ids = host_ids()
    fix = suggestion(what.asked, [] if what.is_id else names, ids)
    if what.is_id:
        said = f"gymnasium in the session's machine has no env {what.asked!r}"
        hint = "give one registered there (e.g. CartPole-v1), or 'module:Name-v0' to import the module that registers it"
    else:
        said = f"{what.asked!r} is not defined in the session's machine, nor a gymnasium id"
        hint = "give the name of a zero-argument callable defined there, a gymnasium id (CartPole-v1), or the callable"
    return f"{said}: did you mean {fix!r}?" if fix is not None else f"{said}: {hint}"
