"""Issue 17: what a machine sends stays bounded and well-formed (tests through a real kernel).

Lone surrogates, frames that are not UTF-8, display floods, replies that cost the kernel more
than their size, pulled values built bigger than what was sent: each attack from a cell that
rewrites its own guest agent (see ``hijack.py``), each next to a weakened host where it matters.
Split from ``test_trust_gate.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hijack import HIJACK, one_line_error, still_works, up  # noqa: E402
from nbhelpers import NotebookSession, error_output, result_text, stream_text  # noqa: E402

# -- issue 17: one lone surrogate must not break the session ---------------------------------------

SURROGATES = [
    # (what the machine does, where the lone surrogate hides)
    "import smolbench_guest\nsmolbench_guest.report(reward=1, **{'\\ud800': 1.0})",  # a metric's name
    "import smolbench_guest\nsmolbench_guest.report(reward=1, note='a\\udfffb')",  # a metric's value
    "_ag.send({'t': 'stream', 'name': 'stdout', 'text': 'a\\ud800b'})",
    "_ag.send({'t': 'display', 'data': {'text/plain': 'a\\udc00b'}})",
    "_ag.send({'t': 'display', 'data': {'application/json': {'k\\ud801': [1]}, 'text/plain': 'j'}})",
    "_ag._conn.sendall(b'{\"t\": \"stream\", \"name\": \"stdout\", \"text\": \"raw \\xed\\xa0\\x80 bytes\"}\\n')",
    "raise ValueError('bad \\ud800 text')",  # an error message
]


def test_a_lone_surrogate_from_a_machine_is_one_line_and_the_session_carries_on(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        for code in SURROGATES:
            cell = nb.run(f"%%smol fork 1 --allow-errors --keep none\n{HIJACK.split(chr(10), 1)[1]}{code}")
            assert "UnicodeEncodeError" not in str(cell.outputs) and "Traceback" not in str(cell.outputs), cell.outputs
            rows = stream_text(nb.run("import smolbench\nprint([r['error'] for r in smolbench._magics.last_result.rows.values()])"))
            assert "malformed reply: text that is not valid Unicode (a lone surrogate" in rows, (code, rows)
            msg = one_line_error(nb.run(f"%%smol\n{code}"))  # the same in a plain cell: one line
            assert "malformed reply: text that is not valid Unicode (a lone surrogate" in msg, (code, msg)
            # every later cell works, on the host and in machines, tree and status included
            assert result_text(nb.run("1 + 1")) == "2"
            still_works(nb)
        for line in ("%smol tree", "%smol status"):
            assert error_output(nb.run(line)) is None
        # an honest cell printing one (a non-UTF-8 file name, say) sees it escaped, as Python's stderr would
        cell = nb.run("%%smol\nprint('name-\\udc80.txt')")
        assert stream_text(cell) == "name-\\udc80.txt\n" and error_output(cell) is None, cell.outputs
        nb.run("%smol down")
        nb.run("%smol up --backend sandbox")
        assert result_text(nb.run("%%smol\n6 * 7")) == "42"

        # Weakened: a gate that lets the surrogate through breaks the kernel's own messages: no
        # one-line error, and the output either fails in the cell or, flushed from ipykernel's
        # IO thread, fails there (logged, not shown) and is lost
        nb.run("import smolbench.gate.frames as f\n_vt = f._valid_text\nf._valid_text = lambda msg: None")
        cell = nb.run(f"%%smol\nimport sys\n_ag = sys.modules['smolbench_guest']._agent\n{SURROGATES[2]}")
        shown = str(cell.outputs)
        assert "lone surrogate" not in shown and ("UnicodeEncodeError" in shown or not cell.outputs), cell.outputs
        nb.run("f._valid_text = _vt")
        nb.run("%smol down")


# -- issue 17 (audit L3): frames are UTF-8, never UTF-16/32 guessed ------------------------------

# Each sends one whole frame, not UTF-8, on the agent's socket: (the frame, what it may hold).
NOT_UTF8 = [
    # a done reply in UTF-16 whose metric name is a lone surrogate (json.loads(bytes) took it)
    "('{\"t\": \"done\", \"status\": \"ok\", \"reward\": 1.0, \"metrics\": {\"\\ud800\": 1.0, \"m\": \"x\\udfff\"}}'"
    ".encode('utf-16-le', 'surrogatepass'))",
    # a stream in UTF-16 carrying a lone surrogate to ipykernel's IOPub
    "('{\"t\": \"stream\", \"name\": \"stdout\", \"text\": \"A\\ud800B\\\\n\"}'.encode('utf-16-le', 'surrogatepass'))",
    # well-formed text, but UTF-16 (with its BOM) and UTF-32: not the wire format either
    "('{\"t\": \"stream\", \"name\": \"stdout\", \"text\": \"sixteen\\\\n\"}'.encode('utf-16'))",
    "('{\"t\": \"stream\", \"name\": \"stdout\", \"text\": \"thirty-two\\\\n\"}'.encode('utf-32-le'))",
]


def test_a_frame_that_is_not_utf8_is_one_line_and_the_session_carries_on(tmp_path: Path) -> None:
    r"""Attack (audit L3): a cell sends its reply as UTF-16, lone surrogates passed through:

        agent = smolbench_guest._agent
        msg = '{"t":"done","status":"ok","reward":1.0,"metrics":{"\ud800":1.0}}'
        agent._conn.sendall(msg.encode('utf-16-le', 'surrogatepass') + b'\n')

    The gate looked for surrogates in the raw bytes (``\uD8..`` or ``\xED[\xA0-\xBF]``),
    but ``json.loads(bytes)`` guesses UTF-16/32 and decodes them with surrogatepass, so the
    surrogate reached the ledger and tree (every later cell, host-only ones too, ended in
    ``UnicodeEncodeError`` from WorkbenchView._post_run_cell, and ``%smol tree`` was gone),
    or ipykernel's IOPub for a stream. Now a frame must be strict UTF-8: anything else is
    the gate's one line, in forks and plain cells, and the kernel carries on.
    """
    bad = "malformed reply: text that is not valid Unicode ("
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        for frame in NOT_UTF8:
            send = f"_ag.outbox.flush()\n_ag._conn.sendall({frame} + b'\\n')"
            cell = nb.run(f"%%smol fork 2 --allow-errors --keep none\n{HIJACK.split(chr(10), 1)[1]}{send}\n"
                          "import time; time.sleep(0.5)")
            assert "UnicodeEncodeError" not in str(cell.outputs), cell.outputs
            rows = stream_text(nb.run("import smolbench\nprint([r['error'] for r in smolbench._magics.last_result.rows.values()])"))
            assert rows.count("malformed reply: ") == 2 and ("not valid Unicode" in rows or "not a JSON line" in rows), (frame, rows)
            msg = one_line_error(nb.run(f"%%smol\n{send}"))  # the same in a plain cell: one line
            assert msg.startswith("machine root sent a malformed reply: ") and (bad in msg or "not a JSON line" in msg), (frame, msg)
            # every later cell works: host-only ones (no callback error), machines, tree and status
            cell = nb.run("print('host cell after')")
            # (ipykernel may send one print as two stream messages: its flush timer can fall between the writes)
            assert {o.output_type for o in cell.outputs} == {"stream"} and stream_text(cell, "stderr") == "", cell.outputs
            assert stream_text(cell) == "host cell after\n", cell.outputs
            still_works(nb)
            for line in ("%smol tree", "%smol status"):
                cell = nb.run(line)
                assert error_output(cell) is None and "unavailable" not in str(cell.outputs), cell.outputs
                assert "UnicodeEncodeError" not in str(cell.outputs), cell.outputs
        # the surrogate ones are named as such, even as raw UTF-8-style bytes
        msg = one_line_error(nb.run("%%smol\n_ag._conn.sendall(b'{\"t\": \"stream\", \"name\": \"stdout\", "
                                    "\"text\": \"raw \\xed\\xa0\\x80 bytes\"}\\n')"))
        assert bad + "a lone surrogate '\\ud800' at byte" in msg, msg
        msg = one_line_error(nb.run(f"%%smol\n_ag._conn.sendall({NOT_UTF8[1]} + b'\\n')"))
        assert bad + "bytes that are not UTF-8 at byte" in msg, msg
        still_works(nb)
        # honest text of every plane still comes back
        cell = nb.run("%%smol\nprint('é ☃ 😀 \\u2028 end')")
        assert stream_text(cell) == "é ☃ 😀 \u2028 end\n" and error_output(cell) is None, cell.outputs
        nb.run("%smol down")


# -- issue 17: display floods stay in their cell, and Ctrl-C answers ------------------------------

DISPLAY_FLOOD = "%%smol\nfor i in range(100_000):\n    display(i)"


def test_a_display_flood_is_bounded_stays_in_its_cell_and_ctrl_c_answers(tmp_path: Path) -> None:
    import threading
    import time

    def displays(cell: object) -> list[str]:
        return [o["data"]["text/plain"] for o in cell.outputs if o.output_type == "display_data"]  # type: ignore[attr-defined]

    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        nb.run("%%smol fork 1 --keep all\npass")  # a second machine: later cells run there
        cell = nb.run(DISPLAY_FLOOD)
        shown = displays(cell)
        assert shown == [str(i) for i in range(200)], shown[-3:]
        assert "… 99,800 more displays not shown (past 200 displays in one cell; `%smol config displays N`" in \
            stream_text(cell, "stderr")
        nb.run("%smol use root.0")
        after = nb.run("%%smol\nprint('mine')")
        assert displays(after) == [] and stream_text(after) == "mine\n", after.outputs  # nothing spilled

        # Ctrl-C during a flood (of displays and text): one line, and the next cell shows only its own output
        nb.run("%smol use root")
        nb.run("%smol config displays 1000000")  # as many as a user may ask for
        done = threading.Event()

        def ctrl_c() -> None:  # Ctrl-C at 1 s, and again each second until the cell ends: on a
            while not done.wait(1.0):  # loaded host the first one may land before the cell starts
                nb.interrupt()

        timer = threading.Thread(target=ctrl_c)
        timer.start()
        t0 = time.monotonic()
        try:
            cell = nb.run("%%smol\nfor i in range(10**7):\n    display(i)\n    print('line', i)")
        finally:
            done.set()
        took = time.monotonic() - t0
        timer.join()
        err = error_output(cell)
        assert err is not None and err.ename == "KeyboardInterrupt", cell.outputs
        print(f"display flood interrupted after 1 s returned at {took:.2f} s")  # numbers: bench/flood.py
        after = nb.run("%%smol\nprint('mine')")
        assert displays(after) == [] and stream_text(after) == "mine\n", after.outputs
        nb.run("%smol config displays 200")

        # Weakened: a cell that hands back control before showing all it queued (as before)
        nb.run("import smolbench.magics as m\n_q = m._PENDING\n"
               "class _Leaky(type(_q)):\n    def empty(self): return True\n"
               "_q.__class__ = _Leaky")
        nb.run("%smol config displays 100000")
        nb.run(DISPLAY_FLOOD)
        after = nb.run("%%smol\nprint('mine')")
        assert len(displays(after)) > 0, "the weakened host should spill the flood into the next cell"
        nb.run("_q.__class__ = type(_q).__mro__[1]")
        nb.run("%smol down")


# -- issue 17: what a reply costs the kernel stays near its size -----------------------------------

def _peak_growth(nb: NotebookSession, code: str) -> tuple[object, float]:
    """Run ``code``; the kernel's peak resident memory during it, above where it started (MB)."""
    pid = nb.kernel_pid

    def rss(field: str) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts again from now
    before = rss("VmRSS")
    cell = nb.run(code)
    return cell, (rss("VmHWM") - before) / 1e6


