"""The ``%smol`` / ``%%smol`` words: help text, option bundles (magic_arguments) and their parsers."""

from __future__ import annotations

import keyword
import re
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from . import _args, gate
from ._didyoumean import closest
from .errors import SmolbenchError

HELP = """Run notebook cells inside disposable, forkable machines.

Line magics::

  %smol up [--smolfile PATH] [--backend auto|smol|sandbox|process] [--target local|cloud] [--image IMAGE]
          [--net on|off] [--allow HOSTS,CIDRS] [--ledger PATH] [--max-alive N] [--retries K] [--ray [ADDRESS]]
  %smol status                  backend, machine, image, isolation, limits (disk too), live machines and
                                their memory, the last machine lost (also one killed while idle) and why
  %smol down                    delete every machine this kernel created (a running --bg fork is
                                cancelled first)
  %smol tree                    the fork tree (live widget)
  %smol use NODE|best           make a live node (e.g. root.7) the active machine
  %smol delete NODE             delete a node's machine and everything below it
  %smol ledger [-n N]           the ledger's last N nodes (default 20), as a table
  %smol plot                    reward plots across the whole tree
  %smol replay NODE             rebuild a branch's path and compare its reward (not a gym episode's)
  %smol checkpoint save [NAME] [--node NODE] [--force] | restore NAME|PATH | list | rm NAME
                    | export NAME PATH [--force]   (restore PATH works in any folder, with nothing up)
                    | trust NAME   (sign a checkpoint not signed as your own save: a copied folder's,
                                    or one from before rows were signed; only one you saved yourself)
  %smol trust on|off            on: pulls may unpickle objects and machine output is shown raw
                                (code in the machine can then run code here and in your browser)
  %smol config [KEY VALUE]      limits on what a machine sends: max-frame, in-flight,
                                output-limit, log-limit, checkpoint-limit (sizes like 10M),
                                max-items, displays, line-limit (counts) and grace (seconds)

Cell magics::

  %%smol [--push a,b] [--pull c] [--pull-trusted] [--timeout S]
      run the cell in the active machine; its state persists between cells. --pull brings
      values back as data (builtins, numpy arrays, pandas objects); --pull-trusted also
      unpickles other objects, which runs code from the machine on this host. display(),
      IPython's display and matplotlib figures (as PNG) show as in a local cell; %pip and
      !pip work, other shell escapes don't (subprocess.run does)
  %%smol fork N [--seed-base B | --seeds 3,7,11 | --seeds 0:16] [--timeout S]
                [--concurrency K] [--keep best|all|none] [--out NAME] [--bg]
                [--group-outputs order|branch|type] [--push a,b] [--allow-errors] [--quiet]
                [--retries K] [--no-reseed]
      run the cell in N live copy-on-write branches of the active machine, each with its own
      SEED; set `reward = ...` (or call smolbench_guest.report(reward=..., **metrics)).
      Random generators made before the fork are reseeded per branch (--no-reseed: not).
      --quiet: one summary line, no tree, progress or Out[n]; --retries K: branch again a
      machine that failed to boot or died (never a cell's own error), up to K times (default 1)
  %%smol episodes N [the fork options but --keep]
      run the cell in N fresh machines of the baseline (not of the active machine's state),
      each deleted afterwards
"""



def parse_argstring(magic_func: Any, argstring: str, command: str = "%smol") -> Any:
    """A magic's options parsed with quotes taken as a shell takes them (IPython's own keeps
    them in the value: `--smolfile "sub dir/Smolfile"` named a file with quotes in it), and
    options and words in any order (`checkpoint save --node root.3 pick` was "unrecognized
    arguments: pick": argparse takes a command's words together, before its first option).
    argparse's complaints are said as one line with the fix, for ``command`` (`%smol use`)."""
    try:
        argv = shlex.split(argstring)
    except ValueError as exc:
        raise UsageError(f"can't read the options {_short(argstring)!r}: {exc} (close the quote)") from None
    parser = magic_func.parser
    out: list[str] = []
    for word in argv:  # `--seeds -5:-3`: argparse takes a value like that for another option
        action = parser._option_string_actions.get(out[-1]) if out else None
        if action is not None and action.nargs is None and word[:1] == "-" and word[1:2].isdigit():
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    try:
        return parser.parse_intermixed_args(out)
    except UsageError as exc:
        raise UsageError(usage_error(parser, command, str(exc))) from None


