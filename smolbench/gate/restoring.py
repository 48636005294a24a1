"""Which backend may restore a checkpoint, and what a restore says of a file from someone else.

A checkpoint's saved state is code: its namespace is a pickle, unpickled in the machine
that restores it. A ledger row (a copied folder's) or a file's record says only what its
author wrote, so a checkpoint this kernel did not save is restored only where there is
isolation, and no message advises the process backend for one: a restore says which
isolated backend to use instead.
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import urllib.parse
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from .archive import RECORD_FIELDS
from .terminal import listed, one_line

if TYPE_CHECKING:
    from ..spec import MachineSpec

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


MACHINE_KEYS = ("image", "parts", "packages", "memory", "cpus")  # what a record or row says of its machine
FIX = "restore it where its Smolfile is: `%smol down`, then `%smol up --smolfile PATH` and restore again"
SHOWN = 8  # packages or modules named in one line; more are counted


def machine_claims(*sources: object) -> dict[str, Any]:
    """What a checkpoint says of the machine that saved it (:data:`MACHINE_KEYS`), from a record
    or a ledger row's ``machine`` (a copied folder's may hold anything): only values its record
    could carry (:data:`archive.RECORD_FIELDS`), the first source that has each."""
    out: dict[str, Any] = {}
    for source in sources:
        if isinstance(source, dict):
            for key in MACHINE_KEYS:
                if key not in out and key in source and (source[key] is None and key == "image" or
                                                         source[key] is not None and RECORD_FIELDS[key](source[key])):
                    out[key] = source[key]
    return out


# -- what an export says of its machine: nothing of the exporter's disk ----------------------------
_URL_REQUIREMENT = re.compile(r"(?P<head>[^@]*@\s*)(?P<url>\S+)(?P<tail>.*)", re.DOTALL)  # name @ URL ; marker
_PATH_PREFIXES = ("/", "./", "../", "~")  # images.is_path_image's
_HOST_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s'\"()<>,;:/]+/)+([^\s'\"()<>,;:/]*)")  # /a/b/c: two parts or more


def shared_requirement(text: str) -> str:
    """A Smolfile requirement as an export says it: a wheel on the exporter's disk (``file:``) by
    its file name and the SHA-256 of its content (``name @ file.whl#sha256=HASH``: another wheel of
    the same name is not the same; audit), any other URL without its ``user:password@`` and query
    (either may carry a token). What a restore compares ours with too (:func:`lacking`,
    :func:`_part_diffs`): a student's own wheel by its own content."""
    m = _URL_REQUIREMENT.fullmatch(text)
    if m is None:
        return text
    parts = urllib.parse.urlsplit(m["url"])
    if parts.scheme == "file":
        digest = _wheel_hash(text) or next(iter(_SHA256.findall(parts.fragment)), None)
        shown = posixpath.basename(urllib.parse.unquote(parts.path)) + (f"#sha256={digest}" if digest else "")
    else:
        shown = urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", parts.fragment))
    return f"{m['head']}{shown}{m['tail']}"


_SHA256 = re.compile(r"(?:^|&)sha256=([0-9a-f]{64})(?=&|$)")  # a URL fragment's pin, as pip reads it


def _wheel_hash(text: str) -> str | None:
    """The SHA-256 of the local wheel ``text`` names (None: not readable here; its pin, if any, stands)."""
    from .._pkgwheels import wheel_hashes
    from ..errors import SmolbenchError

    try:
        return wheel_hashes((text,)).get(text)
    except (SmolbenchError, OSError, ValueError):
        return None


PATH_IMAGE = "\u2026/"  # before a path image's file name in an export: never the same as a named image


def shared_image(image: str | None) -> str | None:
    """An image as an export says it: a rootfs folder or archive by its file name only, marked a
    path (``…/rootfs``: a registry image named ``rootfs`` is another image)."""
    if image is None or not (image in (".", "..") or image.startswith(_PATH_PREFIXES)):
        return image
    return PATH_IMAGE + (posixpath.basename(posixpath.normpath(image)) or "/")


def shared_text(text: str) -> str:
    """A warning as an export says it: the home folder as ``~``, any other path of the host by
    its last part (``…/name``)."""
    home = os.path.expanduser("~")
    if home not in ("", "/", "~"):
        for form in {os.path.realpath(home), home.rstrip("/")}:
            text = re.sub(re.escape(form) + r"(?![\w.-])", "~", text)
    return _HOST_PATH.sub(lambda m: "\u2026/" + m[1], text)


