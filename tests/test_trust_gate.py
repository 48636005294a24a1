"""Issue 9: everything a machine sends is attacker data (tests through a real kernel).

A cell inside the machine rewrites its own guest agent (its reply function, or raw
bytes on its socket) and attacks the host: a pickle bomb on --pull, malformed frames,
non-finite rewards, script in display output. Each attack is also run against a
deliberately weakened host (trusted mode, or a gate check switched off in the test's
own kernel) to show that the check is what stops it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hijack import one_line_error, still_works, up  # noqa: E402
from nbhelpers import NotebookSession, error_output, plain_texts, result_text, stream_text  # noqa: E402

# -- --pull: data, never code ------------------------------------------------------------------

BOMB = (
    "%%smol\nimport os\nclass Bomb:\n"
    "    def __reduce__(self):\n"
    "        return (os.system, ('touch {marker}',))\n"
    "bomb = Bomb()\n"
)
# The agent, rewritten: every pulled value goes back as a pickle, trusted or not.
SEND_PICKLES = (
    "%%smol\n_G['_pull'] = lambda value, trusted: {'format': 'pickle', "
    "'data': base64.b64encode(pickle.dumps(value)).decode()}\n"
)


def test_pull_brings_data_back_and_never_unpickles_a_bomb(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"  # the machine can't see the host's tmp dir: only the host can touch it
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        # data of every supported form comes back equal
        nb.run("%%smol\nimport numpy as np, pandas as pd\n"
               "d = {'a': [1, 2.5, None, True], (1, 2): {'s', 't'}, 'b': b'\\x00\\xff', 'c': 1+2j, 'n': float('nan')}\n"
               "arr = np.arange(12, dtype=np.int32).reshape(3, 4)\n"
               "df = pd.DataFrame({'x': [1.5, 2.5], 'y': ['p', 'q'], 't': pd.to_datetime(['2020-01-01', '2021-02-03'])}, index=['r1', 'r2'])\n"
               "s = pd.Series([1, 2, 3], name='s')\nscalar = np.float32(1.25)")
        assert error_output(nb.run("%%smol --pull d,arr,df,s,scalar\npass")) is None
        check = nb.run(
            "import math, numpy as np, pandas as pd\n"
            "assert d['a'] == [1, 2.5, None, True] and d[(1, 2)] == {'s', 't'} and d['b'] == b'\\x00\\xff'\n"
            "assert d['c'] == 1+2j and math.isnan(d['n'])\n"
            "assert arr.dtype == np.int32 and arr.tolist() == np.arange(12).reshape(3, 4).tolist()\n"
            "assert df.loc['r2', 'y'] == 'q' and df['x'].tolist() == [1.5, 2.5] and str(df['t'].dtype).startswith('datetime64')\n"
            "assert s.name == 's' and s.tolist() == [1, 2, 3] and type(scalar) is np.float32\n"
            "print('all equal')")
        assert "all equal" in stream_text(check), check.outputs

        nb.run(BOMB.format(marker=marker))
        # 1. the real agent refuses: not plain data, and says the way out
        msg = one_line_error(nb.run("%%smol --pull bomb\npass"))
        assert "--pull bomb: a __main__.Bomb is not plain data" in msg and "--pull-trusted" in msg
        # 2. a rewritten agent sends the pickle anyway: the gate refuses it
        nb.run(SEND_PICKLES)
        msg = one_line_error(nb.run("%%smol --pull bomb\npass"))
        assert msg.startswith("machine root sent a malformed reply: --pull bomb came back as a pickle")
        # 3. ... or hides it in an .npy of Python objects: numpy reads it with allow_pickle=False
        nb.run("%%smol\nimport io, numpy as np\n"
               "def _npy_bomb(value, trusted):\n"
               "    buf = io.BytesIO(); np.save(buf, np.array([value, 1], dtype=object), allow_pickle=True)\n"
               "    return {'format': 'data', 'data': {'$': 'npy', 'v': base64.b64encode(buf.getvalue()).decode()}}\n"
               "_G['_pull'] = _npy_bomb")
        msg = one_line_error(nb.run("%%smol --pull bomb\npass"))
        assert "machine root sent a malformed reply: an array that is not plain .npy data" in msg
        assert not marker.exists(), "the pickle bomb ran on the host"
        assert "bomb" not in nb.run("print(sorted(globals()))").outputs[0]["text"]

        # Weakened: the user opts in to trusted pulls; the same probe now runs on the host.
        nb.run(SEND_PICKLES)
        cell = nb.run("%%smol --pull bomb --pull-trusted\npass")
        assert "what this cell pulls (bomb) is unpickled here" in stream_text(cell, "stderr")  # the opt-in warns
        assert marker.exists(), "with --pull-trusted the pickle is loaded (the escape the gate prevents)"
        rows = nb.run("import smolbench\nprint(smolbench._magics.workbench.ledger.trust_rows())")
        assert "--pull-trusted bomb" in stream_text(rows)  # ... and is on the record
        nb.run("%smol down")


# -- frames: oversized, truncated, ill-typed ---------------------------------------------------

FRAMES = [
    # (raw bytes the hijacked cell writes on its reply socket, what the one line says)
    ("b'\\xff\\xfenot json\\n'", "text that is not valid Unicode (bytes that are not UTF-8 at byte 0"),
    ("b'[1, 2]\\n'", "a JSON list where an object belongs"),
    ("b'{\"t\": \"stream\", \"name\": \"stdout\", \"text\": 123}\\n'", "the stream text should be text, got a int"),
    ("b'{\"t\": \"stream\", \"name\": \"tty\", \"text\": \"x\"}\\n'", "a stream named 'tty'"),
    ("b'{\"t\": \"stream\", \"name\": \"stdout\", \"text\": \"x\", \"evil\": 1}\\n'", "unknown field 'evil'"),
    ("b'{\"t\": \"shell\", \"cmd\": \"id\"}\\n'", "a message of unknown type 'shell'"),
    ("b'{\"t\": \"display\", \"data\": {\"image/png\": \"!!!notbase64\"}}\\n'", "the image/png output is not base64"),
    ("b'{\"t\": \"done\", \"status\": \"ok\", \"error\": {\"ename\": 7}}\\n'", "the error name should be text"),
    ("b'{\"t\": \"done\", \"status\": \"ok\", \"reward\": 1' + b'0' * 5000 + b'}\\n'", "not a JSON line"),
    ("b'[' * 200000 + b'\\n'", "JSON nested too deeply"),
    # deep enough to break nbformat (and so saving the notebook), not the kernel's JSON
    ("b'{\"t\": \"display\", \"data\": {\"application/json\": ' + b'[' * 500 + b']' * 500 + b'}}\\n'",
     "the application/json output is nested deeper than 64 levels"),
    ("b'{\"t\": \"display\", \"data\": {\"application/vnd.plotly.v1+json\": {\"data\": ' + b'[' * 100 + b']' * 100 + b'}}}\\n'",
     "a plotly figure nested too deeply"),
    ("b'{\"t\": \"done\", \"status\": \"ok\", \"pulled\": {\"other\": {\"format\": \"data\", \"data\": 1}}}\\n'",
     "a pulled value 'other' that was not asked for"),
]


def test_malformed_frames_give_one_line_and_the_kernel_carries_on(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        for raw, expected in FRAMES:
            msg = one_line_error(nb.run(f"%%smol\n_ag._conn.sendall({raw})"))
            assert msg.startswith("machine root sent a malformed reply: ") and expected in msg, (raw, msg)
            still_works(nb)
        # oversized: a frame past the limit is refused as soon as it passes it
        nb.run("%smol config max-frame 1M")
        msg = one_line_error(nb.run("%%smol\n_ag._conn.sendall(b'{\"t\": \"stream\", \"name\": \"stdout\", \"text\": \"' + b'x' * 3000000)"))
        assert "a frame longer than 1.0 MB" in msg and "%smol config max-frame" in msg
        still_works(nb)
        nb.run("%smol config max-frame 256M")
        # truncated: the machine closes its reply mid-frame
        msg = one_line_error(nb.run("%%smol\n_ag._conn.sendall(b'{\"t\": \"stream\", \"na')\n"
                                    "_ag._conn.shutdown(socket.SHUT_WR); _ag._conn = None"))
        assert "a truncated frame" in msg
        still_works(nb)

        # Weakened: a gate that forwards stream messages unchecked (as the host did before):
        # the same ill-typed frame gets through and breaks the kernel's own output code.
        nb.run("import smolbench.gate as g\nfrom smolbench.backends.base import Event\n_orig = g._Cell.stream\n"
               "g._Cell.stream = lambda self, msg, size=0: self.emit(Event('stream', msg['name'], msg['text']))")
        cell = nb.run("%%smol\n_ag._conn.sendall(b'{\"t\": \"stream\", \"name\": \"stdout\", \"text\": 123}\\n')\n"
                      "import time; time.sleep(0.5)")
        err = error_output(cell)
        assert err is not None and err.ename == "TypeError", cell.outputs  # a raw crash deep in the host
        nb.run("g._Cell.stream = _orig")
        nb.run("%smol down")


# -- numbers ------------------------------------------------------------------------------------


def test_rewards_must_be_finite_numbers_from_the_agent_and_from_a_hostile_one(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        # the real agent refuses them, one line each
        cell = nb.run("%%smol fork 4 --allow-errors --keep none\n"
                      "reward = [10**400, True, float('nan'), 2.5][SEED]")
        errors = stream_text(nb.run("import smolbench\nres = smolbench._magics.last_result\n"
                                    "print(*(str(r['error']) for r in res.rows.values()), sep='\\n')"))
        lines = errors.splitlines()
        assert "reward must be a finite number within +-1e300, got one too large for a float (int)" in lines[0]
        assert "reward must be a number, not a bool (True)" in lines[1]
        assert "reward must be a finite number within +-1e300, got nan" in lines[2]
        assert lines[3] == "None"
        assert "OverflowError" not in str(cell.outputs) and "Traceback" not in str(cell.outputs)
        for value, said in (("10**400", "got one too large for a float (int)"), ("True", "not a bool (True)")):
            cell = nb.run(f"%%smol\nreward = {value}")  # a plain cell: said in one line, not recorded
            assert said in stream_text(cell, "stderr") and error_output(cell) is None, cell.outputs
        # a rewritten agent sends them anyway, as raw JSON (NaN, 1e999 = inf, true, a 400-digit int)
        nb.run("%%smol\n_G['P'].encode = lambda msg: (json.dumps(msg) + '\\n').encode()\n"
               "_vals = [float('nan'), 1e999, True, 10**400, -1e301, 2.5]\n"
               "_ag._reward_and_metrics = lambda: {'reward': _vals[SEED] if SEED is not None else None, "
               "'metrics': {}, 'reward_error': None}")
        nb.run("%%smol fork 6 --allow-errors --keep none\npass")
        out = stream_text(nb.run("res = smolbench._magics.last_result\n"
                                 "print(*(f\"{r['status']}|{r['reward']}|{r['error']}\" for r in res.rows.values()), sep='\\n')"))
        rows = out.splitlines()
        for row in rows[:5]:
            status, reward, error = row.split("|")
            assert status == "error" and reward == "None", row
            assert error.startswith("machine root.") and "sent a malformed reply: " in error, error
            assert "the reward must be" in error or "a non-finite number" in error, error
        assert rows[5].startswith("ok|2.5|")

        # Weakened: without the number check, NaN becomes a recorded reward.
        nb.run("import smolbench.gate as g, smolbench.gate.frames as f\n_num, _nc = g.number, f._no_constant\n"
               "g.number = lambda v, what: v\nf._no_constant = float")
        nb.run("%%smol fork 1 --allow-errors --keep none\npass")
        out = stream_text(nb.run("res = smolbench._magics.last_result\nprint([r['reward'] for r in res.rows.values()])"))
        assert "nan" in out
        nb.run("g.number, f._no_constant = _num, _nc")
        nb.run("%smol down")


def test_bad_numbers_in_options_are_one_line_errors(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend sandbox")
        for line, expected in [
            ("%%smol --timeout nan\n1", "--timeout must be a positive number of seconds, got 'nan'"),
            ("%%smol --timeout -5\n1", "--timeout must be a positive number of seconds, got '-5'"),
            ("%%smol --timeout inf\n1", "--timeout must be a positive number of seconds, got 'inf'"),
            ("%%smol fork 2 --timeout nan\n1", "--timeout must be a positive number of seconds, got 'nan'"),
            ("%%smol fork 2 --seeds 0:99999999999\n1", "--seeds 0:99999999999 gives 99,999,999,999 seeds, above the cap of 1024"),
        ]:
            cell = nb.run(line)
            usage = [ln for ln in stream_text(cell, "stderr").splitlines() if ln.startswith("UsageError")]
            assert len(usage) == 1 and expected in usage[0], cell.outputs
            assert error_output(cell) is None and "Traceback" not in str(cell.outputs)
        nb.run("%smol down")


# -- display ------------------------------------------------------------------------------------

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
SHOW = (
    "%%smol\nimport base64\nclass B:\n    def __init__(self, **d): self.d = d\n"
    "    def _repr_html_(self): return self.d.get('html')\n"
    "    def _repr_svg_(self): return self.d.get('svg')\n"
    "    def _repr_markdown_(self): return self.d.get('md')\n"
    "    def _repr_png_(self): return self.d.get('png')\n"
    "    def __repr__(self): return 'B'\n"
)


def test_display_output_is_sanitised_and_data_still_renders(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        nb.run(SHOW)
        cell = nb.run(
            "%%smol\nimport pandas as pd\n"
            "display(B(html='<b>hi</b><script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">'"
            "'<a href=\"javascript:window.__pwned=3\">link</a>'))\n"
            "display(B(svg='<svg xmlns=\"http://www.w3.org/2000/svg\" onload=\"window.__pwned=4\"><rect width=\"2\" height=\"2\"/></svg>'))\n"
            "display(B(md='**bold** [x](javascript:window.__pwned=5) <img src=x onerror=alert(1)>'))\n"
            "display(B(png=base64.b64decode('" + PNG + "')))\n"
            "display(pd.DataFrame({'a': [1, 2]}))\n"
            "_ag.send({'t': 'display', 'data': {'application/javascript': 'window.__pwned=6', 'text/plain': 'js'}})\n"
            "_ag.send({'t': 'display', 'data': {'text/x-unknown-exec': 'x', 'text/plain': 'unk'}})")
        shown = [o for o in cell.outputs if o.output_type == "display_data"]
        raw = str([o["data"] for o in shown])
        for bad in ("<script", "onerror", "onload", "javascript:", "__pwned", "application/javascript", "x-unknown"):
            assert bad not in raw, (bad, raw)
        assert "<b>hi</b>" in raw and "<strong>bold</strong>" in raw and "<rect" in raw
        assert any(o["data"].get("image/png") == PNG for o in shown)
        assert any("<table" in o["data"].get("text/html", "") and "dataframe" in o["data"]["text/html"] for o in shown)
        notes = stream_text(cell, "stderr")
        assert "sent application/javascript output, which was not shown" in notes
        assert "sent text/x-unknown-exec output, which was not shown" in notes
        # a plotly figure comes as JSON data (its HTML form would be a script)
        fig = nb.run("%%smol\nimport plotly.graph_objects as go\ngo.Figure(go.Bar(x=['a'], y=[1]))")
        res = [o for o in fig.outputs if o.output_type == "execute_result"][0]
        assert res["data"]["application/vnd.plotly.v1+json"]["data"][0]["type"] == "bar"
        assert "text/html" not in res["data"]
        # the last expression's bundle goes through the gate too
        out = nb.run("%%smol\nB(html='<i>x</i><script>window.__pwned=7</script>')")
        res = [o for o in out.outputs if o.output_type == "execute_result"][0]
        assert "<i>x</i>" in res["data"]["text/html"] and "<script" not in res["data"]["text/html"]

        # Weakened: trusted mode shows the machine's output raw, script and all.
        trust = nb.run("%smol trust on")
        assert "trusted mode" in stream_text(trust, "stderr")
        cell = nb.run("%%smol\ndisplay(B(html='<script>window.__pwned=1</script>'))\n"
                      "_ag.send({'t': 'display', 'data': {'application/javascript': 'window.__pwned=6'}})")
        raw = str([o["data"] for o in cell.outputs if o.output_type == "display_data"])
        assert "<script>window.__pwned=1</script>" in raw and "application/javascript" in raw
        nb.run("%smol trust off")
        assert plain_texts(nb.run("%%smol\nB(html='<script>1</script>')")) == ["B"]
        nb.run("%smol down")


@pytest.mark.parametrize("html", ["<style>.x{background:url(http://127.0.0.1:1/x)}</style>",
                                  "<p style=\"background-image:url(http://127.0.0.1:1/x)\">p</p>",
                                  "<img src=\"http://127.0.0.1:1/x\">",
                                  "<svg><image href=\"http://127.0.0.1:1/x\"/></svg>",
                                  "<iframe src=\"http://127.0.0.1:1/x\"></iframe>",
                                  "<form action=\"javascript:1\"><button formaction=\"javascript:2\">b</button></form>"])
def test_markup_that_would_fetch_or_run_something_is_cleaned(html: str) -> None:
    from smolbench.gate.display import clean_html

    out = clean_html(html)
    assert "127.0.0.1" not in out and "javascript" not in out and "<iframe" not in out, out


# -- checkpoints ----------------------------------------------------------------------------------


def test_checkpoints_with_links_outside_are_refused_and_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"  # stands in for /etc/shadow: a host file the machine must not get
    secret.write_text("host only")
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        nb.run("%%smol\nopen('notes.txt', 'w').write('mine')\nx = 5")
        assert error_output(nb.run("%smol checkpoint save clean")) is None
        # links to /, /etc/shadow and .. in the workspace: the save is refused, one line each
        for target in ("/", "/etc/shadow", "..", str(secret)):
            nb.run(f"%%smol\nimport os\nos.symlink({target!r}, 'evil')")
            msg = one_line_error(nb.run("%smol checkpoint save bad"))
            assert f"has a link that points outside it (evil -> {target})" in msg and "nothing was saved" in msg
            nb.run("%%smol\nos.unlink('evil')")
        # the machine swaps its saved files for links once written: the host read them from fifos it
        # opened before the save (never a name in the stage), so no link is ever read through
        nb.run("%%smol\n_save = _ag.save\n"
               "def _swap(path):\n"
               "    done = _save(path)\n"
               "    os.unlink(os.path.join(path, 'namespace.pkl'))\n"
               f"    os.symlink({str(secret)!r}, os.path.join(path, 'namespace.pkl'))\n"
               "    return done\n"
               "_ag.save = _swap")
        assert error_output(nb.run("%smol checkpoint save swapped")) is None
        import tarfile

        with tarfile.open(tmp_path / ".smolbench" / "checkpoints" / "swapped.smolcheckpoint", "r:gz") as tar:
            held = tar.extractfile("namespace.pkl")
            assert held is not None and b"host only" not in held.read()
        nb.run("%%smol\n_ag.save = _save")

        # a tampered checkpoint file (links added after the save) is refused at restore
        ckpt = tmp_path / ".smolbench" / "checkpoints" / "clean.smolcheckpoint"
        _add_links(ckpt, [("root", "/"), ("shadow", "/etc/shadow"), ("up", ".."), ("secret", str(secret))])
        msg = one_line_error(nb.run("%smol checkpoint restore clean"))  # not the file its signed row names
        assert "is not the file saved as it" in msg and "refused" in msg
        msg = one_line_error(nb.run("%smol checkpoint trust clean"))  # checked as a file from elsewhere
        assert "has a link that points outside it (root -> /)" in msg and "it was not signed" in msg
        assert plain_texts(nb.run("%smol tree"))[-1].count("r1-") == 0  # no machine was made
        nb.run("%smol down")


def _add_links(ckpt: Path, links: list[tuple[str, str]]) -> None:
    """Rewrite a checkpoint file with symlinks added to its workspace archive."""
    import io
    import tarfile

    with tarfile.open(ckpt, "r:gz") as tar:
        blobs = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    inner = io.BytesIO(blobs["workspace.tar"])
    out = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="r:") as src, tarfile.open(fileobj=out, mode="w:") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            dst.addfile(info)
    blobs["workspace.tar"] = out.getvalue()
    with tarfile.open(ckpt, "w:gz") as tar:
        for name, blob in blobs.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


# -- ledger -----------------------------------------------------------------------------------------


def _running(folder: Path, ids: list[str]) -> bool:
    """Whether the ledger in ``folder`` has each of ``ids`` running."""
    from smolbench.ledger import Ledger

    if not (folder / ".smolbench" / "ledger.db").exists():
        return False
    ledger = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        rows = {r["id"]: r["status"] for r in ledger.node_rows()}
    finally:
        ledger.close()
    return all(rows.get(i) == "running" for i in ids)


def test_rows_left_running_by_a_dead_kernel_are_marked_lost_at_the_next_start(tmp_path: Path) -> None:
    import time

    from smolbench.ledger import Ledger

    with NotebookSession(tmp_path, allow_errors=True, check_processes=False) as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend sandbox")
        nb.run("%%smol fork 3 --bg\nimport time\ntime.sleep(60)")
        deadline = time.monotonic() + 120  # its branches run (a loaded host takes a while to fork them)
        while not _running(tmp_path, [f"root.{i}" for i in range(3)]):
            assert time.monotonic() < deadline, "the fork's branches never ran"
            time.sleep(0.1)
        nb.kill()  # kill -9: nothing of ours runs to tidy up
    ledger = Ledger(tmp_path / ".smolbench" / "ledger.db")
    before = {r["id"]: r for r in ledger.node_rows()}
    assert {before[f"root.{i}"]["status"] for i in range(3)} == {"running"}
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        cell = nb.run("%smol up --backend sandbox")
        assert "4 nodes were left unfinished by a kernel that died earlier: marked lost" in stream_text(cell)
        nb.run("%smol down")
    rows = [r for r in ledger.node_rows() if r["session_id"] == before["root.0"]["session_id"]]
    for r in rows:
        assert r["status"] == "lost" and not r["alive"], r
        assert r["ended"] == before[r["id"]]["seen"] and "last seen" in r["error"]
    assert {r["status"] for r in ledger.run_rows() if r["session_id"] == rows[0]["session_id"]} == {"lost"}


# -- floods -----------------------------------------------------------------------------------------

FLOOD = "%%smol\nfor i in range(200000):\n    print('line %06d ' % i + 'x' * 40)"  # 10.4 MB


def test_output_floods_are_cut_to_a_budget_and_the_rest_logged(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        nb.run("%smol config output-limit 100K")
        nb.run("%smol config log-limit 1M")
        cell = nb.run(FLOOD)
        out, err = stream_text(cell), stream_text(cell, "stderr")
        assert len(out.encode()) <= 100_000 and out.startswith("line 000000 ") and out.endswith("\n")
        [log] = (tmp_path / ".smolbench" / "outputs").glob("root.cell2-*.log")  # the session's own
        assert re.search(r"^… 1\d MB more output not shown \(the first 1\.0 MB of it saved to "
                         + re.escape(str(log.relative_to(tmp_path))) + r"\)$", err, re.MULTILINE), err
        assert log.stat().st_size == 1_000_000  # the log is bounded too
        assert log.read_bytes().startswith(b"line 00")
        still_works(nb)

        # one huge line is cut with a note; no traceback from the transport
        nb.run("%smol config output-limit 5M")
        cell = nb.run("%%smol\nprint('x' * 10**8)\nprint('after')")
        out = stream_text(cell)
        assert out.startswith("x" * 1000) and "… [line cut: 99,737,856 more characters]\nafter\n" in out
        assert error_output(cell) is None and "Separator" not in str(cell.outputs)

        # a hostile agent ignores batching and floods raw frames: the host's budget still holds
        nb.run("%smol config output-limit 100K")
        cell = nb.run("%%smol\nframe = (json.dumps({'t': 'stream', 'name': 'stdout', 'text': 'z' * 1000 + '\\n'}) + '\\n').encode()\n"
                      "_ag._conn.sendall(frame * 20000)")
        assert len(stream_text(cell).encode()) <= 100_000 and "more output not shown" in stream_text(cell, "stderr")

        # Weakened: with no per-cell limit, the whole flood lands in the notebook
        nb.run("%smol config output-limit 1G")
        cell = nb.run(FLOOD)
        assert len(stream_text(cell).encode()) > 10_000_000
        nb.run("%smol down")


def test_ctrl_c_stops_a_flood_of_lines(tmp_path: Path) -> None:
    import threading
    import time

    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        cells, sent = len(nb.nb.cells), []

        def interrupt_once_it_floods() -> None:  # 3 s into its flood (its first lines have come back)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (len(nb.nb.cells) > cells and nb.nb.cells[cells].outputs):
                time.sleep(0.02)
            time.sleep(3)
            sent.append(time.monotonic())
            nb.interrupt()

        t = threading.Thread(target=interrupt_once_it_floods)
        t.start()
        # 10**8 lines of 100 bytes: still pouring out when Ctrl-C comes, however fast the host
        cell = nb.run("%%smol\nfor i in range(10**8):\n    print('y' * 99)")
        t.join()
        took = time.monotonic() - sent[0]
        err = error_output(cell)
        assert err is not None and err.ename == "KeyboardInterrupt", cell.outputs
        assert "the machine and its state are kept" in err.evalue
        print(f"flooding cell returned {took:.2f} s after its Ctrl-C")  # numbers: bench/flood.py
        still_works(nb)
        nb.run("%smol down")


# -- timeouts ---------------------------------------------------------------------------------------

IGNORES_SIGINT = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.01)"


def test_a_cell_that_ignores_the_interrupt_is_killed_and_the_user_told(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend sandbox")
        nb.run("import smolbench\nwb = smolbench._magics.workbench")
        # a branch: it times out and its machine is deleted
        nb.run(f"%%smol fork 2 --timeout 2 --allow-errors --keep all\n{IGNORES_SIGINT}")
        rows = stream_text(nb.run("print([(r['status'], r['error']) for r in smolbench._magics.last_result.rows.values()],"
                                  " sorted(m.name for m in wb.backend.list()))"))
        assert rows.count("('timeout', 'timed out after 2 s')") == 2 and rows.endswith("['root']\n")
        # an active kept branch: killed, and its parent takes over
        nb.run("%%smol fork 1 --keep all\nreward = 1")
        nb.run("%smol use root.2")
        msg = one_line_error(nb.run(f"%%smol --timeout 1\n{IGNORES_SIGINT}"))
        assert msg.endswith("so machine root.2 was killed: its state is lost; the active machine is now root "
                            "(its state from when root.2 was forked)"), msg
        # the active root: it is killed, the error says its state is gone, and a fresh machine takes over
        before = {p.pid for p in nb.processes()}
        msg = one_line_error(nb.run(f"%%smol --timeout 2\nx = 1\n{IGNORES_SIGINT}"))
        assert msg == ("the cell ran longer than --timeout 2 s and ignored the interrupt for 3 s, so machine root "
                       "was killed: its state is lost; a fresh machine fresh1 from the default spec (no Smolfile) is up "
                       "and active (its variables start empty)")
        assert not before & {p.pid for p in nb.processes()}  # the old machine is gone: no core still burning
        assert stream_text(nb.run("print(sorted(m.name for m in wb.backend.list()), wb.active)")) == "['fresh1'] fresh1\n"
        assert result_text(nb.run("%%smol\n'x' in globals(), 6 * 7")) == "(False, 42)"
        nb.run("%smol down")
        nb.run("%smol up --backend sandbox")

        # Weakened: if the host believed the interrupt worked, the machine would still be
        # burning a core and refuse the next cell as busy
        nb.run("import smolbench\nwb = smolbench._magics.workbench\n"
               "async def _believe(ref, task):\n    return True\nwb._stop = _believe")
        msg = one_line_error(nb.run(f"%%smol --timeout 1\n{IGNORES_SIGINT}"))
        assert msg == "the cell ran longer than --timeout 1 s and was interrupted"
        assert "is busy running another cell" in one_line_error(nb.run("%%smol\n1"))
        assert nb.processes() != []
        nb.run("%smol down")


# -- the smol backend's relay feeds the same gate ---------------------------------------------------


@pytest.fixture
def smol_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    # the SDK double of tests/test_smol_backend.py: the real agent and relay behind it
    from fakesmol import fake_host

    yield from fake_host(monkeypatch)


def test_the_smol_relay_is_gated_too(smol_host: object) -> None:
    """On a microVM the agent's replies come back as client.py's stdout through exec_stream:
    the same hostile frames and pulls are refused there."""
    import asyncio

    from smolbench.backends.base import CellRequest
    from smolbench.backends.smol import SmolBackend
    from smolbench.gate import MalformedReply
    from smolbench.spec import MachineSpec

    hijack = "import sys, base64, pickle\n_ag = sys.modules['smolbench_guest']._agent\n"
    b = SmolBackend(probe=False, session="t")

    async def main() -> list[str]:
        ref = await b.create(MachineSpec(), "root")
        seen = []
        try:
            for code, pull in [
                ("_ag._conn.sendall(b'{\"t\": \"stream\", \"name\": \"stdout\", \"text\": 1}\\n')", []),
                ("_ag._conn.sendall(b'{\"t\": \"done\", \"status\": \"ok\", \"reward\": NaN}\\n')", []),
                ("x = 1\nimport importlib\nimportlib.import_module('_smolbench_guest.pulldata')._pull = lambda v, t: {'format': 'pickle', "
                 "'data': base64.b64encode(pickle.dumps(v)).decode()}", ["x"]),
            ]:
                try:
                    await b.exec_cell(ref, CellRequest(hijack + code, pull=pull), lambda e: None)
                except MalformedReply as exc:
                    seen.append(str(exc))
                await asyncio.sleep(0.3)
        finally:
            await b.close()
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 120))
    assert seen == [
        "machine root sent a malformed reply: the stream text should be text, got a int",
        "machine root sent a malformed reply: a non-finite number (NaN)",
        "machine root sent a malformed reply: --pull x came back as a pickle, but pulls are data-only (no --pull-trusted)",
    ]


# -- fuzz: whatever the bytes, the gate answers with a result or one line -------------------------


def test_mutated_replies_never_escape_the_gate_as_anything_but_one_line() -> None:
    import asyncio
    import json
    import random

    from smolbench.backends.base import CellRequest
    from smolbench.errors import SmolbenchError
    from smolbench.gate import read_cell

    good = [
        {"t": "stream", "name": "stdout", "text": "hello\n"},
        {"t": "display", "data": {"text/html": "<b>x</b>", "text/plain": "x", "image/png": PNG}},
        {"t": "done", "status": "ok", "result": {"text/plain": "1"}, "error": None,
         "pulled": {"v": {"format": "data", "data": {"$": "dataframe", "columns": ["a"], "index": {"$": "range", "start": 0, "stop": 2, "step": 1, "name": None},
                                                      "data": [{"dtype": "int64", "values": [1, 2]}]}}},
         "reward": 1.5, "metrics": {"m": 2}, "reward_error": None, "stdout": "", "stderr": "", "started": 1.0, "ended": 2.0},
    ]
    base = b"".join(json.dumps(m).encode() + b"\n" for m in good)
    rng = random.Random(9)
    atoms = [b"NaN", b"1e999", b"true", b"[]", b"{}", b"\"\"", b"-1", b"null", b"\n", b"\xff", b"{\"$\":\"npy\",\"v\":\"AA==\"}",
             b"{\"$\":\"series\"}", b"{\"$\":\"dict\",\"v\":[[[1],2]]}", b"9" * 400]

    async def feed(data: bytes) -> None:
        async def chunks():  # type: ignore[no-untyped-def]
            for i in range(0, len(data), 97):
                yield data[i:i + 97]

        await read_cell(chunks(), CellRequest("x", pull=["v"]), lambda ev: None, "root.3", scope="t")

    outcomes = {"ok": 0, "refused": 0}
    for _ in range(600):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            if rng.random() < 0.5:
                data[at:at + rng.randint(1, 12)] = rng.choice(atoms)
            else:
                data[at] = rng.randrange(256)
        try:
            asyncio.run(feed(bytes(data)))
            outcomes["ok"] += 1
        except SmolbenchError as exc:  # anything else is a crash of the host's own code
            assert "\n" not in str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 300, outcomes


def test_run_folder_files_are_read_without_following_links_or_blocking_on_fifos(tmp_path: Path) -> None:
    """A machine can write in its run folder (its socket, ready file, log and owner record
    live there): a fifo or a link planted there must neither hang nor leak to the host."""
    import os
    import threading

    from smolbench.backends._rundir import OWNER, owner_alive
    from smolbench.gate.archive import read_small

    secret = tmp_path / "secret"
    secret.write_text(f"{os.getpid()} x\n")
    run = tmp_path / "smolbench-run"
    run.mkdir()
    os.mkfifo(run / OWNER)
    assert owner_alive(run) is None  # at once: not a plain file
    # Weakened: an ordinary read of the same fifo blocks until someone writes to it
    blocked = threading.Thread(target=(run / OWNER).read_text, daemon=True)
    blocked.start()
    blocked.join(1.0)
    assert blocked.is_alive()
    with open(run / OWNER, "w") as fh:  # release it
        fh.write("")
    blocked.join(5)
    (run / OWNER).unlink()
    (run / OWNER).symlink_to(secret)
    assert owner_alive(run) is None and read_small(run / OWNER) is None
    assert (run / OWNER).read_text() == secret.read_text()  # what following the link would have read


XSS_VECTORS = [
    "<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "<svg onload=alert(1)>",
    "<svg><a xlink:href=\"javascript:alert(1)\"><text>x</text></a></svg>",
    "<svg><animate onbegin=alert(1) attributeName=x dur=1s>", "<svg><set attributeName=href to=javascript:alert(1)>",
    "<math><mtext><table><mglyph><style><img src=x onerror=alert(1)>", "<iframe srcdoc=\"<script>alert(1)</script>\">",
    "<object data=\"javascript:alert(1)\">", "<embed src=\"javascript:alert(1)\">", "<base href=\"javascript:/\">",
    "<meta http-equiv=\"refresh\" content=\"0;url=javascript:alert(1)\">", "<details open ontoggle=alert(1)>",
    "<a href=\"jAvAsCrIpT:alert(1)\">x</a>", "<a href=\"java&#x09;script:alert(1)\">x</a>",
    "<a href=\" javascript:alert(1)\">x</a>", "<img srcset=\"x 1x\" onerror=alert(1)>",
    "<link rel=stylesheet href=\"http://127.0.0.1:1/x.css\">", "<style>@import 'http://127.0.0.1:1/x.css';</style>",
    "<div style=\"background:url(javascript:alert(1))\">x</div>", "<body onload=alert(1)>",
    "<noscript><p title=\"</noscript><img src=x onerror=alert(1)>\">", "<template><script>alert(1)</script></template>",
    "<input autofocus onfocus=alert(1)>", "<video><source onerror=alert(1)></video>",
    "<a href=\"data:text/html,<script>alert(1)</script>\">x</a>", "<img src=\"data:text/html,<script>alert(1)</script>\">",
]


@pytest.mark.parametrize("vector", XSS_VECTORS)
def test_known_xss_vectors_are_cleaned_from_html_and_svg(vector: str) -> None:
    from smolbench.gate.display import clean_html, clean_svg, markdown_to_html

    for out in (clean_html(vector), clean_svg(vector), markdown_to_html(vector)):
        low = out.lower()
        assert "<script" not in low and "javascript:" not in low and "127.0.0.1" not in low, out
        assert not re.search(r"<[^>]*\son[a-z]+\s*=", low), out  # no event handler survives
        for tag in ("<iframe", "<object", "<embed", "<base", "<meta", "<link", "<animate", "<set", "<input"):
            assert tag not in low, out
        assert "data:text/html" not in low, out


# -- issue 17: output that fetches, CSS that escapes its output ----------------------------------

WATCHED = "http://127.0.0.1:1"  # stands in for the attacker's server; page-relative URLs read Jupyter's
FETCHING = (
    "%%smol\nW = " + repr(WATCHED) + "\n"
    "LEAK = {'data': {'url': '/api/contents/secret.ipynb'}, 'mark': 'image',\n"
    "        'encoding': {'url': {'value': W + '/vega-image'}}}\n"
    "bundles = [\n"
    "  {'application/vnd.vegalite.v5+json': LEAK, 'text/plain': 'vl5'},\n"
    "  {'application/vnd.vegalite.v4+json': LEAK, 'application/vnd.vegalite.v3+json': LEAK, 'text/plain': 'vl'},\n"
    "  {'application/vnd.vega.v5+json': {'data': [{'name': 't', 'url': '/api/sessions'}]}, 'text/plain': 'vega'},\n"
    "  {'application/geo+json': {'type': 'Point', 'coordinates': [0, 0]}, 'text/plain': 'geo'},\n"
    "  {'application/pdf': 'JVBERi0=', 'text/latex': '$\\\\href{' + W + '/tex}{x}$',\n"
    "   'application/vdom.v1+json': {'tagName': 'img', 'attributes': {'src': W + '/vdom'}},\n"
    "   'application/vnd.jupyter.widget-view+json': {'model_id': 'x', 'version_major': 2}, 'text/plain': 'misc'},\n"
    "  {'text/html': '<p class=\"css\" style=\"background-image: image-set(url(' + W + '/img-set) 1x); color: red\">a</p>'\n"
    "     '<p style=\"cursor: -webkit-image-set(url(' + W + '/cursor) 1x), auto\">b</p>'\n"
    "     '<ul style=\"list-style: url(' + W + '/list)\"><li>c</li></ul>'\n"
    "     '<p style=\"background: u\\\\72l(' + W + '/escaped)\">d</p>'\n"
    "     '<style>.x { background: image-set(\"' + W + '/style-block\" 1x) } .jp-Toolbar { display: none }</style>'\n"
    "     '<a style=\"position: fixed; inset: 0; z-index: 99999\" href=\"' + W + '/expired\">session expired</a>'\n"
    "     '<div class=\"jp-Dialog lm-Widget mine\" id=\"jp-main-dock-panel\">e</div>'\n"
    "     '<table background=\"' + W + '/table\"><tr><td>t</td></tr></table>'\n"
    "     '<a href=\"/api/contents/secret.ipynb\">rel</a><img src=\"files/secret.png\">'\n"
    "     '<b style=\"font-family: \\'x\\n; position: fixed; top: 0; z-index: 2147483647\">bad string</b>'},\n"
    "  {'image/svg+xml': '<svg xmlns=\"http://www.w3.org/2000/svg\"><style>rect{fill:url(' + W + '/svg-style)}</style>'\n"
    "     '<image href=\"' + W + '/svg-image\"/><use href=\"' + W + '/svg-use#a\"/>'\n"
    "     '<rect width=\"5\" height=\"5\" style=\"fill: url(' + W + '/svg-attr)\"/><circle r=\"2\" fill=\"blue\"/></svg>'},\n"
    "  {'text/markdown': '![i](/api/contents/secret.ipynb) [l](/files/secret.txt) ![j](' + W + '/md-image) [ok](https://example.org/)'},\n"
    "  {'text/markdown': '<div style=\"font-family: \\'x\\r\\n; position: fixed; inset: 0\">md overlay</div>'},\n"
    "  {'application/vnd.plotly.v1+json': {\n"
    "     'data': [{'type': 'bar', 'x': ['a'], 'y': [1], 'text': ['<span style=\"cursor: url(' + W + '/plotly-text)\">t</span>']},\n"
    "              {'type': 'image', 'source': W + '/plotly-trace'}, {'type': 'choropleth', 'geojson': '/api/contents/x'}],\n"
    "     'layout': {'images': [{'source': W + '/plotly-image'}], 'mapbox': {'style': W + '/plotly-style'},\n"
    "                'template': {'layout': {'images': [{'source': '/files/secret.png'}]}}},\n"
    "     'frames': [{'layout': {'images': [{'source': W + '/plotly-frame'}]}}],\n"
    "     'config': {'topojsonURL': W + '/topojson/', 'responsive': True}}},\n"
    "  {'application/vnd.plotly.v1+json': {'data': [{'type': 'bar', 'x': ['a'], 'y': [1], 'name': '<a x=\"b\"href=\"/api/contents/secret.ipynb\">legend</a>'}],\n"
    "     'layout': {'title': {'text': '<b x=\"a\"style=\"cursor: \\\\75 rl(' + W + '/plotly-escaped)\">t</b>'}, 'xaxis': {'title': {'text': '<b>axis</b>'}},\n"
    "                'annotations': [{'text': '<a x=\"b\"href=\"/files/secret.txt\">note</a>', 'x': 'a', 'y': 1}]},\n"
    "     'config': {'topojsonURL': W + '/topojson/', 'responsive': True}}},\n"
    "]\n"
    "for b in bundles:\n    _ag.send({'t': 'display', 'data': b})"
)


def _shown(cell: object) -> str:
    import json

    outs = [o for o in cell.outputs if o.output_type in ("display_data", "execute_result")]  # type: ignore[attr-defined]
    return json.dumps([o["data"] for o in outs])


def test_output_that_could_fetch_is_refused_or_stripped_and_css_stays_in_its_output(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        up(nb)
        cell = nb.run(FETCHING)
        raw = _shown(cell)
        link = f'href=\\"{WATCHED}/expired\\"'  # an absolute link stays: only a click follows it
        assert link in raw
        raw = raw.replace(link, "")
        # nothing that names a URL to fetch, or the Jupyter server's own paths, reaches the browser
        for bad in ("127.0.0.1", "/api/", "/files/", "url(", "image-set", "<style", "position", "jp-Dialog",
                    "lm-Widget", "\"jp-main-dock-panel\"", "topojsonURL"):
            assert bad not in raw, (bad, raw)
        notes = stream_text(cell, "stderr")
        for mime in ("application/vnd.vegalite.v5+json", "application/vnd.vegalite.v4+json",
                     "application/vnd.vegalite.v3+json", "application/vnd.vega.v5+json", "application/geo+json",
                     "application/pdf", "text/latex", "application/vdom.v1+json",
                     "application/vnd.jupyter.widget-view+json"):
            assert f"sent {mime} output, which was not shown" in notes, (mime, notes)
        # ... while what is harmless still shows: the fallbacks, the colour, the shapes, the data
        for good in ('"vl5"', '"vega"', '"geo"', "color: red", "session expired", "mine", "<circle", "bad string",
                     "md overlay", '"<b>axis</b>"', '"name": "legend"', '"text": "note"',
                     "https://example.org/", '"type": "bar"', '"responsive": true'):
            assert good in raw, (good, raw)
        still_works(nb)

        # Weakened: trusted mode shows the same bundles raw, URLs and all (what the gate stops)
        nb.run("%smol trust on")
        raw = _shown(nb.run(FETCHING))
        assert "application/vnd.vegalite.v5+json" in raw and "/api/contents/secret.ipynb" in raw
        assert f"{WATCHED}/plotly-image" in raw and "image-set" in raw and "<style" in raw
        nb.run("%smol trust off")
        nb.run("%smol down")


CSS_VECTORS = [
    "<p style=\"background-image: image-set('http://127.0.0.1:1/a' 1x)\">x</p>",
    "<p style=\"background: -webkit-image-set(url(http://127.0.0.1:1/a) 1x)\">x</p>",
    "<p style=\"cursor: url(http://127.0.0.1:1/a), auto\">x</p>",
    "<ul style=\"list-style-image: url(http://127.0.0.1:1/a)\"><li>x</li></ul>",
    "<p style=\"border-image: url(http://127.0.0.1:1/a) 30\">x</p>",
    "<p style=\"mask: url(http://127.0.0.1:1/a)\">x</p>",
    "<p style=\"background: URL ( http://127.0.0.1:1/a )\">x</p>",
    "<p style=\"background: u\\rl(http://127.0.0.1:1/a)\">x</p>",
    "<p style=\"color: red; background: &#117;rl(http://127.0.0.1:1/a)\">x</p>",
    "<p style=\"background: image(http://127.0.0.1:1/a)\">x</p>",
    "<p style=\"content: url(http://127.0.0.1:1/a)\">x</p>",
    "<p style=\"color:red;/**/background:url(http://127.0.0.1:1/a)\">x</p>",
    "<p style=\"position: fixed; top: 0\">x</p>", "<p style=\"position:absolute\">x</p>",
    "<p style=\"transform: translate(-900px, -900px) scale(40)\">x</p>", "<p style=\"margin-top: -5000px\">x</p>",
    "<p style=\"z-index: 100000\">x</p>", "<p style=\"inset: 0\">x</p>",
    "<style>@import 'http://127.0.0.1:1/a';</style>", "<style>body { display: none }</style>",
    "<svg><style>*{fill:url(http://127.0.0.1:1/a)}</style></svg>",
    "<div class=\"jp-Dialog\">x</div>", "<div class=\"lm-Menu p-Widget\">x</div>",
    "<a href=\"/api/contents/x\">x</a>", "<a href=\"//127.0.0.1:1/a\">x</a>", "<a href=\"api/sessions\">x</a>",
    "<img src=\"/files/secret.png\">", "<img src=\"data:image/png;base64,AA== 1x, http://127.0.0.1:1/a\">",
    "<img srcset=\"http://127.0.0.1:1/a 1x\">", "<table background=\"http://127.0.0.1:1/a\"><tr><td>x</td></tr></table>",
]


@pytest.mark.parametrize("html", CSS_VECTORS)
def test_css_and_links_in_markup_can_neither_fetch_nor_leave_the_output(html: str) -> None:
    from smolbench.gate.display import clean_html, clean_svg, markdown_to_html

    for out in (clean_html(html), clean_svg(html), markdown_to_html(html)):
        low = out.lower()
        for bad in ("127.0.0.1", "url", "image-set", "image(", "<style", "position", "transform", "z-index",
                    "inset", "-5000", "jp-", "lm-", "p-widget", "/api/", "/files/", "api/sessions", "srcset",
                    "background="):
            assert bad not in low, (bad, out)
