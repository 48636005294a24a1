"""Suite-wide guard: the product must never leave machines or processes behind.

Every process this pytest run starts (kernels, sandboxes, agents, and so everything
inside a sandbox, as a descendant) inherits ``SMOLBENCH_SUITE_TAG``; at the end of the
run, any such process still alive fails the run. Processes of other, concurrent runs
carry another tag and are left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from nbhelpers import tagged_processes, wait_for_no_processes  # noqa: E402

SUITE_VAR = "SMOLBENCH_SUITE_TAG"


# The second tier: what drives a real browser, a Ray cluster, a served env over the network,
# builds and installs the extension's wheel,
# whole notebooks or hundreds of branches, and the slowest modules of the rest (zygote episodes,
# big saves, the gate's cost of replies, the network doctor): the main suite ran 22 min beside
# the VM lane, over its 20. `.ci/run` runs the first tier (`-m "not tier2"`),
# then this one; a bare `pytest` runs both. A slow test elsewhere carries the mark itself.
SECOND_TIER = frozenset(
    {
        "test_browser.py",
        "test_browser_clicks.py",
        "test_browser_terminal.py",
        "test_browser_truth.py",
        "test_browser_xss.py",
        "test_checkpoint_namespace_stream.py",
        "test_cluster.py",
        "test_cluster_auth.py",
        "test_cluster_interrupt.py",
        "test_cluster_leftovers.py",
        "test_cluster_no_bwrap.py",
        "test_cluster_smol.py",
        "test_cluster_ui.py",
        "test_cluster_units.py",
        "test_episodes.py",
        "test_fresh_machine.py",
        "test_gym_timeout.py",
        "test_labextension.py",
        "test_labextension_browser.py",
        "test_sidebar_spark_browser.py",
        "test_net_doctor.py",
        "test_notebooks.py",
        "test_openenv.py",
        "test_openenv_env.py",
        "test_openenv_reply.py",
        "test_openenv_server.py",
        "test_readme_tour.py",
        "test_replay_button_browser.py",
        "test_save_stage.py",
        "test_saved_notebook.py",
        "test_scale.py",
        "test_serve.py",
        "test_serve_connections.py",
        "test_sidebar_class_browser.py",
        "test_sidebar_truth_browser.py",
        "test_teaching_browser.py",
        "test_trust_gate_limits.py",
    }
)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Mark the second tier's tests (see SECOND_TIER)."""
    for item in items:
        if item.path.name in SECOND_TIER:
            item.add_marker(pytest.mark.tier2)


STATE_VAR = "SMOLBENCH_STATE"  # this user's smolbench state (the checkpoint key, smolbench.signing)
_STATE: list[str] = []


def pytest_configure(config: Any) -> None:
    """Tag this run's environment before any test starts a process; give it (and the kernels it
    starts) a state folder of its own, never the user's: its checkpoint key is this run's."""
    os.environ[SUITE_VAR] = uuid.uuid4().hex
    _STATE.append(tempfile.mkdtemp(prefix="smolbench-state-"))
    os.environ[STATE_VAR] = _STATE[-1]


def pytest_unconfigure(config: Any) -> None:
    for folder in _STATE:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Fail the run if any test left a machine running (and then clean it up)."""
    tag = os.environ[SUITE_VAR]
    # give kernels that are shutting down a moment to take their machines along
    left = wait_for_no_processes(tag, timeout=10, var=SUITE_VAR) if tagged_processes(tag, SUITE_VAR) else []
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nLEFT BEHIND: {len(left)} process(es) started by this test run:", red=True)
        for p in left[:10]:
            reporter.write_line(f"  {p.pid} {p.cmdline[:160]}")
    for p in left:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    session.exitstatus = 1


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A fresh folder (removed after the test) that a sandbox's unprivileged uid can reach:
    pytest's ``tmp_path`` sits below a 0700 folder, and a kernel running as root starts its
    sandboxes as another uid, so Smolfile volumes there would be out of reach."""
    path = Path(tempfile.mkdtemp(prefix="smolbench-test-"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own folder, as the working directory (a Session's ledger and logs go there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def output_limit() -> Iterator[int]:
    """The cell's output limit lowered to 100 KB (what ``%smol config output-limit 100K`` does)."""
    from smolbench import gate

    before = gate.limits.snapshot()
    gate.limits.configure("output-limit", "100K")
    try:
        yield 100_000
    finally:
        gate.limits.apply(before)
