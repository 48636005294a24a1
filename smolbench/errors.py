"""Errors a user sees: one line naming the problem and the fix."""

from __future__ import annotations

import builtins
import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast


class SmolbenchError(Exception):
    """A problem the user can fix; its message is one line that says how.

    IPython shows it without a traceback (see ``magics``), because the
    traceback of our own layers never helps the user.

    A fix is said in the words of whoever called: the message is the magics' (``--timeout``,
    ``%smol up``); ``api``, when given, is the same line in :class:`smolbench.Session`'s words
    (``timeout=``, ``Session.up()``). The Session switches to it (:meth:`in_session_words`) as
    the error leaves it; the magics show :attr:`magic_words` whatever layer raised it.
    """

    def __init__(self, *args: object, api: str | None = None) -> None:
        super().__init__(*args)
        self.api = api
        self.magic_words = str(args[0]) if len(args) == 1 else super().__str__()

    def in_session_words(self) -> SmolbenchError:
        """This error, its message now in the Session's words: ``api`` when it has them, else the
        magic phrases a layer below the Session wrote (:func:`session_phrases`) said as calls."""
        if self.api is not None:
            self.args = (session_phrases(self.api),)
        elif len(self.args) == 1 and isinstance(self.args[0], str):
            self.args = (session_phrases(self.args[0]),)
        return self

    def for_magics(self) -> str:
        """The message in the magics' words."""
        return self.magic_words

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


# The magic phrases the gate and the backends write into a line that knows no caller, and the
# Session's words for them: each a call of the same thing (the magics show the line as written).
_COMMANDS = (  # `%smol WORDS` (ARG: the word in its place) and the Session's call
    (r"up", "Session.up()"),
    (r"up --backend (\w+)", "Session(backend='{0}').up()"),
    (r"up --smolfile (\S+)", "Session(smolfile='{0}').up()"),
    (r"up --net off", "Session(net='off').up()"),
    (r"up --ray (\S+)", "Session(ray='{0}').up()"),
    (r"down", "Session.down()"),
    (r"status", "Session.status()"),
    (r"trust on", "Session.workbench.set_trust(True)"),  # the Session has no switch of its own
    (r"trust off", "Session.workbench.set_trust(False)"),
    (r"tree", "Session.status()['live_machines']"),
    (r"use(?: \S+)?", "Session.use(node)"),
    (r"delete(?: \S+)?", "Session.delete(node)"),
    (r"replay(?: \S+)?", "Session.replay(node)"),
    (r"checkpoint save(?: \S+)?", "Session.checkpoint_save(name)"),
    (r"checkpoint restore", "Session.checkpoint_restore(name)"),
    (r"checkpoint restore (\S+)", "Session.checkpoint_restore('{0}')"),
    (r"checkpoint restore '([^']+)'", "Session.checkpoint_restore('{0}')"),  # a path with spaces, quoted
    (r"checkpoint rm", "Session.checkpoint_rm(name)"),
    (r"checkpoint rm (\S+)", "Session.checkpoint_rm('{0}')"),
    (r"checkpoint list", "Session.checkpoints()"),
    (r"checkpoint trust (\S+)", "Session.checkpoint_trust('{0}')"),
    (r"checkpoint export ([A-Z]+) ([A-Z]+)", "Session.checkpoint_export(name, path)"),
    (r"checkpoint export (\S+) (\S+)", "Session.checkpoint_export('{0}', '{1}')"),
    (r"config ([a-z-]+) ([A-Z]+)", "smolbench.gate.limits.configure('{0}', {1})"),  # a placeholder: SIZE, N
    (r"config ([a-z-]+) (\S+)", "smolbench.gate.limits.configure('{0}', '{1}')"),
)
_COMMAND = re.compile(r"`%smol ([^`]*)`")
_PHRASES = (  # options the gate and the backends name (before the commands: these name some)
    # a pull the gate refused: options the Session has no twin of
    (re.compile(r", or use --pull-trusted \(or `%smol trust on`\) to unpickle it anyway"), ""),
    (re.compile(r" \(no --pull-trusted\)"), ""),
    (re.compile(r"--pull ([A-Za-z_]\w*)"), r"pull=['\1']"),
    (re.compile(r"`--backend (\w+)`"), r"`Session(backend='\1')`"),  # no bubblewrap: the sandbox's fix
    (re.compile(r"with --ledger PATH"), r"with `Session(ledger=PATH)`"),  # a ledger locked or not one
    # a script has no notebook: a relative path is the working directory's
    (re.compile(r"relative to this notebook's folder"), lambda m: f"relative to the working directory, {os.getcwd()}"),
)


