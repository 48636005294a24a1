"""Packages inside a machine: the Smolfile's (read-only, installed by the host) and a cell's own.

Stdlib only, Python 3.8+ (it runs on the machine's python3). The Smolfile's ``packages`` are
a folder the host installed and mounted read-only; ``pip`` in a machine installs into the
machine's own ``<workdir>/.packages`` (copy-on-write with the workspace, so each branch
keeps its own and a checkpoint carries it). Both go on ``sys.path`` ahead of the
interpreter's site-packages (a pinned version wins), and on ``PYTHONPATH`` for the
processes a cell starts. ``pip`` and ``pip3`` on ``PATH`` are ``python -m pip`` of the
agent's own interpreter (not, say, Debian's ``/usr/bin/pip``, which refuses to install:
externally managed), and ``PIP_TARGET`` sends every install to the machine's folder (an
install into a ``--target`` is not the system's, so pip's externally-managed check does
not apply; ``PIP_BREAK_SYSTEM_PACKAGES`` says so to older pips). In a cell, ``%pip ...``
and ``!pip ...`` lines run that pip, with its output in the cell; like IPython's ``%pip``
they are statements (no ``Out`` value) and a failed pip does not raise. In a machine whose
network policy is off (``SMOLBENCH_NET_POLICY``, which the host sets) pip doesn't retry
(``PIP_RETRIES=0``: no lookup can succeed), and a failed ``%pip`` that asked an index ends
with one line saying why and how to allow it. A failed ``%pip`` that filled the machine's disk
(``[Errno 28]``) ends with one line naming the Smolfile's ``disk`` and ``packages`` (which are
installed on the host and mounted read-only, not on the machine's disk).
"""

import importlib
import os
import re
import sys

TARGET = ".packages"  # in the workdir: what pip in the machine installs into
PYTHON_ENV = "SMOLBENCH_PIP_PYTHON"  # the machine's interpreter, for the shims
SHIMS = ".bin"  # in the target: `pip` and `pip3` as `python -m pip` (not pip's own bin/, which it would skip)
_LINE = re.compile(r"^([ \t]*)[%!](pip3?)(?:[ \t]+(.*))?$")
# pip's commands; those that ask a package index (unless --no-index)
_COMMANDS = frozenset(("install", "download", "uninstall", "freeze", "inspect", "list", "show", "check", "config",
                       "search", "cache", "index", "wheel", "hash", "completion", "debug", "help", "lock"))
_ASK_INDEX = frozenset(("install", "download", "search", "index", "wheel", "lock"))


_DISK_MIB = None  # the machine's disk (the Smolfile's `disk`), where the agent was told it


