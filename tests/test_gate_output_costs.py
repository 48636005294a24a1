"""What a cell's reply costs the host stays within the cell's output (round 4's own audit).

The cell's output budget (``output-limit``) bounds its streams and displays, but some of what
a machine sends was outside it: the host's own note for each MIME type it didn't show (2,000
displays of 64 made-up types: 17 MB of notes), an error's traceback (1,000 lines of 64 KiB: 64
MB a branch), the cell's result (Out[], cleaned on the loop by the byte: 2 MB of markdown held it
9 s), markdown rendered on the loop at any size and in any number of displays, text metrics kept whole for every node, and
an error's name, which goes inside the host's own lines, with its control characters.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from smolbench import gate
from smolbench.backends.base import CellRequest, Event
from smolbench.gate.output import CLEARS, OutputBudget


def run(*messages: dict[str, Any], limit: int = 100_000) -> tuple[Any, list[Event]]:
    events: list[Event] = []

    async def chunks() -> AsyncIterator[bytes]:
        for m in messages:
            yield json.dumps(m).encode() + b"\n"

    request = CellRequest("x", output=OutputBudget(None, limit=limit))
    res = asyncio.run(gate.read_cell(chunks(), request, events.append, "root.1", scope="t"))
    return res, events


def notes(events: list[Event]) -> list[str]:
    return [e.text for e in events if e.kind == "stream" and e.name == "stderr" and "smolbench:" in (e.text or "")]


def test_notes_about_output_not_shown_are_a_few_however_many_types_come() -> None:
    shown = [{"t": "display", "data": {f"application/x-made-up-{i}-{j}": "x" for j in range(64)}} for i in range(50)]
    _, events = run(*shown, {"t": "done", "status": "ok"})
    said = notes(events)
    assert len(said) == gate.NOTES + 1 and "sent output of more types, which were not shown either" in said[-1]


def test_a_traceback_keeps_its_end_within_its_limit() -> None:
    tb = [f"line {i}: " + "x" * 60_000 + "\n" for i in range(1000)]
    res, _ = run({"t": "done", "status": "error", "error": {"ename": "E", "evalue": "v", "traceback": tb}})
    kept = res.error["traceback"]
    assert sum(map(len, kept)) <= gate.TRACEBACK + 200 and kept[-1] == tb[-1]
    assert kept[0].startswith("... (") and "earlier lines of the traceback not shown" in kept[0]


def test_the_result_counts_against_the_cells_output_and_long_markdown_is_not_rendered() -> None:
    big = {"text/markdown": "# title\n" + "word " * 60_000, "text/plain": "a plain copy"}
    res, events = run({"t": "done", "status": "ok", "result": big}, limit=100_000)
    assert res.result is None and any("result was not shown: the cell's output passed its limit" in n
                                      for n in notes(events))
    res, _ = run({"t": "done", "status": "ok", "result": big}, limit=10_000_000)  # fits: shown, markdown as text
    assert res.result == {"text/plain": "a plain copy"}
    res, _ = run({"t": "done", "status": "ok", "result": {"text/markdown": "**hi**"}})
    assert "<strong>hi</strong>" in res.result["text/html"]


def test_a_cells_markdown_is_rendered_up_to_one_allowance_in_all() -> None:
    """Markdown is rendered on the kernel's loop: the limit is the cell's, not each display's,
    or 20 displays of just under the limit (and 256 branches of them) rendered it all."""
    piece = "| a | b |\n|---|---|\n| *x* | ~~y~~ |\n\n" + ("a line of words " * 60 + "\n\n") * 150  # ~150 KB
    shown = [{"t": "display", "data": {"text/markdown": piece, "text/plain": f"plain {i}"}} for i in range(20)]
    _, events = run(*shown, {"t": "done", "status": "ok", "result": {"text/markdown": "**hi**"}}, limit=10_000_000)
    bundles = [e.data for e in events if e.kind == "display"]
    assert len(bundles) == 20
    assert "<td><em>x</em></td>" in bundles[0]["text/html"] and "<del>y</del>" in bundles[0]["text/html"]
    assert all(b == {"text/plain": f"plain {i}"} for i, b in enumerate(bundles[1:], 1))
    # the next cell has an allowance of its own
    res, _ = run({"t": "done", "status": "ok", "result": {"text/markdown": "**hi**"}})
    assert "<strong>hi</strong>" in res.result["text/html"]


def test_a_big_message_is_checked_off_the_loop_and_its_events_come_out_on_the_loop_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking a message costs by the byte (a branch's 5 MB of styled HTML is seconds of
    cleaning), and the event loop serves every other machine and Ctrl-C: a big message is
    checked on the gate's own threads; a small one stays on the loop (no thread hop for the
    usual cell). What the cell shows still comes out on the loop, in the order it was sent."""
    import threading

    from smolbench.gate import display

    cleaned_on: list[int] = []
    real = display.bundle

    def bundle(*args: Any, **kw: Any) -> Any:
        cleaned_on.append(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr(display, "bundle", bundle)
    big_html = ('<p style="color: red">' + "x" * 1000 + "</p>") * 1000  # ~1 MB
    seen: list[tuple[str, str, int]] = []

    async def main() -> tuple[int, Any]:
        async def chunks() -> AsyncIterator[bytes]:
            for m in ({"t": "display", "data": {"text/html": "<b>small</b>"}},
                      {"t": "display", "data": {"text/html": big_html, "application/x-made-up": "x"}},
                      {"t": "stream", "name": "stdout", "text": "after\n" * 20_000},
                      {"t": "done", "status": "ok", "result": {"text/html": big_html}}):
                yield json.dumps(m).encode() + b"\n"

        def on_event(ev: Event) -> None:
            seen.append((ev.kind, ev.text if ev.kind == "stream" else str(ev.data)[:200], threading.get_ident()))

        request = CellRequest("x", output=OutputBudget(None, limit=10_000_000))
        res = await gate.read_cell(chunks(), request, on_event, "root.1", scope="t")
        return threading.get_ident(), res

    loop_thread, res = asyncio.run(main())
    assert cleaned_on[0] == loop_thread and cleaned_on[1] != loop_thread and cleaned_on[2] != loop_thread
    assert [(k, t == loop_thread) for k, _, t in seen] == [
        ("display", True), ("stream", True), ("display", True), ("stream", True)]  # the note on the made-up type
    assert "<b>small</b>" in seen[0][1] and "application/x-made-up output, which was not shown" in seen[1][1]
    assert "color: red" in seen[2][1] and seen[3][1].startswith("after\n")
    assert res.result is not None and "color: red" in res.result["text/html"]


def test_an_error_s_name_is_plain_text_and_text_metrics_are_short() -> None:
    res, _ = run({"t": "done", "status": "error", "metrics": {"note": "y" * 1000, "n": 3},
                  "error": {"ename": "E\b\b\b2 ok · best reward 1e+09\x1b]0;t\x07\nx", "evalue": "", "traceback": []}})
    assert res.error["ename"].isprintable() and "\x1b" not in res.error["ename"] and "\b" not in res.error["ename"]
    assert len(res.metrics["note"]) == gate.METRIC_TEXT and res.metrics["n"] == 3


def test_a_session_s_output_logs_share_one_budget(tmp_path: Any) -> None:
    """Each cell's and branch's log is at most ``log-limit`` (200 MB), with no total: a fork of
    256 branches printing without end could write 51 GB into the folder."""
    from smolbench.gate.output import LogPool

    pool = LogPool(total=3000)
    logs = []
    for i in range(5):  # five branches, each printing far past the cell's output
        budget = OutputBudget(tmp_path / f"root.{i}.log", limit=100, log_limit=2000, pool=pool)
        budget.take("stdout", "x" * 5000)
        note = budget.finish()
        logs.append((tmp_path / f"root.{i}.log").stat().st_size if (tmp_path / f"root.{i}.log").exists() else 0)
        assert note is not None and "more output not shown" in note
    assert logs == [2000, 1000, 0, 0, 0] and pool.left == 0


def test_the_output_logs_of_a_folder_share_one_budget_and_the_oldest_idle_ones_go_first(tmp_path: Any) -> None:
    """Every session started with a fresh 1 GB, so a folder used day after day grew without
    end; and once the budget was spent a cell's line said "the first 0 bytes of it saved to
    X", naming a file that did not exist (or an older session's of the same name)."""
    import os

    from smolbench.gate.output import LogPool

    old, recent = tmp_path / "root.cell1-20261204-101010-aaaaaa.log", tmp_path / "root.cell2-20261205-090909-bbbbbb.log"
    old.write_bytes(b"o" * 4096)
    recent.write_bytes(b"r" * 4096)
    os.utime(old, (1, 1))  # a day-old session's log
    (tmp_path / "elsewhere.log").symlink_to(tmp_path.parent)  # a copied folder's link: never followed
    # the user's own log beside a ledger kept in their folder (Session(ledger="runs/ledger.db")):
    # not smolbench's, never counted nor removed (the review: it was deleted as the oldest)
    (tmp_path / "train.log").write_bytes(b"t" * 8192)
    os.utime(tmp_path / "train.log", (0, 0))
    pool = LogPool(total=12288, folder=tmp_path, mine="20261205-111111-cccccc",
                   sessions=lambda: ["20261204-101010-aaaaaa", "20261205-090909-bbbbbb", "20261205-111111-cccccc"])
    first = OutputBudget(tmp_path / "root.cell1-20261205-111111-cccccc.log", limit=10, log_limit=8192, pool=pool)
    first.take("stdout", "x" * 9000)
    first.finish()
    # room for this session's 8 KiB: the old session's log went, the recent one (maybe a live
    # kernel's beside this one) stayed
    assert not old.exists() and recent.read_bytes() == b"r" * 4096
    assert (tmp_path / "root.cell1-20261205-111111-cccccc.log").stat().st_size == 8192
    assert (tmp_path / "elsewhere.log").is_symlink() and tmp_path.parent.is_dir()
    assert (tmp_path / "train.log").read_bytes() == b"t" * 8192
    second = OutputBudget(tmp_path / "root.cell2-20261205-111111-cccccc.log", limit=10, log_limit=8192, pool=pool)
    second.take("stdout", "y" * 9000)
    note = second.finish()
    assert note is not None and "not saved: the output logs in" in note and "delete old ones there" in note, note
    assert "saved to" not in note and not (tmp_path / "root.cell2-20261205-111111-cccccc.log").exists()


def test_a_failed_branch_s_reason_in_host_lines_is_plain_text() -> None:
    """The reason is cut short inside the fork's summary: a style it started (its reset cut off)
    coloured the host's lines after it, and a carriage return rewrote them."""
    from smolbench.result import REASON_CHARS, reason

    said = reason({"error": "Exception: \x1b[8m" + "x" * 500 + "\r2 ok · best reward 1e+09"})
    assert said.isprintable() and len(said) <= REASON_CHARS and "\x1b" not in said


def test_markup_with_more_elements_than_can_be_cleaned_is_not_shown_and_the_cell_goes_on() -> None:
    """nh3's parser walks the open elements for a tag's scope, so its time grows with tags x
    depth: 64,000 nested <ol> (256 KiB) took 18 s and markdown's ">" x 262,000 (nested
    blockquotes, which cmark-gfm makes without a limit) ten minutes, on the loop. Past
    MARKUP_ELEMENTS a value is not cleaned: its text/plain shows, and a note says why."""
    from smolbench.gate import display

    deep = [{"t": "display", "data": {"text/html": "<ol>" * 65_000, "text/plain": "deep html"}},
            {"t": "display", "data": {"text/markdown": ">" * 262_000, "text/plain": "deep markdown"}},
            {"t": "display", "data": {"image/svg+xml": "<svg>" + "<g>" * 20_000 + "</svg>"}},
            {"t": "display", "data": {"text/html": "<ol>" * 100 + "fine"}}]
    res, events = run(*deep, {"t": "done", "status": "ok"}, limit=10_000_000)
    bundles = [e.data for e in events if e.kind == "display"]
    assert bundles[0] == {"text/plain": "deep html"} and bundles[1] == {"text/plain": "deep markdown"}
    assert len(bundles) == 3 and "fine" in bundles[2]["text/html"]  # the svg had nothing else to show
    said = notes(events)
    assert any("text/html (65,000 elements, over 8,192), which was not shown: too many elements" in n for n in said)
    assert any("text/markdown (262,000 elements" in n for n in said) and any("image/svg+xml (20,001" in n for n in said)
    assert res.status == "ok"
    assert display.MARKUP_ELEMENTS == 8_192


def test_a_style_nested_past_its_limit_is_dropped_without_a_word_on_stderr(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """tinycss2 and its serializer recurse per bracket: 500 deep raised RecursionError inside
    nh3's attribute callback, which Python printed (148 MB of tracebacks for 498 of them)."""
    import sys

    from smolbench.gate import display

    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    html = ('<b style="color:' + "(" * 500 + '">x</b>') * 498
    assert display.clean_html(html) == "<b>x</b>" * 498
    assert display.clean_html('<p style="background: linear-gradient(rgb(1,2,3), red)">x</p>') == \
        '<p style="background: linear-gradient(rgb(1,2,3), red)">x</p>'
    assert capfd.readouterr().err == "" and unraisable == []


OUTPUT_CODE = [f.__code__ for f in vars(OutputBudget).values() if inspect.isfunction(f)]


def _in_a_thread(*codes: Any) -> bool:
    """Whether a thread other than this one runs (somewhere down its stack) one of ``codes``."""
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        f = None if ident == me else frame
        while f is not None:
            if f.f_code in codes:
                return True
            f = f.f_back
    return False


def test_a_cell_cancelled_while_a_checker_thread_reads_its_output_leaves_no_log_open(tmp_path: Any) -> None:
    """Ctrl-C while a big message is checked on a thread: the cell's end closed its log, and
    the thread, still taking the message, opened it again ("wb": emptied) and never closed it."""
    import os

    log = tmp_path / "root.cell1.log"
    budget = OutputBudget(log, limit=1000)  # the second message is cut into lines first (slow), then spilled
    text = "a line\n" * 2_000_000  # 14 MB: seconds of line cutting on the thread

    async def main() -> None:
        async def chunks() -> AsyncIterator[bytes]:
            yield json.dumps({"t": "stream", "name": "stdout", "text": "x" * 200 + "\n"}).encode() + b"\n"
            yield json.dumps({"t": "stream", "name": "stdout", "text": text}).encode() + b"\n"
            await asyncio.sleep(60)

        task = asyncio.ensure_future(gate.read_cell(chunks(), CellRequest("x", output=budget), None, "root", scope="t"))
        deadline = time.monotonic() + 60
        while not _in_a_thread(OutputBudget._cut_lines.__code__):  # a checker thread cuts the big one now
            assert time.monotonic() < deadline, "no checker thread took the big message"
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    size_at_end = log.stat().st_size if log.exists() else 0
    deadline = time.monotonic() + 60
    while _in_a_thread(*OUTPUT_CODE):  # the thread's work ends meanwhile (a loaded host's takes a while)
        assert time.monotonic() < deadline, "the checker thread never ended its work"
        time.sleep(0.01)
    assert budget._log is None
    assert (log.stat().st_size if log.exists() else 0) == size_at_end
    mine = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert str(log) not in mine


def test_a_traceback_is_cut_to_its_end_before_its_terminal_text_is_handled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The terminal handling costs by the character: a control reply's 64 MB traceback was all
    handled (2.6 s on the loop), then all but its last 256 KiB thrown away."""
    from smolbench.gate import terminal

    handled = 0
    real = terminal.kept_to_lines

    def counting(text: str) -> str:
        nonlocal handled
        handled += len(text)
        return real(text)

    monkeypatch.setattr(terminal, "kept_to_lines", counting)
    tb = ["\x1b\n" * 7_900] * 1000
    res, _ = run({"t": "done", "status": "error", "error": {"ename": "E", "evalue": "v", "traceback": tb}})
    assert handled <= gate.TRACEBACK + 64 * 1024 + 1000, handled
    assert res.error["traceback"][-1] == real(tb[-1])


def test_a_branch_s_budget_holds_a_tail_of_its_output_and_logs_all_of_it_in_order(tmp_path: Any) -> None:
    """A fork's row keeps only ``keep`` characters of each stream (a fork of 1,024 branches kept
    5 MB each for the session): while it runs too, and its log has all the branch printed."""
    log = tmp_path / "root.0.log"
    budget = OutputBudget(log, limit=10_000_000, keep=1000)
    printed = []
    for i in range(200):
        name = "stderr" if i % 10 == 9 else "stdout"
        text = f"{name} {i} " + "x" * 490 + "\n"
        printed.append(text)
        assert budget.take(name, text) == text  # all of it is still shown
        assert sum(map(len, budget._shown_text[name])) <= 3 * 1000
    assert budget.finish() is None and log.read_text() == "".join(printed)
    out = budget.text("stdout")
    shown, _, note = out.rpartition("… ")
    assert shown == "".join(printed[198:199]) and note == f"only the last 502 bytes of it kept here (all of it saved to {os.path.relpath(log)})\n"
    capped = OutputBudget(tmp_path / "root.1.log", limit=2000, keep=1000, log_limit=3000)
    capped.take("stdout", "y" * 5000 + "\n")
    assert capped.finish() == f"… 3.0 KB more output not shown (the first 3.0 KB of all of it saved to {os.path.relpath(tmp_path / 'root.1.log')})\n"


DONE = {"t": "done", "status": "ok"}


def _clears(events: list[Event]) -> int:
    return sum(e.kind == "clear" for e in events)


def test_clears_that_would_clear_nothing_are_not_passed_on() -> None:
    """Third audit: every ``{"t":"clear"}`` a machine sent was passed on, uncounted, and each
    made the magics clear the cell and redraw their notes: 2 MB of them held a cell for minutes
    and grew the kernel by hundreds of MB. A clear with nothing shown since the last one clears
    nothing, and is dropped (a waiting one is still followed by an immediate one)."""
    _, events = run(*[{"t": "clear"}] * 20_000, DONE)
    assert _clears(events) == 1
    _, events = run(*[{"t": "clear", "wait": True}] * 1000, {"t": "clear"}, {"t": "clear"}, DONE)
    assert [e.wait for e in events if e.kind == "clear"] == [True, False]


def test_a_live_plot_clears_before_each_frame_and_a_loop_of_them_ends() -> None:
    frame = {"t": "display", "data": {"text/plain": "frame"}}
    _, events = run(*[m for _ in range(50) for m in ({"t": "clear", "wait": True}, frame)], DONE)
    assert _clears(events) == 50  # an honest live plot: every clear passed on
    _, events = run(*[m for _ in range(CLEARS + 500) for m in ({"t": "clear"}, frame)], DONE, limit=10**9)
    assert _clears(events) == CLEARS  # a loop of clears ends somewhere