NESTED = ("%%smol --pull v\nv = 1\n"
          "_G['_pull'] = lambda value, trusted: {'format': 'data', 'data': [[] for _ in range(3_000_000)]}")


def test_replies_cost_the_kernel_a_small_multiple_of_their_size(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        nb.run("%%smol\npass")
        # a 9 MB pull of 3,000,000 empty lists: refused by count before it is built
        cell, grew = _peak_growth(nb, NESTED)
        msg = one_line_error(cell)
        assert "a reply of 3,000,0" in msg and "JSON values, above the limit of 1,000,000" in msg, msg
        assert "%smol config max-items" in msg
        print(f"a refused 9 MB reply: kernel peak +{grew:.0f} MB")
        assert grew < 80, f"the kernel grew {grew:.0f} MB for a 9 MB reply"
        still_works(nb)
        # a 32 MB application/json display: past the cell's output limit, so dropped unbuilt
        cell, grew = _peak_growth(nb, "%%smol\n_ag.send({'t': 'display', 'data': {'application/json': "
                                      "['x' * 100 for _ in range(320_000)], 'text/plain': 'big'}})")
        assert "1 more displays not shown" in stream_text(cell, "stderr"), cell.outputs
        print(f"a dropped 32 MB display: kernel peak +{grew:.0f} MB")
        assert grew < 200, f"the kernel grew {grew:.0f} MB for a 32 MB display"
        # unfinished lines from several branches at once: bounded all together, one line
        nb.run("%smol config max-frame 40M")
        nb.run("%smol config in-flight 100M")
        cell, grew = _peak_growth(nb, "%%smol fork 4 --allow-errors --keep none\nimport sys, time\n"
                                      "_ag = sys.modules['smolbench_guest']._agent\n"
                                      "_ag._conn.sendall(b'{\"t\": \"stream\", \"text\": \"' + b'x' * 39_000_000)\n"
                                      "time.sleep(3)")
        errors = stream_text(nb.run("import smolbench\n"
                                    "print([r['error'] for r in smolbench._magics.last_result.rows.values()])"))
        assert "still without their line end, from all machines together, above the limit of 100 MB" in errors, errors
        print(f"4 unfinished replies: kernel peak +{grew:.0f} MB")
        assert grew < 300, f"the kernel grew {grew:.0f} MB for 4 unfinished replies"
        nb.run("%smol config max-frame 64M")
        nb.run("%smol config in-flight 256M")

        # Weakened: with no count limit the same 9 MB reply costs the kernel hundreds of MB
        nb.run("%smol config max-items 100M")
        cell, grew = _peak_growth(nb, NESTED)
        print(f"weakened: kernel peak +{grew:.0f} MB")
        assert grew > 150, f"the weakened gate only grew {grew:.0f} MB"
        nb.run("%smol config max-items 1M")
        nb.run("%smol down")


# -- issue 17 (audit L4): a pulled value is never built bigger than what was sent -------------------

def _pull_as(enc: str) -> str:
    """A cell whose agent answers ``--pull v`` with ``enc`` (a Python expression, run in the machine)."""
    return ("%%smol --pull v\nimport io, base64\nv = 1\n"
            "_G.setdefault('_honest_pull', _G['_pull'])\n"
            f"_G['_pull'] = lambda value, trusted: {{'format': 'data', 'data': {enc}}}")


def _range(n: int) -> str:
    return f"{{'$': 'range', 'start': 0, 'stop': {n}, 'step': 1, 'name': None}}"


def _series(values: str, dtype: str, rows: int) -> str:
    return f"{{'$': 'series', 'values': {{'values': {values}, 'dtype': {dtype!r}}}, 'index': {_range(rows)}, 'name': None}}"


def _frame(columns: list[str], dtype: str, rows: int) -> str:
    data = ", ".join(f"{{'values': {c}, 'dtype': {dtype!r}}}" for c in columns)
    return f"{{'$': 'dataframe', 'columns': {list(range(len(columns)))}, 'index': {_range(rows)}, 'data': [{data}]}}"


# .npy of a trillion items of 0 bytes: a 128-byte header, no data
_EMPTY_ITEMS = ("(lambda h: {'$': 'npy', 'v': base64.b64encode(b'\\x93NUMPY\\x01\\x00' + bytes([len(h), 0]) + h).decode()})"
                "(\"{'descr': '|V0', 'fortran_order': False, 'shape': (1000000000000,), }\".ljust(117).encode() + b'\\n')")

PULL_EXPANSIONS = [
    # (what the machine sends for --pull v, what the one line says)
    (_series("1", "object", 10_000_000), "a pandas index of 10,000,000 rows, above the limit of 1,000,000 JSON values"),
    (_series("1", "object", 3), "a pandas column whose values are not a list or a 1-D array ('int')"),
    (_frame(["1", "2"], "object", 300_000), "a pandas column whose values are not a list or a 1-D array ('int')"),
    (_series("{'$': 'dict', 'v': [[0, 1]]}", "object", 500_000), "not a list or a 1-D array ('dict')"),
    (_series("[1]", "object", 500_000), "a pandas column of 1 values for an index of 500,000 rows"),
    (_series("[1]", "U20000000", 1), "a pandas column of dtype 'U20000000' (pandas holds no such column)"),
    (_series("[1]", "10000000f8", 1), "a pandas column of dtype '10000000f8' (pandas holds no such column)"),
    (_frame([], "int64", 10**12), "a pandas index of 1,000,000,000,000 rows, above the limit"),
    ("[" + ", ".join([_frame([], "int64", 600_000)] * 2) + "]", "pandas indexes of 1,200,000 rows in all, above the limit"),
    (_EMPTY_ITEMS, "an array of 1,000,000,000,000 items of 0 bytes sent in 128 bytes"),
]


def test_a_pulled_value_is_never_built_bigger_than_what_was_sent(tmp_path: Path) -> None:
    r"""Attack (audit L4): a ``--pull`` reply whose pandas column is a scalar, broadcast by
    ``pd.Series(scalar, index=RangeIndex(0, N))``:

        enc = {"format": "data", "data": {"$": "series", "values": {"values": 1, "dtype": "object"},
               "index": {"$": "range", "start": 0, "stop": 30000000, "step": 1}, "name": None}}
        agent._conn.sendall(json.dumps({"t": "done", "status": "ok", "pulled": {"x": enc}}).encode() + b"\n")

    216 bytes took the kernel from 63 to 335 MB (linear in ``stop``, times the columns of a
    DataFrame). The same for the other ways to build more than was sent: a dict reindexed
    to the index, a column shorter than its index, numpy dtypes of huge items (``U20000000``,
    sub-arrays ``10000000f8``), range indexes with no data, and .npy arrays of 0-byte items.
    Now every column is a list or 1-D array of exactly its index's length, a range index's
    rows count against the reply's ``max-items``, and the rest is one line.
    """
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        nb.run("%%smol\npass")
        nb.run("import numpy, pandas")  # what they cost is not the reply's
        for enc, expected in PULL_EXPANSIONS:
            cell, grew = _peak_growth(nb, _pull_as(enc))
            msg = one_line_error(cell)
            assert msg.startswith("machine root sent a malformed reply: ") and expected in msg, (enc, msg)
            assert grew < 40, f"the kernel grew {grew:.0f} MB for a reply of a few hundred bytes: {enc}"
            still_works(nb)
        assert "%smol config max-items" in one_line_error(nb.run(_pull_as(_series("1", "object", 10_000_000))))
        # honest pandas values, as the agent sends them, still come back (object columns one item per value)
        nb.run("%%smol\n_G['_pull'] = _G['_honest_pull']")
        cell = nb.run("%%smol --pull s,df,e\nimport pandas as pd, numpy as np\n"
                      "s = pd.Series([[1, 2], 'a', None], name='s')\n"
                      "df = pd.DataFrame({'x': np.arange(3.0), 'c': pd.Categorical(['p', 'q', 'p'])}, index=pd.RangeIndex(3, 9, 2))\n"
                      "e = pd.DataFrame(index=pd.RangeIndex(5))")
        assert error_output(cell) is None, cell.outputs
        assert stream_text(nb.run("print(s.tolist(), s.dtype, df['x'].tolist(), df.index.tolist(), str(df['c'].dtype), e.shape)")) == \
            "[[1, 2], 'a', None] object [0.0, 1.0, 2.0] [3, 5, 7] category (5, 0)\n"
        # and the kernel is as usable as before: a host cell, the tree, the status
        cell = nb.run("print('host cell after')")
        assert cell.outputs == [{"output_type": "stream", "name": "stdout", "text": "host cell after\n"}], cell.outputs
        for line in ("%smol tree", "%smol status"):
            cell = nb.run(line)
            assert error_output(cell) is None and "unavailable" not in str(cell.outputs), cell.outputs
        nb.run("%smol down")
