"""Bad input gets one line naming the problem and the fix (round 4's input fuzz: ~570 inputs).

What the fuzz found: a seed too big for the ledger failed the fork after its parent was
claimed (every later cell said "root is busy" until `%smol down`); the public API's wrong
types surfaced as TypeError/AttributeError from deep inside; quotes stayed in option values;
a corrupt ledger, `--ledger .`, `~nosuchuser` and volumes over the machine's own folders gave
tracebacks or errors that named nothing; `smolbench serve` printed tracebacks; Ray was
retried for minutes at an address where nothing listens.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nbhelpers import NotebookSession, ok, one_line, result_text, stream_text

import smolbench
from smolbench import SmolbenchError
from smolbench.ledger import Ledger

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[smolbench.Session]:
    folder = tmp_path_factory.mktemp("bad-input")
    with smolbench.Session(backend="sandbox", ledger=folder / "ledger.db") as s:
        yield s


CALLS: list[tuple[str, Any, str]] = [
    ("fork seed_base too big", lambda s: s.fork(2, "reward = 1", seed_base=10**29), "seed_base must be from"),
    ("fork a seed too big", lambda s: s.fork(2, "reward = 1", seeds=[10**29, 1]), "each of seeds must be from"),
    ("fork seeds as text", lambda s: s.fork(2, "reward = 1", seeds="0:2"), "seeds must be a list of whole numbers"),
    ("fork float seed_base", lambda s: s.fork(2, "reward = 1", seed_base=1.5), "seed_base must be a whole number"),
    ("fork code not str", lambda s: s.fork(2, 5), "code must be Python source as a str"),
    ("fork concurrency text", lambda s: s.fork(2, "x = 1", concurrency="2"), "concurrency must be a whole number"),
    ("fork retries -1", lambda s: s.fork(2, "x = 1", retries=-1), "retries must be at least 0"),
    ("fork on_output", lambda s: s.fork(2, "x = 1", on_output=5), "on_output must be a function"),
    ("run bytes", lambda s: s.run(b"x = 1"), "code must be Python source as a str"),
    ("run push list", lambda s: s.run("x = 1", push=[("a", 1)]), "push must be a dict"),
    ("run pull number", lambda s: s.run("x = 1", pull=[1]), "is not a variable name"),
    ("save name number", lambda s: s.checkpoint_save(5), "name must be a str"),
]


@needs_bwrap
@pytest.mark.parametrize("what, call, said", CALLS, ids=[c[0] for c in CALLS])
def test_the_api_s_wrong_arguments_are_one_line_and_leave_the_machine_usable(
        session: smolbench.Session, what: str, call: Any, said: str) -> None:
    with pytest.raises(SmolbenchError) as err:
        call(session)
    assert "\n" not in str(err.value) and said in str(err.value), str(err.value)
    # the attack on the old code: the machine stayed claimed by a fork that never started
    assert session.run("print(2 + 2)").stdout == "4\n"
    assert not [n for n in session.workbench.tree if n.status == "starting"]  # type: ignore[union-attr]


@needs_bwrap
def test_a_pull_given_as_text_is_names_not_letters(session: smolbench.Session) -> None:
    res = session.run("data = 1\nenv = 2", pull="data,env")
    assert res.pulled == {"data": 1, "env": 2}


@pytest.mark.parametrize("kw, said", [
    ({"smolfile": 5}, "smolfile must be a file path"), ({"ledger": 5}, "ledger must be a file path"),
    ({"retries": "x"}, "retries must be a whole number"), ({"max_alive": "3"}, "max_alive must be a whole number"),
    ({"image": 5}, "image must be a str"),
])
def test_a_session_s_wrong_options_are_one_line(kw: dict[str, Any], said: str) -> None:
    with pytest.raises(SmolbenchError, match=said):
        smolbench.Session(**kw)


def test_an_allow_list_can_be_a_list() -> None:
    assert smolbench.Session(allow=["pypi.org", "10.0.0.0/8"]).allow == "pypi.org,10.0.0.0/8"


def test_a_ledger_that_is_not_one_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "ledger.db"
    bad.write_bytes(b"not a database, just some bytes" * 100)
    with pytest.raises(SmolbenchError, match=r"is not a smolbench ledger \(file is not a database\): move it aside"):
        Ledger(bad)
    with pytest.raises(SmolbenchError, match="is a folder: name a file"):
        Ledger(tmp_path)
    with pytest.raises(SmolbenchError, match="is a folder: name a file"):
        Ledger(".")


@pytest.mark.parametrize("text, said", [
    ('image = "~nosuchuser1234/rootfs"\n', "'image' '~nosuchuser1234/rootfs': no user 'nosuchuser1234'"),
    ('[[volumes]]\nhost = "~nosuchuser1234/d"\nguest = "/data"\n', "volume 1 'host' '~nosuchuser1234/d': no user"),
    ('[[volumes]]\nhost = "d"\nguest = "/run/smolbench"\n', "is where the machine keeps its own /run/smolbench"),
    ('[[volumes]]\nhost = "d"\nguest = "/proc/x"\n', "is where the machine keeps its own /proc"),
    ('[[volumes]]\nhost = "d"\nguest = "/run"\n', "is where the machine keeps its own /run/smolbench"),
])
def test_smolfile_paths_that_can_t_be_used_are_one_line(tmp_path: Path, text: str, said: str) -> None:
    from smolbench.smolfile import load_smolfile

    (tmp_path / "d").mkdir()
    (tmp_path / "Smolfile").write_text(text)
    with pytest.raises(SmolbenchError) as err:
        load_smolfile(str(tmp_path / "Smolfile"))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_limits_past_their_ceiling_are_refused() -> None:
    from smolbench.gate import limits

    try:
        for key, value, said in (("max-frame", "99999999999999999999999G", "(1000 GB)"), ("grace", "7200", "(3600 s)"),
                                 ("displays", "2M", "(1,000,000)")):
            with pytest.raises(SmolbenchError, match=f"above the most it can be set to {said}".replace("(", r"\(")
                               .replace(")", r"\)")):
                limits.configure(key, value)
        assert limits.LIMITS.max_frame == limits.Limits().max_frame
    finally:
        limits.reset()


def test_a_ray_address_where_nothing_listens_is_one_line_at_once() -> None:
    pytest.importorskip("ray")
    from smolbench.cluster import address

    with socket.socket() as s:  # a port nothing listens on (bound, not listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(SmolbenchError, match=f"can't join the Ray cluster at 127.0.0.1:{port}: nothing answered"):
            address.connect(f"127.0.0.1:{port}")


def test_an_image_suite_is_a_suite_name_before_debootstrap_sees_it() -> None:
    from smolbench.images import build_debian_rootfs

    for suite in ("--version", "", "../../x"):
        with pytest.raises(SmolbenchError, match="is not a Debian suite name"):
            build_debian_rootfs("test:y", suite=suite, log=lambda line: None)


@needs_bwrap
@pytest.mark.tier2  # second tier: a served env (tests/conftest.py SECOND_TIER)
def test_serve_s_bad_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    pytest.importorskip("openenv")
    for args, said in ((["--gym", "CartPole-v1", "--port", "99999"], "--port should be from 1 to 65535 (or 0: any free one)"),
                       (["--gym", "CartPole-v1", "--smolfile", str(tmp_path / "none")], "no Smolfile at"),
                       (["--gym", "NoSuchEnv-v0", "--backend", "sandbox"], "the env could not be built"),
                       # checked as smolbench.gym.make checks an id, before a machine is up
                       (["--gym", "Cart Pole", "--backend", "sandbox"], "--gym 'Cart Pole' is not a gymnasium id"),
                       (["--gym", "CartPol-v1", "--backend", "sandbox"], "no env 'CartPol-v1': did you mean 'CartPole-v1'?")):
        # any free port (the port is bound first: 8000, the default, may be another's here)
        args = [*args, "--port", "0"] if "--port" not in args else args
        got = subprocess.run([sys.executable, "-m", "smolbench.cli", "serve", *args], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert got.returncode == 2, got
        lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("smolbench serve: ") and said in lines[0], got.stderr


def test_serve_s_target_after_the_colon_must_be_a_plain_name(tmp_path: Path) -> None:
    """``corridor.py:Corridor.reset`` got the generic "say what to serve" line."""
    (tmp_path / "corridor.py").write_text("class Corridor:\n    def reset(self): ...\n")
    got = subprocess.run([sys.executable, "-m", "smolbench.cli", "serve", "corridor.py:Corridor.reset", "--port", "0"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert got.returncode == 2, got
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
    assert lines == ["smolbench serve: corridor.py:Corridor.reset: the part after ':' must be a plain name, a "
                     "zero-argument callable defined at the top level of corridor.py that makes the env (e.g. "
                     "corridor.py:Corridor; wrap anything else in a function there)"], got.stderr


def refusal(cell: Any) -> str:
    """The one line a magic refused with: an error, or IPython's UsageError line on stderr."""
    if any(o.output_type == "error" for o in cell.outputs):
        return one_line(cell)
    lines = [ln for ln in stream_text(cell, "stderr").splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: "), cell.outputs
    return lines[0]


@needs_bwrap
def test_magics_take_quotes_negative_seeds_and_say_one_line(tmp_path: Path) -> None:
    (tmp_path / "sub dir").mkdir()
    (tmp_path / "sub dir" / "Smolfile").write_text('[env]\nWHERE = "sub dir"\n')
    with NotebookSession(tmp_path, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        assert "Run notebook cells inside" in stream_text(ok(nb.run("%smol help")))
        ok(nb.run('%smol up --backend sandbox --smolfile "sub dir/Smolfile"'))  # quotes as a shell takes them
        assert result_text(ok(nb.run("%%smol\nimport os\nos.environ['WHERE']"))) == "'sub dir'"
        out = ok(nb.run("%%smol fork 2 --seeds -5:-3 --keep none --quiet\nreward = SEED"))
        assert "2 ok" in stream_text(out), stream_text(out)
        line = one_line(nb.run("%%smol fork 2 --seed-base 99999999999999999999999999999\nreward = 1"))
        assert "seed_base must be from" in line, line
        ok(nb.run("%%smol\nprint('still mine')"))  # not "root is busy"
        for cell, said in (("%%smol fork 2 --out 1bad\nreward = 1", "--out '1bad' is not a variable name"),
                           ("%%smol episodes 2 --keep all\nreward = 1", "--keep is for forks"),
                           ("%smol ledger -n 0", "-n must be at least 1"),
                           ("%smol status extra", "%smol status takes no arguments"),
                           ("%smol checkpoint save good extra", "takes one name, got also 'extra'"),
                           ("%%smol --pull nosuch\nx = 1", "NameError: no variable named 'nosuch' in the machine to pull")):
            assert said in refusal(nb.run(cell)), cell
        ok(nb.run("%smol down"))


def test_the_argument_parser_keeps_empty_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from smolbench._magicargs import _up_args, parse_argstring

    args: argparse.Namespace = parse_argstring(_up_args, '--allow "" --ledger "a b.db"')
    assert args.allow == "" and args.ledger == "a b.db"


def test_a_smolfile_saved_with_a_byte_order_mark_is_read() -> None:
    from smolbench.smolfile import parse_smolfile

    assert dict(parse_smolfile('\ufeff[env]\nA = "x"\n').env) == {"A": "x"}