def shared_record(record: dict[str, Any]) -> dict[str, Any]:
    """An exported record without what names the exporter's disk or user: its packages and image
    (:func:`shared_requirement`, :func:`shared_image`), the packages' part hashed over those, its
    warnings through :func:`shared_text`; and no ``baseline`` beside ``parts`` (a hash over the
    host's paths, its image's path first, that a restore compares only when there are no parts:
    another machine's baseline never matched it). A record without parts (an older save, a file
    re-exported) keeps its baseline as its only claim, its image by file name."""
    from ..spec import part_hash

    out = dict(record)
    if "parts" in out:
        out.pop("baseline", None)
    elif isinstance(out.get("baseline"), str) and "@" in out["baseline"]:
        image, _, digest = out["baseline"].rpartition("@")
        out["baseline"] = f"{shared_image(image)}@{digest}"
    if "image" in out:
        out["image"] = shared_image(out["image"])
    if isinstance(out.get("packages"), list):
        out["packages"] = [shared_requirement(p) for p in out["packages"]]
    if isinstance(out.get("parts"), dict) and "packages" in out["parts"]:
        out["parts"] = {k: v for k, v in out["parts"].items() if k != "packages"}
        if isinstance(out.get("packages"), list):  # else it says nothing of them: never a hash of paths
            out["parts"]["packages"] = part_hash(out["packages"])
    if isinstance(out.get("warnings"), list):
        out["warnings"] = [shared_text(str(w)) for w in out["warnings"]]
    return out


def baseline_notice(name: str, claimed: object, here: str, imported: bool, *, machine: object = None,
                    spec: MachineSpec | None = None, failed: bool = False) -> str | None:
    """One line when checkpoint ``name`` was saved on a machine that differs from this one in
    what decides whether its variables behave (its image, packages, env, init, workdir,
    volumes: MachineSpec.parts), as its record or row says (``imported``: a file's record, else
    a ledger row); None when it says nothing, or differs only in a session's network allowance
    or limits. ``claimed``: its baseline (``here``: this machine's), all a record from before
    ``machine`` (what it says of its machine: image, parts, packages, memory, cpus) says.
    ``spec``: this machine's. ``failed``: some of its variables were not restored (said before
    this line): the line never says they are back."""
    theirs = machine_claims(machine)
    whose, who = ("the file says", "the file's machine") if imported else ("its ledger row says", "its machine")
    if spec is not None and "parts" in theirs:
        diffs = _part_diffs(theirs, spec, who)
        if not diffs:
            return None
        what = f"{whose} {name} was saved on a machine unlike this one ({'; '.join(diffs)}{_limits(theirs, spec, who)})"
    else:
        if not isinstance(claimed, str) or not claimed or claimed == here:
            return None
        what = (f"{whose} {name} was saved on baseline {one_line(claimed, 80)}, not this machine's {here}"
                f"{_differs(claimed, here, _limits(theirs, spec, who))}")
    if failed:
        back = "the variables not restored (named above) may need what its machine had"
    else:
        back = "its variables and files are back, but what its cells installed or relied on may differ"
    return f"{what}: {back}; {FIX}"


def _part_diffs(theirs: dict[str, Any], spec: MachineSpec, who: str) -> list[str]:
    """What differs between the machine a checkpoint says it was saved on and ``spec``, each a phrase."""
    from ..spec import part_hash

    out = []
    if theirs.get("image") not in (spec.image, shared_image(spec.image)):  # an export's: by its file name
        out.append(f"its image {one_line(str(theirs.get('image') or 'host'), 80)}, this machine's {spec.image or 'host'}")
    ours = spec.parts()
    shared = part_hash([shared_requirement(p) for p in spec.packages])  # an export's hash (shared_record)
    if theirs["parts"].get("packages", ours["packages"]) not in (ours["packages"], shared):
        out.append(packages_phrase(theirs.get("packages"), spec.packages, who))
    other = [k for k in ("env", "init", "workdir", "volumes") if theirs["parts"].get(k, ours[k]) != ours[k]]
    if other:
        said = " and ".join(", ".join(other).rsplit(", ", 1))
        out.append(f"its Smolfile's {said} differ{'s' if len(other) == 1 else ''}")
    return out


