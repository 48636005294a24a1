"""Lane-only pytest plugin (``-p vmlane_results`` in L1): every test's outcome goes to the 9p
share the moment it is known, so a boot that stalls or hangs later keeps what already ran;
and a retry boot skips what passed before (``VMLANE_PASSED``), except the earlier steps of a
chain (``@pytest.mark.chain``) whose later steps still have to run: those share one
machine's state, so the chain runs again from its start, after the tests outside chains.
Tests left out by the boot's own selection (``VMLANE_SELECT``, a ``-k``) go to deselected.txt:
they were not meant to run, so the summary does not count them as "not run"."""

from __future__ import annotations

import os

import pytest

_OUT = os.environ.get("VMLANE_OUTCOMES", "")
_PASSED = os.environ.get("VMLANE_PASSED", "")
_seen: dict[str, str] = {}
_dropped: set[str] = set()  # what passed in an earlier boot: not the selection's doing


def _write(name: str, line: str) -> None:
    if not _OUT:
        return
    with open(os.path.join(_OUT, name), "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _chain(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("chain")
    return str(mark.args[0]) if mark and mark.args else None


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and report.nodeid.endswith(".py"):
        _write("outcomes.txt", f"{report.nodeid} skipped")


@pytest.hookimpl(trylast=True)  # after the -k selection: the retry logic sees only its tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        _write("collected.txt", item.nodeid)
    try:
        passed = set(open(_PASSED).read().split()) if _PASSED else set()
    except OSError:
        passed = set()
    if not passed:
        return
    pending_chains = {_chain(i) for i in items if i.nodeid not in passed} - {None}
    keep, drop = [], []
    for item in items:
        rerun = item.nodeid not in passed or _chain(item) in pending_chains
        (keep if rerun else drop).append(item)
    if drop:
        _dropped.update(i.nodeid for i in drop)
        config.hook.pytest_deselected(items=drop)
    # A retry runs the tests outside any chain first: a chain that stalls again can't keep
    # them from running.
    items[:] = sorted(keep, key=lambda i: _chain(i) is not None)


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid not in _dropped:
            _write("deselected.txt", item.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "setup":
        _seen[report.nodeid] = "passed"
    if report.failed:
        _seen[report.nodeid] = "failed" if report.when == "call" else "error"
        # the failure's text now: a boot that times out later never prints pytest's summary
        _write("failures.txt", f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-20000:]}")
    elif report.skipped and _seen.get(report.nodeid) == "passed":
        _seen[report.nodeid] = "skipped"
    if report.when == "teardown":
        _write("outcomes.txt", f"{report.nodeid} {_seen.pop(report.nodeid, 'error')}")