def _call(match: re.Match[str]) -> str:
    for words, call in _COMMANDS:
        said = re.fullmatch(words, match[1])
        if said:
            return f"`{call.format(*said.groups())}`"
    return match[0]  # a command the Session has no call for stays as it is


def session_phrases(text: str) -> str:
    """``text`` with the magic commands (:data:`_COMMANDS`) and phrases it names in the Session's words."""
    if "-" not in text and "%" not in text and "notebook's" not in text:
        return text
    for pattern, said in _PHRASES:
        text = pattern.sub(said, text)
    return _COMMAND.sub(_call, text)


def session_notes(on_output: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    """``on_output`` (a fork's ``(branch, event)``), hearing the host's own notes on the output
    (``event.note``: "`%smol config displays N` raises the limit") in the Session's words; the
    machine's output is never reworded."""
    def heard(branch: str, event: Any) -> None:
        if getattr(event, "note", False):
            event = dataclasses.replace(event, text=session_phrases(event.text))
        on_output(branch, event)

    return heard


# The Session's words for what the magics say with `%smol up` and `%smol tree` (``api=``).
NOT_UP = "no machine is up: call `Session.up()` first (or use the session in a `with` block)"
LIVE = "`Session.status()['live_machines']`"


class SmolfileError(SmolbenchError):
    """A Smolfile that cannot be used."""


class BackendUnavailable(SmolbenchError):
    """The chosen backend cannot run on this host."""


class InfraError(SmolbenchError):
    """A machine failed to boot or died for reasons of the infrastructure, not of the user's code.

    Fan-outs and ``%smol up`` retry these (``--retries``); a cell's own exception never is one.
    """


class MachineLost(SmolbenchError):
    """The machine died under a request (it exited, crashed, or the kernel killed it for
    memory): its state is gone."""


class MachineDied(MachineLost):
    """The machine's process ended under a cell, and not for memory nor by its own hand (killed
    from outside, or how it ended is unknown): fork and episodes retry it as an InfraError. A
    cell that ends its machine (``os._exit``) is a MachineLost, and a cell's exception comes
    back as a result: neither is retried."""


class MachineBusy(SmolbenchError):
    """The machine is already running a cell."""


class NoAnswerInTime(SmolbenchError):
    """A request (on a kept connection, or a gym env's cell) had no answer within its timeout:
    a connection is cut (what the machine does with the request is unknown, so its user
    deletes the machine)."""

    @classmethod
    def after(cls, machine: str, timeout: float) -> NoAnswerInTime:
        """Its one line for ``machine``'s request unanswered after ``timeout`` s (both kinds say it here)."""
        return cls(f"machine {machine} sent no answer within {timeout:g} s")


class MachineNotes:
    """An exception that carries a machine's traceback in its ``__notes__``, so Python's own
    printer (a script's uncaught error, pytest, ``traceback.print_exc()``, logging) shows it
    after the host's frames: plain text (:func:`~smolbench.gate.terminal.printable`: no
    colour, nothing a terminal acts on). IPython shows ``_render_traceback_`` instead, and no
    notes. Made when first read (a fork's every failed branch has one, rarely printed); a note
    the program adds (``add_note``) goes after it."""

    def _machine_note(self) -> str:
        raise NotImplementedError

    @property
    def __notes__(self) -> list[str]:
        notes = self.__dict__.get("_notes")
        if notes is None:
            from .gate.terminal import printable

            note = self._machine_note()
            notes = self.__dict__["_notes"] = [printable(note)] if note else []
        return notes

    @__notes__.setter
    def __notes__(self, notes: list[str]) -> None:
        self.__dict__["_notes"] = notes

    @__notes__.deleter
    def __notes__(self) -> None:
        self.__dict__["_notes"] = []


class RemoteError(MachineNotes, Exception):
    """An exception raised by user code inside a machine.

    Rendered in the notebook like a local exception, with the remote
    traceback pointing at the cell's own lines. Made by :func:`remote_error`: a class named
    after the machine's exception, which also subclasses the built-in of that name
    (``except ZeroDivisionError`` catches it), unless the name is not a built-in ``Exception``
    or is one that steers the host's own control flow (see :data:`NOT_AS_BUILTIN`).
    """

    def __new__(cls, ename: str = "", evalue: str = "", traceback: Sequence[str] = (), node: str = "",
                *args: Any) -> RemoteError:
        # the __new__ of the built-in whose layout the class has (BaseException's but for OSError),
        # which sees the message only: OSError's reads an errno from a second argument
        made: Any = cls
        while made.__module__ != "builtins":
            made = made.__base__
        return cast(RemoteError, made.__new__(cls, evalue))

    def __init__(self, ename: str, evalue: str, traceback: Sequence[str], node: str = "") -> None:
        # not the built-in's own __init__: UnicodeDecodeError's wants 5 arguments, the machine sent a line
        BaseException.__init__(self, evalue)
        self.ename = ename
        self.evalue = evalue
        self.traceback = list(traceback)
        self.node = node

    def __str__(self) -> str:
        # the machine's words (KeyError's own __str__ would repr() them again), as plain text:
        # Python's printer, print(e) and logging write them to a terminal, where an escape
        # would set the title, write the clipboard (OSC 52) or clear the screen. The notebook
        # shows render(), its colours kept (ansi_up acts on nothing else).
        if self.evalue.isprintable() and "\x1b" not in self.evalue:
            return self.evalue
        from .gate.terminal import printable

        return printable(self.evalue)

    def __reduce__(self) -> tuple[Any, ...]:
        return remote_error, (self.ename, self.evalue, self.traceback, self.node)

    def render(self) -> list[str]:
        """The remote traceback as display lines (with ANSI colour)."""
        head = f"[{self.node}] " if self.node else ""
        if not self.traceback:  # no frames (e.g. `--pull x` of a name the machine lacks): the line alone
            return [f"\x1b[0;31m{head}{self.ename}\x1b[0m: {self.evalue}"]
        unparsed = _UNPARSED.fullmatch("".join(self.traceback))
        if unparsed and issubclass(AS_BUILTIN.get(self.ename, Exception), SyntaxError):
            # the cell didn't compile: its line and caret, as a local cell's (no "Traceback", no frames)
            source = unparsed["source"].strip()
            evalue = self.evalue.removesuffix(f" ({unparsed['file']}, line {unparsed['line']})")
            if source[:1] == "!" and not re.match(r"!pip\b", source):
                evalue = _shell_escape_advice(source[1:].strip())
            elif source[:1] == "%" and not re.match(r"%pip\b", source):
                evalue = "IPython magics other than %pip don't run in a machine cell: run it in a local cell"
            return [*(f"{head}{line}" if i == 0 else line for i, line in enumerate(unparsed[0].rstrip("\n").split("\n"))),
                    f"\x1b[0;31m{self.ename}\x1b[0m: {evalue}"]
        lines = [f"\x1b[0;31m{head}Traceback (most recent call last) inside the machine:\x1b[0m"]
        for chunk in self.traceback:
            lines.extend(chunk.rstrip("\n").split("\n"))
        lines.append(f"\x1b[0;31m{self.ename}\x1b[0m: {self.evalue}")
        return lines

    def _render_traceback_(self) -> list[str]:
        return self.render()

    def _machine_note(self) -> str:
        return "\n".join(self.render()) if self.traceback else ""  # (no frames: the message says it all)


# `!{sys.executable} -m pip ARGS` (or python3 / $sys.executable): the machine's %pip is that pip
_PYTHON_PIP = re.compile(r"(?:\{sys\.executable\}|\$sys\.executable|\S*python[0-9.]*)\s+-m\s+pip\b(?P<args>.*)")


def _shell_escape_advice(command: str) -> str:
    """What a machine cell's ``!COMMAND`` line (not ``!pip``) should be instead, in one line."""
    pip = _PYTHON_PIP.fullmatch(command)
    if pip:
        return ("shell escapes other than !pip don't run in a machine cell: write "
                f"`%pip{pip['args'].rstrip()}` (it runs pip of the machine's own Python)")
    if "{" in command or "$" in command:  # IPython's {expr} / $name: an f-string fills them in
        filled = re.sub(r"(?<!\$)\$([A-Za-z_][\w.]*)", r"{\1}", command).replace("$$", "$")
        code = f"f{filled!r}"
    else:
        code = repr(command)
    return ("shell escapes other than !pip don't run in a machine cell: use "
            f"`import subprocess; subprocess.run({code}, shell=True)` instead")


# A cell that didn't compile: its one frame without a function, its line and (maybe) a caret
_UNPARSED = re.compile(r'  File "(?P<file>[^"\n]*)", line (?P<line>\d+)\n(?P<source>[^\n]*)\n(?: *\^+ *\n)?')


def shown_by_ipython(err: RemoteError) -> RemoteError:
    """``err`` as the magics raise it: IPython shows any ``SyntaxError`` with its own printer
    (the host's frames, the magics' line, no source line or caret), whatever it renders itself;
    so a syntax error of the cell is a RemoteError of that name that is no built-in SyntaxError."""
    if not isinstance(err, SyntaxError):
        return err
    return type(err.ename, (RemoteError,), {})(err.ename, err.evalue, err.traceback, err.node)


# Built-in exceptions a machine's error is never made an instance of, though they are Exceptions:
# a StopIteration out of ``run()`` would silently end the caller's loop in a generator or
# ``__next__``; exception groups are taken apart by ``except*`` and need their sub-exceptions.
# TimeoutError is the host's own word for "no answer in time" (asyncio's and concurrent.futures'
# since Python 3.11): an env that raised one passed for a request that timed out, and serve
# deleted its machine and told the client its request took too long.
# Names outside ``Exception`` (SystemExit, KeyboardInterrupt, GeneratorExit, BaseException,
# BaseExceptionGroup) are never built-ins here either: a machine must not stop the host.
NOT_AS_BUILTIN = frozenset({"Exception", "StopIteration", "StopAsyncIteration", "ExceptionGroup", "TimeoutError"})
AS_BUILTIN: dict[str, type[Exception]] = {
    name: cls for name, cls in vars(builtins).items()
    if not name.startswith("_") and isinstance(cls, type) and issubclass(cls, Exception)
    and cls.__module__ == "builtins" and name not in NOT_AS_BUILTIN
}  # taken when smolbench is imported: a name a program adds to builtins later is not one
_TWINS: dict[str, type[RemoteError]] = {}  # one class per built-in name (so `type(a) is type(b)`)


def remote_error(ename: str, evalue: str, traceback: Sequence[str], node: str = "") -> RemoteError:
    """The RemoteError for an exception a machine reported, its class named after it (so
    Jupyter shows ``ZeroDivisionError``, not ``RemoteError``). ``ename`` is the machine's
    word, so only the name is used: a built-in Exception's class is looked up in
    :data:`AS_BUILTIN` and subclassed; anything else (a class of the machine's own,
    ``KeyboardInterrupt``, ``SystemExit``, a name that is no identifier) is a plain RemoteError."""
    base = AS_BUILTIN.get(ename)
    if base is None:
        cls = type(ename if ename.isidentifier() else "RemoteError", (RemoteError,), {})
    else:
        cls = _TWINS.get(ename) or _TWINS.setdefault(ename, type(ename, (RemoteError, base), {}))
    return cls(ename, evalue, traceback, node)


class CompositeError(MachineNotes, Exception):
    """Several branches failed; shows the first few remote tracebacks.

    Like ipyparallel's ``CompositeError``: one failing branch never hides the
    others, and the full list is in ``.errors``. ``.result`` is the fork's (or the
    episodes') ForkResult, every branch's row: the rewards of those that finished ok too
    (``e.result.rewards``, ``e.result.best``). Identical errors (the same exception,
    message and traceback but for the branch's own name) are shown once, naming their
    branches: "the same error in 4 episodes: ...".
    """

    shown = 4  # distinct errors shown
    named = 8  # branches named for one of them

    def __init__(self, message: str, errors: Sequence[RemoteError | Any], unit: str = "branches",
                 result: Any = None) -> None:
        super().__init__(message)
        self.errors = list(errors)
        self.unit = unit
        self.result = result  # the ForkResult it came from (None: made by hand)

    def __reduce__(self) -> tuple[Any, ...]:  # its own arguments (a Ray task's error travels pickled)
        return type(self), (str(self), self.errors, self.unit, self.result)

    def groups(self) -> list[list[RemoteError | Any]]:
        """The errors, identical ones together, in the order they first appear."""
        out: dict[tuple[str, ...], list[RemoteError | Any]] = {}
        for err in self.errors:
            out.setdefault(_same(err), []).append(err)
        return list(out.values())

    def _names(self, errors: Sequence[RemoteError | Any]) -> str:
        names = [_node_of(e) for e in errors]
        more = len(names) - self.named
        return ", ".join(names[: self.named]) + (f" and {more} more" if more > 0 else "")

    def _render_traceback_(self) -> list[str]:
        lines = [f"\x1b[0;31mCompositeError\x1b[0m: {self}"]
        groups = self.groups()
        for group in groups[: self.shown]:
            if len(group) > 1:
                lines.append(f"the same error in {len(group)} {self.unit}: {self._names(group)}")
            first = group[0]
            lines.extend(first.render() if isinstance(first, RemoteError) else [str(first)])
            lines.append("")
        rest = [err for group in groups[self.shown:] for err in group]
        if rest:
            lines.append(f"... {len(rest)} more ({self._names(rest)})")
        return lines

    def _machine_note(self) -> str:
        return "\n".join(self._render_traceback_()[1:]).rstrip("\n")  # (the first: its message, printed above)


_NODE = re.compile(r"^\[([^\]]*)\] ")


def _node_of(err: RemoteError | Any) -> str:
    if isinstance(err, RemoteError):
        return err.node
    match = _NODE.match(str(err))
    return match.group(1) if match else "?"


def _same(err: RemoteError | Any) -> tuple[str, ...]:
    """What makes two branches' errors the same one: all of it but the branch's own name (its
    cell's file name, ``<In [3]@root.2>``, and the ``[root.2]`` a line starts with)."""
    if isinstance(err, RemoteError):
        own = f"@{err.node}>"
        return (err.ename, err.evalue, *(chunk.replace(own, "@>") for chunk in err.traceback))
    return ("", _NODE.sub("", str(err), count=1))


E = TypeVar("E", bound=BaseException)


def reworded(exc: E, text: str) -> E:
    """``exc`` again, as its own type and with its attributes, saying ``text`` (raised ``from
    None``: no traceback of our layers). Its constructor is not called: some take more than a
    message (``UnsafeLedger(where, what)``), and calling it with one became a TypeError."""
    new = type(exc).__new__(type(exc), text)
    new.__dict__.update(exc.__dict__)
    if isinstance(new, SmolbenchError):  # its other wordings said the old text
        new.magic_words, new.api = text, None
    return new
