"""What a script user of ``smolbench.Session`` gets back: all of a run's output (or where the
rest went), errors in the Session's own words, a machine's exceptions caught by their built-in
class, conflicting seed arguments refused, and a root that dies leaving the live set.

The magics say the same things in their own words (checked here too, in a real kernel).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path

import pytest
from nbhelpers import TAG_VAR, NotebookSession, ok, one_line, stream_text, wait_for_no_processes

import smolbench
from smolbench import gate
from smolbench.errors import MachineNotes, RemoteError, SmolbenchError, remote_error
from smolbench.gate.limits import human

HAVE_BWRAP = shutil.which("bwrap") is not None
BACKENDS = [pytest.param("sandbox", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")),
            "process"]

PRINT = "for i in range(1000): print('line %d ' % i + 'x' * 200)"  # ~210 KB
PRINTED = "".join(f"line {i} " + "x" * 200 + "\n" for i in range(1000))
PRINT_ERR = "import sys\nfor i in range(1000): print('err %d ' % i + 'y' * 200, file=sys.stderr)"
PRINTED_ERR = "".join(f"err {i} " + "y" * 200 + "\n" for i in range(1000))


def _split(text: str) -> tuple[str, str]:
    """A stream's shown text and its closing note ("" when nothing was held back)."""
    head, sep, note = text.rpartition("… ")
    return (head, sep + note) if sep and note.endswith(")\n") else (text, "")


# -- 1. output: nothing dropped silently -------------------------------------------------------