def setup(packages, workdir, disk_mib=None):
    """Put the Smolfile's packages (``packages``, a read-only folder, or None) and the
    machine's own pip target on sys.path, PYTHONPATH and PATH (``disk_mib``: the machine's
    disk, if known, for the note on a full one)."""
    global _DISK_MIB
    _DISK_MIB = disk_mib
    target = os.path.join(workdir or os.getcwd(), TARGET)
    try:
        os.makedirs(os.path.join(target, SHIMS), exist_ok=True)
        _shims(os.path.join(target, SHIMS))
    except OSError:
        pass  # a read-only workdir: installs fail with pip's own message
    entries = [target] + ([packages] if packages else [])
    at = _site_index()
    sys.path[at:at] = [p for p in entries if p not in sys.path]
    env = os.environ
    env["PYTHONPATH"] = os.pathsep.join(entries + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PATH"] = os.pathsep.join([os.path.join(target, SHIMS), os.path.join(target, "bin"), env.get("PATH", "")])
    env["PIP_TARGET"] = target
    env[PYTHON_ENV] = sys.executable  # what the shims run (not written in them: see _shims)
    env["PIP_BREAK_SYSTEM_PACKAGES"] = "1"  # only ever into PIP_TARGET, the machine's own folder
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    if _network_off():
        env.setdefault("PIP_RETRIES", "0")  # five retries of a lookup that can't succeed: ~8 s of warnings
    return target


def _network_off(policy=None):
    """Whether this machine's network policy (as the host passed it) is off; unknown: not off."""
    policy = os.environ.get("SMOLBENCH_NET_POLICY", "") if policy is None else policy
    return policy.startswith("off")


def offline_note(args, policy=None):
    """The one line a failed ``pip ARGS`` ends with when it asked a package index and this
    machine has no network ('' otherwise: never where the network is on, or unknown)."""
    if not _network_off(policy) or "--no-index" in args:
        return ""
    command = next((a for a in args if a in _COMMANDS), None)
    if command not in _ASK_INDEX:
        return ""
    return ("smolbench: this machine has no network (its network policy is off), so pip can't reach the package "
            "index: allow it with `%smol up --allow pypi.org,files.pythonhosted.org` (or the Smolfile's [network] "
            "allow_hosts), or list the package in the Smolfile's `packages` (installed on the host: the machine "
            "needs no network)\n")


def disk_note(disk_mib=None):
    """The one line a pip that filled the machine's disk (``[Errno 28]``) ends with."""
    size = ("the Smolfile's `disk`, %d MiB here" % disk_mib if disk_mib else
            "on sandbox and smol its size is the Smolfile's `disk`")
    return ("smolbench: pip filled this machine's disk (%s): raise `disk` in the Smolfile, or list the package in "
            "the Smolfile's `packages` (installed on the host and mounted read-only: not on the machine's disk)\n"
            % size)


def _site_index():
    """Where entries ahead of the interpreter's site-packages go (the end if it has none)."""
    for index, entry in enumerate(sys.path):
        if entry.rstrip("/").endswith(("site-packages", "dist-packages")):
            return index
    return len(sys.path)


# pip writes a script's interpreter into its first line (``#!/path/python``, or distlib's
# ``/bin/sh`` form for a long path or one with spaces); under some backends that path is the
# host's (the teacher's home), and the workspace, scripts and all, is saved and exported. So
# after pip each script that names this interpreter finds it when it runs, as the shims do.
# ``run`` runs this source, and the shims run its copy beside them (one source for both).
PORTABLE_SOURCE = r"""
import os, sys

def portable_scripts(folder, executable):
    exe = os.fsencode(executable)
    head = b"#!/bin/sh\n" + b"'" * 3 + b"exec' \"${%s:-python3}\"%%s \"$0\" \"$@\"\n' " + b"'" * 3 + b"\n"
    tail = b' "$0" "$@"'
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > 1 << 20:
                continue
            with open(path, "rb") as fh:
                text = fh.read()
        except OSError:
            continue
        lines = text.split(b"\n", 3)
        found = None
        for quoted in (exe, b'"' + exe + b'"'):
            shebang = b"#!" + quoted
            long_form = b"'" * 3 + b"exec' " + quoted
            if lines[0] == shebang or lines[0].startswith(shebang + b" "):
                found = (lines[0][len(shebang):], text.split(b"\n", 1)[1] if len(lines) > 1 else b"")
            elif (len(lines) > 3 and lines[0] == b"#!/bin/sh" and lines[1].startswith(long_form)
                  and lines[1].endswith(tail) and lines[2] == b"' " + b"'" * 3):
                found = (lines[1][len(long_form):-len(tail)], lines[3])
            if found is not None:
                break
        if found is None:
            continue
        top = head %% found[0]
        first = found[1].split(b"\n", 1)[0]
        if first.lstrip().startswith(b"#") and (b"coding:" in first or b"coding=" in first):
            top = top.replace(b"\n", b"\n" + first + b"\n", 1)  # Python reads it on line 1 or 2 only
        new = path + ".portable"
        try:  # never through a link planted at the new name
            fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(top + found[1])
                os.fchmod(fh.fileno(), os.stat(path).st_mode & 0o7777)
            os.replace(new, path)
        except OSError:
            try:
                os.unlink(new)
            except OSError:
                pass
""" % PYTHON_ENV
PORTABLE_FILE = "portable_scripts.py"  # beside the shims, not executable: no command on PATH
_portable: dict = {}
exec(PORTABLE_SOURCE, _portable)
portable_scripts = _portable["portable_scripts"]


def _shims(folder):
    fixer = PORTABLE_SOURCE + "\nportable_scripts(os.path.join(sys.argv[1], 'bin'), sys.executable)\n"
    files = {PORTABLE_FILE: (fixer, 0o644)}
    # the interpreter is found when the shim runs, never written into it: the workspace is
    # saved and exported, and this path is the host's (the teacher's home) under some backends
    for name in ("pip", "pip3"):
        files[name] = ("#!/bin/sh\npy=\"${%s:-python3}\"\n\"$py\" -m pip \"$@\"\nstatus=$?\n"
                       "\"$py\" \"$(dirname \"$0\")/%s\" \"$(dirname \"$(dirname \"$0\")\")\" 2>/dev/null\n"
                       "exit $status\n" % (PYTHON_ENV, PORTABLE_FILE), 0o755)
    for name, (body, mode) in files.items():
        path = os.path.join(folder, name)
        try:
            with open(path) as fh:
                if fh.read() == body:
                    continue
        except OSError:
            pass
        with open(path, "w") as fh:
            fh.write(body)
        os.chmod(path, mode)


def _quote(text):
    """``text`` as one word for sh (``shlex.quote``'s rule, without importing shlex at start-up)."""
    if text and all(c.isalnum() or c in "@%+=:,./-_" for c in text) and text.isascii():
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def run(args, out=None, err=None):
    """``python -m pip ARGS`` of this interpreter, its output written to ``out``/``err``
    (the cell's streams); returns pip's exit code. New packages import at once."""
    import subprocess

    out = out or sys.stdout
    proc = subprocess.Popen([sys.executable, "-m", "pip"] + list(args), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    full = False
    try:
        for line in iter(proc.stdout.readline, b""):
            text = line.decode("utf-8", "replace")
            full = full or "[Errno 28]" in text or "No space left on device" in text
            out.write(text)
    finally:
        proc.stdout.close()
        code = proc.wait()
    importlib.invalidate_caches()
    portable_scripts(os.path.join(os.environ.get("PIP_TARGET") or TARGET, "bin"), sys.executable)
    if code != 0:
        note = disk_note(_DISK_MIB) if full else offline_note(args)
        (err or sys.stderr).write("pip exited with status %d\n" % code + note)
    return code


def transform(code, filename="<cell>"):
    """A cell's ``%pip ...`` / ``!pip ...`` lines as calls of ``smolbench_guest._pip_line``
    (same line numbers), which gives no value: as IPython's, a last ``%pip`` line is no ``Out``.
    A line with ``{expr}`` or ``$name`` in it is filled in when it runs, from the cell's
    variables, as IPython does (``smolbench_guest._pip_text``). pip runs with no shell, so a
    shell operator outside quotes (``|``, ``>``, ``&&``, ``;`` ...) is a SyntaxError naming it
    (IPython would hand the line to sh); a ``<``/``>`` inside a word (``numpy<2``) is pip's."""
    if "pip" not in code:
        return code
    lines = code.split("\n")
    for number, line in enumerate(lines):
        match = _LINE.match(line)
        if match:
            indent, rest = match.group(1), match.group(3) or ""
            import shlex

            at = shell_operator(rest)
            if at >= 0:
                column = match.start(3) + at
                raise SyntaxError(_refusal(line[len(indent)] + match.group(2), rest, at),
                                  (filename, number + 1, column + 1, line))
            try:
                args = shlex.split(rest, comments=True)
            except ValueError:
                continue  # left as it is: the cell's syntax error says where
            if any("{" in a or "$" in a for a in args):
                lines[number] = "%ssmolbench_guest._pip_text(%r)" % (indent, rest)
            else:
                lines[number] = "%ssmolbench_guest._pip_line(*%r)" % (indent, args)
    return "\n".join(lines)


def shell_operator(text):
    """Where a shell operator (``|``, ``&``, ``;``, a backtick, ``$(``, or a ``<``/``>`` that
    starts a word, with its fd: ``2>``) starts in ``text`` outside quotes, as sh reads it; -1
    if none (a ``#`` outside quotes ends the line: shlex's comment)."""
    quote = None
    word = 0  # where the current word starts
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"':
                i += 1
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == "#":
            return -1
        elif c in " \t":
            word = i + 1
        elif c in "|&;`" or (c == "$" and text[i + 1:i + 2] == "("):
            return word if c == "&" and text[word:i].rstrip("<>").isdigit() else i
        elif c in "<>" and (i == word or text[word:i].isdigit()):
            return word
        i += 1
    return -1


def _refusal(magic, rest, at):
    """The one line refusing ``magic rest`` (shell syntax at ``at``): what to drop, or the quotes it needs."""
    tail = rest[at:].strip()
    head = "`%s` lines run pip, not a shell: " % magic
    spec = re.match(r"([<>]=?|[=!~]=)\s*([0-9][^\s]*)", tail)
    before = rest[:at].split()
    if spec and before and not before[-1].startswith("-") and before[-1] not in _COMMANDS:
        return head + 'put the requirement in quotes, `%s install "%s%s%s"`' % (magic, before[-1], spec.group(1),
                                                                                 spec.group(2))
    return head + "drop `%s`, or run it with `subprocess.run(..., shell=True)`" % tail


# IPython's ``$name`` (not inside single quotes; ``$$`` is a literal ``$``): DollarFormatter's pattern
_DOLLAR = re.compile(r"(.*?)\$(\$?[\w.]+)(?=([^']*'[^']*')*[^']*$)")


def expand(text, ns):
    """``text`` with ``{expr}`` and ``$name`` filled in from ``ns``, as IPython's ``var_expand``
    does for ``!`` and ``%`` lines (``{{``/``}}`` and ``$$`` are literal; a ``$NAME`` that is no
    variable but an environment variable is the environment's, as sh would fill it in).
    Returns the text, or raises ValueError with one line naming the field and the fix."""
    import string

    out = []
    try:
        chunks = list(string.Formatter().parse(text))
    except ValueError as err:
        raise ValueError("its braces don't pair (%s): write `{{` and `}}` for literal braces" % err) from None
    for literal, field, spec, conversion in chunks:
        done = 0
        for found in _DOLLAR.finditer(literal):
            out.append(found.group(1))
            name = found.group(2)
            if name.startswith("$"):
                out.append(name)
            else:
                out.append(_value(name, ns, "$" + name))
            done = found.end(2)
        out.append(literal[done:])
        if field is not None:
            source = field + (":" + spec if spec else "")  # IPython's: `{a[1:2]}` is a slice, not a spec
            shown = "{%s%s}" % (source, "!" + conversion if conversion else "")
            value = _value(source, ns, shown, raw=True)
            if conversion == "r":
                value = repr(value)
            elif conversion == "a":
                value = ascii(value)
            out.append(str(value))
    return "".join(out)


def _value(source, ns, shown, raw=False):
    try:
        value = eval(source, dict(ns))
    except Exception as err:  # noqa: BLE001 - any error of the user's expression is reported
        if isinstance(err, NameError) and shown.startswith("$") and source in os.environ:
            return os.environ[source]  # IPython would leave it to sh, which fills in the environment's
        raise ValueError("`%s` could not be filled in (%s: %s): define it before this line, or write `%s` "
                         "for the literal text" % (shown, type(err).__name__, err,
                                                   "$" + shown if shown.startswith("$") else
                                                   "{" + shown + "}")) from None
    return value if raw else str(value)