# What a value looks like, for "needs a value: e.g. ..." (an option not here: its metavar)
EXAMPLES = {"-n": "20", "--max-alive": "8", "--retries": "1", "--seed-base": "0", "--concurrency": "4",
            "--smolfile": "path/Smolfile", "--image": "python:3.12", "--allow": "pypi.org", "--ledger": "path/ledger.db",
            "--push": "data,env", "--pull": "result", "--timeout": "60", "--seeds": "3,7,11", "--out": "result",
            "--node": "root.3", "--keep": "best", "--backend": "sandbox", "--target": "local", "--group-outputs": "branch"}
# A missing word: what it is, an example, and where to find one
NEEDS = {"node": ("a node", "root.3", " (`%smol tree` lists them)"),
         "action": ("an action (save, restore, list, rm or export)", "list", ""),
         "n": ("the number of branches", "16", "")}


def usage_error(parser: Any, command: str, message: str) -> str:
    """argparse's ``message`` about ``command``'s words as one line naming the problem and the fix."""
    options = [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")]
    said = re.fullmatch(r"the following arguments are required: (\w+).*", message)
    if said and said[1] in NEEDS:
        what, example, where = NEEDS[said[1]]
        return f"{command} needs {what}: e.g. `{command} {example}`{where}"
    said = re.fullmatch(r"argument (\S+): invalid choice: '(.*)' \(choose from (.*)\)", message)
    if said:
        name, got, choices = said[1], said[2], re.findall(r"'([^']*)'", said[3])
        close = closest(got, choices)
        if name.startswith("-"):
            example = f"{command} 16" if command.startswith("%%smol ") else command  # fork and episodes need N
            fix = f"did you mean `{name} {close}`?" if close else f"e.g. `{example} {name} {choices[0]}`"
            return f"{name} {got!r} is not one of {', '.join(choices)}: {fix}"
        fix = f"did you mean `{command} {close}`? " if close else ""
        return f"unknown {command} word {got!r}: {fix}one of {', '.join(choices)} (see %smol?)"
    said = re.fullmatch(r"argument (\S+): invalid (\w+) value: '(.*)'", message)
    if said:
        return f"{said[1]} takes a whole number, got {said[3]!r}: e.g. `{command} {said[1]} {_example(parser, said[1])}`"
    said = re.fullmatch(r"argument (\S+): expected one argument", message)
    if said:
        return f"{said[1]} needs a value: e.g. `{command} {said[1]} {_example(parser, said[1])}`"
    said = re.fullmatch(r"argument (\S+): ignored explicit argument '(.*)'", message)
    if said:
        return f"{said[1]} takes no value, got {said[2]!r}: `{command} {said[1]}`"
    said = re.fullmatch(r"ambiguous option: (\S+?)(?:=\S*)? could match (.*)", message)
    if said:
        return f"{said[1]} could be any of {said[2]}: spell the option out (see %smol?)"
    said = re.fullmatch(r"unrecognized arguments: (.*)", message)
    if said:
        word = said[1].split()[0] if said[1].split() else said[1]
        if word.startswith("-"):
            bare = closest(word.split("=", 1)[0].lstrip("-"), [o.lstrip("-") for o in options])  # `--` is alike in all
            close = next((o for o in options if o.lstrip("-") == bare), None)
            fix = f"did you mean {close}?" if close else f"it takes {', '.join(options)} (see %smol?)"
            return f"unknown option {word} for {command}: {fix}"
        return f"{command} got a word too many, {word!r} (a value with spaces goes in quotes; see %smol?)"
    return f"{command}: {message} (see %smol?)"


def _example(parser: Any, option: str) -> str:
    action = parser._option_string_actions.get(option)
    return EXAMPLES.get(option) or str(getattr(action, "metavar", None) or "VALUE")


def out_name(text: str | None) -> str | None:
    """``--out NAME``: a notebook variable to store the ForkResult in."""
    if text is not None and (not text.isidentifier() or keyword.iskeyword(text)):
        raise UsageError(f"--out {text!r} is not a variable name: e.g. --out result")
    return text


def _split_names(text: str | None) -> list[str]:
    if not text:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if not n.isidentifier():
            raise UsageError(f"{n!r} is not a variable name: give names separated by commas, e.g. --push data,env")
    return names


def parse_seeds(text: str, cap: int = gate.limits.MAX_BRANCHES) -> list[int]:
    """``3,7,11`` or ``0:16`` (a range) into a list of seeds, refused above ``cap`` before any is made."""
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            seeds: range | list[int] = range(int(lo), int(hi))
        else:
            parts = text.split(",")
            if len(parts) > cap:
                seeds = range(len(parts))  # only its length matters: refused below
            else:
                seeds = [int(s) for s in parts if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds {text!r} is not a list of whole numbers: use e.g. --seeds 3,7,11 or --seeds 0:16") from None
    if len(seeds) > cap:
        raise UsageError(f"--seeds {_short(text)} gives {len(seeds):,} seeds, above the cap of {cap} branches: "
                         "give fewer (e.g. --seeds 0:16)")
    return list(seeds)


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (IPython hands it to a magic as arguments):
    a ``#`` at the start or after a space, outside quotes."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _timeout(text: str) -> float:
    """``--timeout`` as a positive finite number of seconds (a one-line error otherwise)."""
    try:
        value = gate.seconds(text)
    except SmolbenchError as exc:
        raise UsageError(str(exc)) from None
    assert value is not None
    return value


# -- option bundles (magic_arguments parsers) ----------------------------------------------


@magic_arguments()
@argument("--smolfile", default=None, help="Smolfile to build the machine from (default: ./Smolfile if present)")
@argument("--backend", default="auto", choices=["auto", "smol", "sandbox", "process"], help="where machines run")
@argument("--target", default="local", choices=["local", "cloud"], help="smol backend: local engine or smol cloud")
@argument("--image", default=None, help="override the Smolfile's image")
@argument("--net", nargs="?", const="on", default=None, choices=["on", "off"],
          help="network for this session, overriding the Smolfile: on (the internet, not this host) or off")
@argument("--allow", default=None, help="network allow-list for this session, overriding the Smolfile: hosts and CIDRs, "
          "each optionally with a port, e.g. pypi.org,127.0.0.2/32:8080")
@argument("--ledger", default=None, help="ledger database (default: .smolbench/ledger.db)")
@argument("--max-alive", type=int, default=None, help="kept idle machines alive at once (default: the Smolfile's max_alive, 8)")
@argument("--retries", type=int, default=1, help="boot again this many times when a machine fails for infrastructure reasons")
@argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
          help="run machines on a Ray cluster's nodes (ADDRESS: HOST:PORT or auto; default RAY_ADDRESS, else auto)")
def _up_args(line: str) -> None:
    """%smol up options."""


@magic_arguments()
@argument("--push", default=None, help="notebook variables to send in, comma-separated")
@argument("--pull", default=None, help="machine variables to bring back, comma-separated")
@argument("--pull-trusted", action="store_true", help="also unpickle pulled objects that are not plain data (runs machine code here)")
@argument("--timeout", type=_timeout, default=None, help="interrupt the cell after this many seconds")
def _cell_args(line: str) -> None:
    """%%smol options."""


@magic_arguments()
@argument("n", help="how many branches")
@argument("--seed-base", type=int, default=None, help="seeds are seed-base + 0..N-1 (default 0; not with --seeds)")
@argument("--seeds", default=None, help="explicit seeds: 3,7,11 or 0:16")
@argument("--timeout", type=_timeout, default=None, help="per-branch time limit in seconds")
@argument("--concurrency", type=int, default=None,
          help="how many branches run at once (default 4 per core; 2 per core where each is a boot; a cluster: every slot)")
@argument("--keep", default="best", choices=_args.KEEP_POLICIES, help="which branches stay alive: best, all or none")
@argument("--out", default=None, help="store the ForkResult in this notebook variable")
@argument("--bg", action="store_true", help="return at once; the handle has .wait() (Ctrl-C stops the wait, not the "
          "fork), .done(), .progress, .cancel()")
@argument("--group-outputs", default="order", choices=["order", "branch", "type"], help="how branch output is shown")
@argument("--push", default=None, help="notebook variables to send to every branch")
@argument("--allow-errors", action="store_true", help="don't raise when some branches fail")
@argument("--quiet", action="store_true", help="one summary line: no tree, progress, branch output or Out[n]")
@argument("--retries", type=int, default=1, help="retry a branch whose machine failed to boot or died (never a cell's own error)")
@argument("--no-reseed", action="store_true", help="don't reseed the random.Random / numpy / torch generators the branches inherit")
def _fork_args(line: str) -> None:
    """%%smol fork / episodes options."""


@magic_arguments()
@argument("node", help="node id, e.g. root.7 (`%smol use best`: the last fork's best branch)")
def _node_args(line: str) -> None:
    """A node id."""


@magic_arguments()
@argument("-n", type=int, default=20, help="how many nodes")
def _ledger_args(line: str) -> None:
    """%smol ledger options."""


@magic_arguments()
@argument("action", choices=["save", "restore", "list", "rm", "export", "trust"])
@argument("name", nargs="?", default=None, help="a checkpoint here, or (restore) the path of a .smolcheckpoint file")
@argument("path", nargs="?", default=None, help="export: the file to write (NAME.smolcheckpoint)")
@argument("--node", default=None, help="save this node instead of the active one")
@argument("--force", action="store_true", help="replace a checkpoint (or an exported file) with the same name")
def _checkpoint_args(line: str) -> None:
    """%smol checkpoint options."""
