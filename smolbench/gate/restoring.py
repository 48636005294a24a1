"""Which backend may restore a checkpoint, and what a restore says of a file from someone else.

A checkpoint's saved state is code: its namespace is a pickle, unpickled in the machine
that restores it. A ledger row (a copied folder's) or a file's record says only what its
author wrote, so a checkpoint this kernel did not save is restored only where there is
isolation, and no message advises the process backend for one: a restore says which
isolated backend to use instead.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection

from .terminal import one_line

CLAIM = "the file says: "  # before each warning a file's record carries: its author's words, not smolbench's
ROW_CLAIM = "its ledger row says: "  # before each warning a ledger row carries (a copied folder's is its author's)
CLAIM_TEXT = 500  # characters of one such warning kept
CLAIMS = 20  # warnings of a file kept (as many as a record may carry)

# The isolated backend that restores a checkpoint each backend made: the sandbox restores
# the process backend's too (the same two-file archive), a microVM's needs a microVM.
ISOLATED = {"sandbox": "sandbox", "process": "sandbox", "smol": "smol"}


def refusal(name: str, made: object, backend: str, own: bool, typed: str | None = None) -> str | None:
    """Why checkpoint ``name`` (made by the ``made`` backend, as a row says; ``own``: saved
    by this kernel process) can't be restored on ``backend``, in one line; None when it can.
    ``typed``: what the user restores it by (a file's path), when not its name."""
    made = str(made) if made else "sandbox"  # a file without a record: the archive both agent hosts write
    if backend == "process" and not own:
        again = shlex.quote(typed or name)
        return (f"checkpoint {name!r} was not saved in this kernel: its saved state is code, and the process "
                "backend would run it here with no isolation; restore it on the sandbox backend (`%smol down`, "
                f"then `%smol checkpoint restore {again}` brings one up)")
    if made == backend or (backend == "cluster" and made in ISOLATED) or \
            (backend == "sandbox" and ISOLATED.get(made) == "sandbox"):
        return None
    use = ISOLATED.get(made, "cluster" if made == "cluster" else None)
    if use is None:  # a row's word for a backend smolbench doesn't have
        return f"checkpoint {name!r} says it was made by a backend called {one_line(made, 40)}, which smolbench doesn't have"
    return f"checkpoint {name!r} was made by the {made} backend, but this machine uses {backend}: `%smol up --backend {use}` to restore it"


def claimed(warnings: list[str]) -> list[str]:
    """A file's own warnings as its claims: each one line of at most :data:`CLAIM_TEXT`
    characters (escaped as a machine's names are) after :data:`CLAIM` (once)."""
    return [CLAIM + one_line(str(w).removeprefix(CLAIM), CLAIM_TEXT) for w in warnings[:CLAIMS]]


def said_on_restore(warnings: object, imported: bool, already: Collection[str] = ()) -> list[str]:
    """The warnings a checkpoint's row keeps (its save's, or a file's record's), for a restore
    to say: each one line of at most :data:`CLAIM_TEXT` characters, escaped, after whose word
    it is (``imported``: the file's, as :func:`claimed`; else its ledger row's). One the
    restore says itself (``already``: a microVM's "state only") is not said twice."""
    if not isinstance(warnings, list):  # a copied ledger's row may hold anything
        return []
    lines = claimed(warnings) if imported else [ROW_CLAIM + one_line(str(w), CLAIM_TEXT) for w in warnings[:CLAIMS]]
    return [w for w in lines if w.removeprefix(CLAIM if imported else ROW_CLAIM) not in already]


def baseline_notice(name: str, claimed: object, here: str, imported: bool) -> str | None:
    """One line when checkpoint ``name`` says it was saved on another baseline than this
    machine's ``here`` (``imported``: a file's record says so, else a ledger row); None when
    it says nothing or the same. A restore goes on: the line says what may differ."""
    if not isinstance(claimed, str) or not claimed or claimed == here:
        return None
    whose = "the file says" if imported else "its ledger row says"
    return (f"{whose} {name} was saved on baseline {one_line(claimed, 80)}, not this machine's {here}"
            f"{_differs(claimed, here)}: its variables and files are back, but what its cells installed or relied "
            "on may differ; restore it where its Smolfile is: `%smol down`, then `%smol up --smolfile PATH` "
            "and restore again")


def _differs(claimed: str, here: str) -> str:
    """What a baseline (``IMAGE@HASH``, MachineSpec.baseline) says differs from this one: the
    image when it names another, else what the hash covers ("" when it is not such a baseline)."""
    theirs, at, _ = claimed.rpartition("@")
    ours = here.rpartition("@")[0]
    if not at or not theirs:
        return ""
    if theirs != ours:
        return f" (its image {one_line(theirs, 80)}, this machine's {ours})"
    return f" (the same image {ours}: its Smolfile's packages, env, init, network or limits differ)"