def test_run_keeps_all_output_under_the_cells_limit(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        r = s.run(PRINT)
        assert r.stdout == PRINTED and r.stderr == "" and r.output_log is None  # was its last 65,536 characters
        r = s.run(PRINT_ERR)
        assert r.stderr == PRINTED_ERR and r.stdout == "" and r.output_log is None
        f = s.fork(2, PRINT + "\nreward = SEED", keep="none")
        for row in f:  # a branch's row keeps its last 64 KiB: the log has all of it
            _row_keeps_its_tail(row, PRINTED, "only the last {kept} of it kept here")


def test_a_forks_rows_and_tree_keep_a_tail_not_the_whole_shown_output(here: Path) -> None:
    """Each row (and tree node) of a fork lives as long as the session: keeping all a branch
    showed (up to 5 MB) held ~5 GB for 1,024 chatty branches. Session.run keeps it all (one cell)."""
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        f = s.fork(3, PRINT + "\nreward = SEED", keep="none")
        for row in f:
            assert len(row["output"]) <= gate.ROW_KEEP + 200  # was the 210 KB the branch printed
            _row_keeps_its_tail(row, PRINTED, "only the last {kept} of it kept here")
            assert s.workbench.tree[row["branch"]].output == row["output"]
        assert s.run(PRINT).stdout == PRINTED


def _row_keeps_its_tail(row: dict[str, object], printed: str, said: str, limit: int | None = None) -> None:
    """A fork's or episodes' row (and its tree node) keeps the last ``gate.ROW_KEEP`` characters
    of what its branch showed (up to ``limit``), from a line's start, then one line; its log has
    all that the branch printed."""
    output, log = str(row["output"]), str(row["output_log"])
    shown, note = _split(output)
    whole = printed if limit is None else printed.encode()[:limit].decode().rpartition("\n")[0] + "\n"
    assert whole.endswith(shown) and shown.startswith("line ") and 0 < len(shown) <= gate.ROW_KEEP
    assert len(output) <= gate.ROW_KEEP + len(note) and note.count("\n") == 1
    assert note == f"… {said.format(kept=human(len(shown.encode())))} (all of it saved to {os.path.relpath(log)})\n"
    assert Path(log).is_absolute() and Path(log).read_text() == printed


def test_output_past_the_limit_is_saved_and_the_result_says_where(here: Path, output_limit: int) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        r = s.run(PRINT)
        assert r.output_log is not None and Path(r.output_log).is_absolute()
        shown, note = _split(r.stdout)
        log = Path(r.output_log).read_text()
        assert shown + log == PRINTED and shown.endswith("\n") and len(shown.encode()) <= output_limit
        where = os.path.relpath(r.output_log)
        # beside the ledger, in a folder named after it (never the user's own outputs/); .smolbench/outputs/ by default
        assert where == f"ledger.db.outputs/root.cell1-{s.workbench.session}.log"
        assert note == f"… {human(len(log))} more output not shown (saved to {where})\n"  # what %%smol ends with
        assert "…" not in r.stderr

        r = s.run("print('small')\n" + PRINT_ERR)  # only stderr lost some: only stderr says so
        assert r.stdout == "small\n" and r.output_log is not None
        shown, note = _split(r.stderr)
        assert shown + Path(r.output_log).read_text() == PRINTED_ERR and note.startswith("… ")

        f = s.fork(2, PRINT + "\nreward = SEED", keep="none")
        e = s.episodes(1, PRINT + "\nreward = SEED")
        for row in [*f, *e]:
            assert row["output_log"] is not None and row["output_log"] != r.output_log
            hidden = len(PRINTED) - len(PRINTED.encode()[:output_limit].decode().rpartition("\n")[0]) - 1
            _row_keeps_its_tail(row, PRINTED, f"{human(hidden)} more output not shown, and only the last {{kept}} "
                                              "of what was shown kept here", output_limit)


@pytest.mark.parametrize("planted", ["log", "folder", "fifo"])
def test_a_copied_folders_planted_output_log_is_not_written_through(here: Path, output_limit: int, planted: str) -> None:
    """A copied folder's ``.smolbench/outputs/root.cellN.log -> ~/.bashrc`` (or ``outputs`` linking
    to a folder elsewhere, or a fifo there) was truncated and filled with what the machine printed
    past the cell's limit: the log is written only as a plain file in plain folders."""
    outputs = here / ".smolbench" / "outputs"
    outputs.parent.mkdir()
    victim, elsewhere = here.parent / f"{here.name}-bashrc", here.parent / f"{here.name}-elsewhere"
    victim.write_text("export KEEP=1\n")
    elsewhere.mkdir()
    if planted == "folder":
        outputs.symlink_to(elsewhere)
    else:
        outputs.mkdir()
    with smolbench.Session(backend="process") as s:
        # where this session's logs go (names it makes its own: a link planted once it is known)
        names = [f"root.cell{i}-{s.workbench.session}.log" for i in range(1, 10)]
        for name in names if planted != "folder" else ():
            if planted == "log":
                (outputs / name).symlink_to(victim)
            else:
                os.mkfifo(outputs / name)
        r = s.run(PRINT)
    assert victim.read_text() == "export KEEP=1\n" and list(elsewhere.iterdir()) == []
    assert r.output_log is None
    shown, note = _split(r.stdout)
    assert shown and PRINTED.startswith(shown) and len(shown.encode()) <= output_limit  # still shown up to the limit
    assert note.startswith(f"… {human(len(PRINTED) - len(shown))} more output not shown (not saved: ")
    assert note.count("\n") == 1 and ("move the link aside" in note if planted != "fifo" else "not a plain file" in note)
    if planted == "fifo":
        assert all((outputs / n).is_fifo() for n in names)


def test_a_log_linked_after_the_check_or_hard_linked_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check names the link; the opening itself follows none (a link made between the two is
    refused too), and a file with other names is not emptied."""
    from smolbench.gate import output

    victim = tmp_path / "bashrc"
    victim.write_text("export KEEP=1\n")
    outputs = tmp_path / ".smolbench" / "outputs"
    outputs.mkdir(parents=True)
    (outputs / "a.log").symlink_to(victim)
    os.link(victim, outputs / "b.log")
    monkeypatch.setattr(Path, "is_symlink", lambda self: False)  # as if the links came after the check
    for name, why in [("a.log", "is a symbolic link: move the link aside"), ("b.log", "has other names (hard links): move it aside")]:
        budget = output.OutputBudget(outputs / name, limit=10)
        budget.take("stdout", "x" * 100)
        note = budget.finish()
        assert note is not None and note.endswith(f"{why})\n") and budget.saved_to is None
    assert victim.read_text() == "export KEEP=1\n"


# -- 2. errors in the Session's words -----------------------------------------------------------


def test_session_errors_name_the_sessions_arguments_not_the_magics(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        cases = [
            (lambda: s.fork(0, "pass"), "the number of branches must be at least 1, got 0: e.g. `Session.fork(16, code)`"),
            (lambda: s.fork(2.5, "pass"), "the number of branches must be a whole number, got 2.5: e.g. `Session.fork(16, code)`"),
            (lambda: s.episodes(0, "pass"), "the number of branches must be at least 1, got 0: e.g. `Session.episodes(16, code)`"),
            (lambda: s.fork(5000, "pass"),
             "5000 branches is above the cap of 1024: fork fewer, or fork in stages with `Session.use(node)`"),
            (lambda: s.episodes(2000, "pass", seed_base=7),  # not a fork's advice (an audit)
             "2000 episodes is above the cap of 1024 in one run: run 1024, then the next with seed_base=1031"),
            (lambda: s.fork(3, "pass", seeds=[1]),
             "seeds gives 1 seeds for 3 branches: give at least 3 (e.g. seeds=range(3))"),
            (lambda: s.fork(2, "pass", keep="some"), "keep must be one of best, all, none, got 'some'"),
            (lambda: s.fork(2, "pass", timeout=0), "timeout must be a positive number of seconds, got 0: e.g. timeout=30"),
            (lambda: s.run("1", timeout=-1), "timeout must be a positive number of seconds, got -1: e.g. timeout=30"),
            (lambda: s.run("import time; time.sleep(30)", timeout=0.5),
             "the code ran longer than timeout=0.5 s and was interrupted"),
            (lambda: s.use("best"), "no fork with a rewarded branch yet: call `Session.fork(n, code)` first, or name a live "
                                    "node (`Session.status()['live_machines']`)"),
            (lambda: s.run("1", node="root.9"), "unknown node 'root.9': live nodes are root (see `Session.status()['live_machines']`)"),
        ]
        for call, want in cases:
            with pytest.raises(SmolbenchError) as got:
                call()
            assert str(got.value) == want
        assert s.run("1").value == 1  # nothing was claimed by the refused calls

        def broken(branch: str, event: object) -> None:
            raise ValueError("my own bug\nsecond line")

        res = s.fork(2, "print('hi')\nreward = 1", keep="none", on_output=broken, allow_errors=True)
        errors = [row["error"] for row in res.rows.values()]  # the callback's error, not the machine's (an audit)
        assert errors == ["on_output raised ValueError: my own bug (the callback's error; fix it or pass none)"] * 2, errors
        before = gate.limits.snapshot()
        gate.limits.configure("grace", "1")
        try:  # a run that ignores the interrupt: its root is replaced, and the line says so in the Session's words
            with pytest.raises(SmolbenchError) as got:
                s.run("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)", timeout=0.5)
        finally:
            gate.limits.apply(before)
        assert str(got.value) == ("the code ran longer than timeout=0.5 s and ignored the interrupt for 1 s, so machine "
                                  "root was killed: its state is lost; a fresh machine fresh1 from the default spec "
                                  "(no Smolfile) is up and active (its variables start empty)")
        assert s.active == "fresh1" and s.status()["lost"] == ("root: killed: its cell ran longer than its 0.5 s timeout "
                                                               "and ignored the interrupt for 1 s")
    for call in (lambda: s.run("1"), lambda: s.fork(2, "pass"), lambda: s.use("root"), lambda: s.delete("root"),
                 lambda: s.checkpoint_save("x"), lambda: s.ledger()):
        with pytest.raises(SmolbenchError) as got:
            call()
        assert str(got.value) == "no machine is up: call `Session.up()` first (or use the session in a `with` block)"


def test_a_machine_gone_while_idle_says_how_to_go_on_in_the_sessions_words(here: Path) -> None:
    import signal

    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        kept = s.fork(1, "reward = 1", keep="all").kept
        os.kill(s.run("import os; os.getpid()", node=kept[0]).value, signal.SIGKILL)  # its agent, on this host
        with pytest.raises(SmolbenchError) as got:
            s.run("1", node=kept[0])
        said = str(got.value)  # which of these depends on where the agent's end is noticed
        assert "%smol" not in said and "--" not in said and said.startswith((f"machine {kept[0]} died mid-cell: ",
                                                                             f"machine '{kept[0]}' ")), said
        assert said.startswith(f"machine {kept[0]} died") or re.fullmatch(rf"machine '{kept[0]}' (is not answering \(.*\): it may have died; `Session\.down\(\)` and "
                            rf"`Session\.up\(\)`|dropped the connection: it may be out of processes \(pids = \d+\) or "
                            rf"memory; `Session\.delete\('{kept[0]}'\)` or raise the limit in the Smolfile)", said), said


# -- 3. a machine's exceptions -------------------------------------------------------------------


def test_a_machines_exception_is_caught_by_its_builtin_class(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        with pytest.raises(ZeroDivisionError) as zero:  # was smolbench._session.ZeroDivisionError, a RemoteError only
            s.run("1 / 0", check=True)
        assert isinstance(zero.value, RemoteError) and zero.value.ename == "ZeroDivisionError"
        assert str(zero.value) == "division by zero" and "1 / 0" in "".join(zero.value.traceback)
        with pytest.raises(smolbench.RemoteError):
            s.run("1 / 0", check=True)
        first, second = s.run("1 / 0").error, s.run("1 / 0").error
        assert type(first) is type(second) and isinstance(first, ArithmeticError)
        with pytest.raises(KeyError) as key:
            s.run("{}['k']", check=True)
        assert str(key.value) == "'k'"  # the machine's words, not repr()'d again
        with pytest.raises(FileNotFoundError) as missing:
            s.run("open('/nonexistent/x')", check=True)
        assert isinstance(missing.value, OSError) and "No such file" in str(missing.value)
        with pytest.raises(UnicodeDecodeError):  # a built-in whose own constructor takes five arguments
            s.run("b'\\xff'.decode('utf-8')", check=True)
        with pytest.raises(RemoteError) as mine:  # a class of the machine's own: its name, a RemoteError
            s.run("class MyError(ValueError): pass\nraise MyError('mine')", check=True)
        assert type(mine.value).__name__ == "MyError" and not isinstance(mine.value, ValueError)
        assert str(mine.value) == "mine"


FORGED = ["KeyboardInterrupt", "SystemExit", "GeneratorExit", "BaseException", "StopIteration", "StopAsyncIteration",
          "BaseExceptionGroup", "ExceptionGroup", "CancelledError", "Exception", "TimeoutError", "__class__", "object",
          "type", "print"]


def test_a_machine_naming_a_host_control_flow_exception_gets_a_plain_remote_error(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        for name in FORGED:  # a class the machine made with the name it likes
            with pytest.raises(RemoteError) as got:
                s.run(f"raise type({name!r}, (Exception,), {{}})('forged')", check=True)
            assert got.value.ename == name and type(got.value).__name__ == name
            assert type(got.value).__mro__[1:] == (RemoteError, MachineNotes, Exception, BaseException, object), name
        for code in ("import sys; sys.exit(3)", "raise KeyboardInterrupt", "raise GeneratorExit"):
            r = s.run(code)
            assert isinstance(r.error, RemoteError) and isinstance(r.error, Exception), code
            assert not isinstance(r.error, (SystemExit, KeyboardInterrupt, GeneratorExit)), code
        assert s.run("1 + 1").value == 2


@pytest.mark.parametrize("ename", [*FORGED, "os.error", "a b", "", "1x", "ZeroDivisionError\n", "x" * 200])
def test_remote_error_maps_any_name_safely(ename: str) -> None:
    err = remote_error(ename, "boom", ["tb\n"], "root.3")
    assert isinstance(err, RemoteError) and err.ename == ename and str(err) == "boom" and err.node == "root.3"
    assert not isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit, StopIteration, StopAsyncIteration))
    assert type(err).__mro__[-3:] == (Exception, BaseException, object)
    again = type(err)(err.ename, err.evalue, err.traceback)  # how the magics raise it again, without the node
    assert str(again) == "boom" and again.node == ""


def test_remote_error_subclasses_every_builtin_exception_it_can() -> None:
    import builtins

    for name in dir(builtins):
        cls = getattr(builtins, name)
        if not (isinstance(cls, type) and issubclass(cls, Exception)) or name.startswith("_"):
            continue
        err = remote_error(name, "msg", [])
        if name in FORGED:
            assert not isinstance(err, cls) or cls is Exception, name
            continue
        assert isinstance(err, cls) and isinstance(err, RemoteError) and str(err) == "msg", name
        with pytest.raises(cls):
            raise err


# -- 4. seeds and seed_base together ----------------------------------------------------------------


def test_seeds_with_seed_base_is_one_line_naming_the_conflict(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        for call in (lambda: s.fork(2, "reward = SEED", seeds=[3, 4], seed_base=5),
                     lambda: s.fork(2, "reward = SEED", seeds=[3, 4], seed_base=0),
                     lambda: s.episodes(2, "reward = SEED", seeds=[3, 4], seed_base=5)):
            with pytest.raises(SmolbenchError) as got:
                call()
            assert str(got.value).startswith("give seeds or seed_base, not both: seeds= sets every branch's seed, "
                                             "so seed_base=")
            assert str(got.value).endswith("would be ignored; drop one of them")
        assert sorted(s.fork(2, "reward = SEED", seeds=[3, 4]).rewards.values()) == [3.0, 4.0]
        assert sorted(s.fork(2, "reward = SEED", seed_base=5).rewards.values()) == [5.0, 6.0]


# -- 5. a machine that dies -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_root_that_dies_leaves_the_live_set_and_up_starts_a_new_one(here: Path, backend: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)  # the machines' processes carry it
    with smolbench.Session(backend=backend, ledger="ledger.db") as s:
        s.run("x = 1")
        s.episodes(1, "reward = 1")  # on the sandbox: a zygote, outside the live set
        s.fork(2, "reward = SEED", keep="all")
        with pytest.raises(SmolbenchError) as got:
            s.run("import os; os._exit(3)")
        how = ("the cell ended it (its agent exited with status 3, as os._exit(3) does)" if backend == "sandbox" else
               "its process exited before finishing (os._exit, a crash, out of memory, or the machine was deleted)")
        assert str(got.value) == (f"machine root died mid-cell: {how}; its state is gone: `Session.up()` starts "
                                  "a fresh machine (or `Session.checkpoint_restore(name)`)")  # the sandbox knows who
        assert not s.is_up and s.active is None
        st = s.status()
        assert st["up"] is False and st["lost"].startswith("root: machine root died mid-cell"), st
        with pytest.raises(SmolbenchError, match=r"^no machine is up: call `Session.up\(\)` first"):
            s.run("1")
        nodes = smolbench.Ledger("ledger.db").nodes().set_index("id")
        assert nodes.loc["root", "status"] == "lost" and not nodes.loc[["root", "root.0", "root.1"], "alive"].any()
        s.down()  # what was left (its backend, the episodes' zygote) goes too: it used to stay to the end
        assert wait_for_no_processes(tag) == []
        s.up()  # a new root: the session goes on
        assert s.run("x = 2\nx").value == 2 and s.status()["up"] is True and s.status()["lost"] is None
    assert wait_for_no_processes(tag) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_active_branch_that_dies_hands_over_to_its_parent(here: Path, backend: str) -> None:
    with smolbench.Session(backend=backend, ledger="ledger.db") as s:
        s.run("x = 1")
        kept = s.fork(2, "reward = SEED", keep="all").kept
        s.use(kept[0])
        with pytest.raises(SmolbenchError) as got:
            s.run("import os; os._exit(3)")
        assert str(got.value).endswith("its state is gone; the active machine is now root")
        assert s.active == "root" and s.status()["lost"].startswith(f"{kept[0]}: machine {kept[0]} died mid-cell")
        assert kept[0] not in s.status()["live_machines"]
        assert s.run("x + 1").value == 2 and s.run("SEED", node=kept[1]).value == 1


def test_the_magics_say_the_same_in_their_own_words(open_tmp: Path) -> None:
    with NotebookSession(open_tmp, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend process"))
        line = one_line(nb.run("%%smol fork 0\nreward = 1"))
        assert line.endswith("the number of branches must be at least 1, got 0: e.g. `%%smol fork 16`"), line
        line = one_line(nb.run("%%smol --timeout 0.5\nimport time; time.sleep(30)"))
        assert line.endswith("the cell ran longer than --timeout 0.5 s and was interrupted"), line
        line = one_line(nb.run("%%smol\nimport os; os._exit(3)"))
        assert line.endswith("its state is gone: `%smol up` starts a fresh machine (or `%smol checkpoint restore NAME`)")
        status = stream_text(ok(nb.run("%smol status")))
        assert "no machine is up" in status and "root: machine root died mid-cell" in status, status
        ok(nb.run("%smol up --backend process"))
        ok(nb.run("%%smol\nprint(1)"))


def test_a_session_s_checkpoint_says_what_it_could_not_save(here: Path) -> None:
    """`%smol checkpoint save` printed each "not saved (can't be pickled)" warning; a Session's
    save said nothing, and the restore's warning came when it was too late."""
    told: list[str] = []
    with smolbench.Session(backend="process", on_notice=told.append) as s:
        s.run("gen = (i for i in range(3)); x = 5")
        info = s.checkpoint_save("g")
    assert info["warnings"] and "gen" in info["warnings"][0]
    assert [line for line in told if "warning" in line] == [f"smolbench: warning: {info['warnings'][0]}"]


def test_a_composite_error_s_message_carries_no_terminal_escapes_of_the_machine(here: Path) -> None:
    """Outside audit: a branch's ValueError("\\x1b]52;c;…\\x07") reached a script's terminal raw in
    the CompositeError's message (a clipboard write: paste-jacking into a shell)."""
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        with pytest.raises(smolbench.CompositeError) as got:
            s.fork(1, 'raise ValueError("\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x1b]0;PWNED\\x07 \\x9b2J")')
    said = str(got.value)
    assert "ValueError" in said and "\\x1b]52;c;ZWNobyBwd25lZA==" in said, said  # shown, escaped
    assert not any(ch in said for ch in "\x1b\x07\x9b"), repr(said)
    assert not any(ch in str(e) for e in got.value.errors for ch in "\x1b\x07\x9b" if not isinstance(e, RemoteError))


def test_an_agent_that_drops_a_request_as_it_is_sent_says_how_to_go_on(here: Path) -> None:
    """A machine that died between the host's connect and its request (the test above hit it now
    and then): the request's write raised a bare ConnectionResetError out of ``Session.run``.
    Here a socket that accepts and closes at once stands in for that agent, deterministically."""
    import socket
    import threading

    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        wb = s.workbench
        assert wb is not None
        ref = wb.machines[wb.active]
        path = str(here / "dropping.sock")
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen()

        def drop() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = server.accept()
                    conn.close()

        threading.Thread(target=drop, daemon=True).start()
        real, ref.info["socket"] = ref.info["socket"], path
        try:
            with pytest.raises(SmolbenchError) as got:
                s.run("x = 1  # " + "a long request " * 200_000)  # (more than the socket takes at once)
        finally:
            ref.info["socket"] = real
            server.close()
        assert re.fullmatch(rf"machine '{ref.name}' is not answering \(.*\): it may have died; `Session\.down\(\)` "
                            r"and `Session\.up\(\)`", str(got.value)), str(got.value)
        assert s.run("1 + 1").value == 2  # the machine itself is fine