def packages_phrase(theirs: object, ours: tuple[str, ...], who: str) -> str:
    """Its Smolfile's packages differ, and how, when the claim lists them (``theirs``)."""
    if not isinstance(theirs, list):
        return "its Smolfile's packages differ"
    lacks = lacking(theirs, ours)
    had = listed([one_line(p, 200) for p in theirs], SHOWN) if theirs else "none"
    now = f"this one lacks {listed([one_line(p, 200) for p in lacks], SHOWN)}" if lacks else \
        f"this one has {listed(list(ours), SHOWN) or 'none'}"
    return f"its Smolfile's packages differ: {who} had {had}, {now}"


def lacking(theirs: list[str], ours: tuple[str, ...]) -> list[str]:
    """The requirements of ``theirs`` that ``ours`` has not as they are (by project name, then as written)."""
    have: dict[str, set[str]] = {}
    for p in ours:  # as written, and as an export says it (a wheel by its file name)
        have.setdefault(_project(p), set()).update((p.strip(), shared_requirement(p.strip())))
    return [p for p in theirs if p.strip() not in have.get(_project(p), ())]


def _project(requirement: str) -> str:
    """A requirement's project name, normalized (PEP 503): ``Foo_Bar>=1`` -> ``foo-bar``."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", m[1]).lower() if m else requirement.strip().lower()


def _limits(theirs: dict[str, Any], spec: MachineSpec | None, who: str) -> str:
    """The limits a checkpoint's machine had that this one hasn't (said, not a difference that matters)."""
    if spec is None:
        return ""
    said = []
    if isinstance(theirs.get("memory"), int) and theirs["memory"] != spec.memory:
        said.append(f"memory {_mib(theirs['memory'])}, this one {_mib(spec.memory)}")
    if isinstance(theirs.get("cpus"), int) and theirs["cpus"] != spec.cpus:
        said.append(f"cpus {theirs['cpus']}, this one {spec.cpus}")
    return f"; {who} had {', '.join(said)}" if said else ""


def _mib(mib: int) -> str:
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z0-9_.]{1,100})'")


def modules_notice(name: str, not_restored: list[str], machine: object, spec: MachineSpec,
                   said: str | None) -> str | None:
    """One line when variables of checkpoint ``name`` were not restored for want of a module
    (``not_restored``: the restore's own warnings), naming the packages the file's machine had
    that this one lacks and the fix; None when none was, or the baseline line (``said``)
    names those packages already."""
    modules = list(dict.fromkeys(m.split(".")[0] for line in not_restored for m in MISSING_MODULE.findall(line)))
    if not modules:
        return None
    theirs = machine_claims(machine).get("packages")
    lacks = lacking(theirs, spec.packages) if isinstance(theirs, list) else None
    if lacks and said is not None and "this one lacks" in said:
        return None
    head = f"variables of {name} need modules this machine doesn't have ({listed(modules, SHOWN)})"
    if lacks:
        shown = listed([one_line(p, 200) for p in lacks], SHOWN)
        return (f"{head}: the file's machine's Smolfile had packages {shown}, which this one lacks: add them to this "
                "machine's Smolfile (`packages = [...]`), then `%smol down`, `%smol up` and restore again (a "
                "`%pip install` in a cell brings the module, not the variables)")
    if isinstance(theirs, list):
        return (f"{head}, and the file's machine had no package in its Smolfile that this one lacks: add the ones "
                "they come from to this machine's Smolfile (`packages = [...]`), then `%smol down`, `%smol up` and "
                "restore again")
    return (f"{head}: the file doesn't say which packages its machine had (an older smolbench's record): ask for "
            "the Smolfile it was made with, then `%smol down`, `%smol up --smolfile PATH` and restore again")


def _differs(claimed: str, here: str, limits: str = "") -> str:
    """What a baseline (``IMAGE@HASH``, MachineSpec.baseline) says differs from this one: the
    image when it names another, else what the hash covers ("" when it is not such a baseline);
    ``limits``: the limits its record says its machine had, when they differ."""
    theirs, at, _ = claimed.rpartition("@")
    ours = here.rpartition("@")[0]
    if not at or not theirs:
        return ""
    if theirs != ours:
        return f" (its image {one_line(theirs, 80)}, this machine's {ours}{limits})"
    return (f" (the same image {ours}: its packages, env, init, network allowance or limits differ, and its record, "
            f"an older smolbench's, doesn't say which{limits})")
