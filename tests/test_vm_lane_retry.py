"""The VM lane's record of a boot that stalls, and its retry of what did not pass.

A lane boot can die half-way (a nested-stack stall: L1 stops and the host kills it). What
ran before must be kept, the retry must run only what did not pass (a chain of steps that
share a machine runs again from its start), and the summary must say exactly what happened.
Here the "boot" is a pytest run with the lane's plugin that ends with ``os._exit`` mid-way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VM = Path(__file__).parent / "vm"

SUITE = '''
import os
import pytest

step = pytest.mark.chain("one machine")

def die_at(name):
    if os.environ.get("DIE_AT") == name:
        os._exit(3)  # the boot stops here, the way a stalled L1 is killed

@step
def test_a1(): die_at("a1")
@step
def test_a2(): die_at("a2")
@step
def test_a3(): die_at("a3")
def test_b(): die_at("b")
def test_c(): die_at("c")
'''


def boot(tmp: Path, n: int, die_at: str = "", select: str = "") -> list[str]:
    """One lane 'boot': the suite with the plugin (``select``: VMLANE_SELECT, a -k); returns
    the tests it ran."""
    attempt = tmp / "out" / f"attempt-{n}"
    attempt.mkdir(parents=True)
    passed = tmp / "passed.txt"
    passed.write_text(summary("passed", tmp / "out").stdout)
    env = dict(os.environ, PYTHONPATH=str(VM / "guest"), DIE_AT=die_at,
               VMLANE_OUTCOMES=str(attempt), VMLANE_PASSED=str(passed))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "vmlane_results", "-q",
                          "-p", "no:cacheprovider", "-o", "markers=chain", "test_suite.py",
                          *(["-k", select] if select else [])],
                         cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    (attempt / "verdict").write_text("stall: L1 idle" if die_at else f"pytest rc={run.returncode}")
    return [x.split()[0].split("::")[1] for x in (attempt / "outcomes.txt").read_text().splitlines()]


def summary(*args: object, select: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, VMLANE_SELECT=select)
    return subprocess.run([sys.executable, str(VM / "summary.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60, env=env)


def test_a_stall_keeps_what_passed_and_the_retry_runs_only_the_rest(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    assert boot(tmp_path, 1, die_at="b") == ["test_a1", "test_a2", "test_a3"]
    assert boot(tmp_path, 2) == ["test_b", "test_c"]
    line = summary("line", tmp_path / "out", 900, 3)
    assert line.returncode == 0, line.stdout
    assert line.stdout.startswith("vm lane: 5 passed, 0 failed, 0 skipped, 0 not run in 900 s")
    assert "2 boots, 1 stall;" in line.stdout
    assert "boot 1: 3 tests then stall: L1 idle; boot 2 (retry): 2 tests then pytest rc=0" in line.stdout


def test_a_stall_inside_a_chain_reruns_the_chain_from_its_start(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    assert boot(tmp_path, 1, die_at="a3") == ["test_a1", "test_a2"]
    # the tests outside the chain go first, so a chain that stalls again can't starve them
    assert boot(tmp_path, 2) == ["test_b", "test_c", "test_a1", "test_a2", "test_a3"]
    assert summary("line", tmp_path / "out", 900, 3).returncode == 0


def test_a_stall_with_no_retry_left_says_what_did_not_run(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    boot(tmp_path, 1, die_at="c")
    (tmp_path / "out" / "no-retry.txt").write_text("200 s of VMLANE_BUDGET=3600 s left, a retry needs 600 s\n")
    line = summary("line", tmp_path / "out", 3500, 3)
    assert line.returncode == 75  # infrastructure, not a test failure, but not a pass either
    assert line.stdout.strip() == (
        "vm lane: 4 passed, 0 failed, 0 skipped, 1 not run in 3500 s (build 3 s; 1 boot, 1 stall;"
        " boot 1: 4 tests then stall: L1 idle;"
        " no retry: 200 s of VMLANE_BUDGET=3600 s left, a retry needs 600 s)")


def test_a_failing_test_fails_the_lane_and_is_not_hidden_by_a_retry(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE.replace("def test_b(): die_at(\"b\")",
                                                          "def test_b(): assert False"))
    boot(tmp_path, 1)
    line = summary("line", tmp_path / "out", 600, 3)
    assert line.returncode == 1
    assert line.stdout.startswith("vm lane: 4 passed, 1 failed, 0 skipped, 0 not run")


def test_a_retry_that_runs_out_of_time_after_a_stall_is_infrastructure(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    boot(tmp_path, 1, die_at="c")
    second = tmp_path / "out" / "attempt-2"  # the retry boot ran out of time before any test ended
    second.mkdir()
    (second / "collected.txt").write_text((tmp_path / "out" / "attempt-1" / "collected.txt").read_text())
    (second / "verdict").write_text("timeout: L1 ran past its 600 s limit")
    line = summary("line", tmp_path / "out", 3500, 3)
    assert line.returncode == 75, line.stdout
    assert "1 not run" in line.stdout and "boot 2 (retry):" in line.stdout


def test_tests_left_out_by_vmlane_select_are_deselected_not_unrun(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    assert boot(tmp_path, 1, select="test_b or test_c") == ["test_b", "test_c"]
    line = summary("line", tmp_path / "out", 200, 3, select="test_b or test_c")
    assert line.returncode == 0, line.stdout
    assert line.stdout.startswith(
        "vm lane: 2 passed, 0 failed, 0 skipped, 0 not run, 3 deselected (VMLANE_SELECT=test_b or test_c)"
        " in 200 s"), line.stdout


def test_a_stall_in_a_selection_retries_only_the_selection(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    select = "test_a1 or test_a2 or test_a3 or test_b"
    assert boot(tmp_path, 1, die_at="b", select=select) == ["test_a1", "test_a2", "test_a3"]
    stalled = summary("line", tmp_path / "out", 900, 3, select=select)
    assert stalled.returncode == 75, stalled.stdout  # test_b did not run; test_c was never meant to
    assert stalled.stdout.startswith("vm lane: 3 passed, 0 failed, 0 skipped, 1 not run, 1 deselected")
    assert boot(tmp_path, 2, select=select) == ["test_b"]
    line = summary("line", tmp_path / "out", 900, 3, select=select)
    assert line.returncode == 0, line.stdout
    assert line.stdout.startswith("vm lane: 4 passed, 0 failed, 0 skipped, 0 not run, 1 deselected")
