"""Retries after infrastructure failures: `%smol up`, fork and episodes boot (or branch) again
when a machine fails to come up or dies, never when the user's cell raises; the ledger records
every attempt and the result table says which branch was retried.

Runs the Workbench on the smol backend against the fake engine of ``fakesmol.py``, where a
boot can miss smol's fixed 180 s agent wait and a VM can die under a running fork."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakesmol import FakeHost, FakeVM, fake_host
from smol import MachineConfig

from smolbench.backends.smol import SmolBackend
from smolbench.errors import InfraError, SmolbenchError
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    yield from fake_host(monkeypatch)


def workbench(tmp_path: Path, retries: int = 1) -> Workbench:
    backend = SmolBackend(probe=False, session="t")
    return Workbench(backend, MachineSpec(), Ledger(tmp_path / "ledger.db"), retries=retries)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def slow_first_boots(host: FakeHost, n: int) -> None:
    """The first ``n`` boots miss smol's 180 s agent wait (branchable) or the boot timeout."""
    left = [n]

    def ready(config: MachineConfig) -> float:
        if left[0] > 0:
            left[0] -= 1
            return 10_000.0
        return 0.0

    host.ready_seconds = ready


def attempts(wb: Workbench) -> list[tuple[str, int, str, str]]:
    return [(r["node_id"], r["attempt"], r["stage"], r["outcome"]) for r in wb.ledger.attempt_rows()]


def test_up_boots_again_after_a_boot_that_failed(host: FakeHost, tmp_path: Path) -> None:
    slow_first_boots(host, 1)
    wb = workbench(tmp_path)

    async def main() -> int:
        await wb.up()
        try:
            return int(wb.machines["root"].info["attempts"])
        finally:
            await wb.down()

    assert run(main()) == 2
    assert attempts(wb) == [("root", 1, "boot", "retried"), ("root", 2, "boot", "ok")]
    assert "180 s" in wb.ledger.attempt_rows()[0]["error"]


def test_up_gives_up_in_one_line_when_retries_run_out(host: FakeHost, tmp_path: Path) -> None:
    slow_first_boots(host, 5)
    wb = workbench(tmp_path, retries=0)
    with pytest.raises(InfraError) as info:
        run(wb.up())
    text = str(info.value)
    assert "\n" not in text and "less memory" in text and text.endswith("(gave up after 1 attempts)")
    assert attempts(wb) == [("root", 1, "boot", "gave up")]
    assert host.vms == []


def test_a_branch_whose_machine_dies_is_branched_again_and_shown_as_retried(
    host: FakeHost, tmp_path: Path
) -> None:
    wb = workbench(tmp_path)
    died: list[str] = []
    requests: dict[str, int] = {}

    def die_once(vm: FakeVM, path: str) -> None:
        # at its cell's request: its first is its seed's (control requests go through the relay too),
        # where the branch request itself fails and all of it is branched again
        if "-root-1-" in vm.name and "request-" in path and not died:
            requests[vm.name] = requests.get(vm.name, 0) + 1
            if requests[vm.name] == 2:
                died.append(vm.name)
                vm.die()

    async def main() -> Any:
        await wb.up()
        try:
            await wb.run_cell("base = 7", lambda e: None)
            host.before_write = die_once
            result = wb.new_fork(3, keep="none")
            await wb.fork(result, "print(SEED + base)", lambda b, e: None, keep="none")
            return result
        finally:
            await wb.down()

    result = run(main())
    assert died and result.rows["root.1"]["status"] == "ok"
    assert [r["attempts"] for r in result.rows.values()] == [1, 2, 1]
    assert result.rows["root.1"]["output"].strip() == "8"
    assert "ok (retried: attempt 2)" in repr(result) and "1 retried after a machine failure" in result.summary()
    assert "ok (retried: attempt 2)" in result._repr_html_()
    assert attempts(wb) == [("root.1", 1, "run", "retried"), ("root.1", 2, "run", "ok")]


def test_a_users_exception_is_never_retried(host: FakeHost, tmp_path: Path) -> None:
    wb = workbench(tmp_path, retries=3)

    async def main() -> Any:
        await wb.up()
        try:
            result = wb.new_fork(2, keep="none")
            await wb.fork(result, "if SEED == 1:\n    raise ValueError('mine')", lambda b, e: None, keep="none")
            return result
        finally:
            await wb.down()

    result = run(main())
    assert result.rows["root.1"]["status"] == "error" and "ValueError: mine" in result.rows["root.1"]["error"]
    assert [r["attempts"] for r in result.rows.values()] == [1, 1]
    assert attempts(wb) == [] and len(host.vms) == 3  # root + two branches, no re-branch


def test_an_episode_whose_machine_fails_to_boot_gets_a_new_one(host: FakeHost, tmp_path: Path) -> None:
    wb = workbench(tmp_path)

    async def main() -> Any:
        await wb.up()
        try:
            slow_first_boots(host, 1)
            result = wb.new_episodes(2, concurrency=1)
            await wb.episodes(result, "print(SEED)", lambda b, e: None, concurrency=1)
            return result
        finally:
            await wb.down()

    result = run(main())
    assert [(r["status"], r["attempts"]) for r in result.rows.values()] == [("ok", 2), ("ok", 1)]
    first = sorted(result.rows)[0]
    assert attempts(wb) == [(first, 1, "episode", "retried"), (first, 2, "episode", "ok")]
    assert [vm.deleted for vm in host.vms] == [True] * len(host.vms)  # nothing left running
    episode_configs = [c.args[0] for c in host.cls.create.call_args_list[1:]]
    assert all(c.branchable is False for c in episode_configs)  # episodes are never branched


def test_negative_retries_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SmolbenchError, match="--retries must be 0 or more"):
        workbench(tmp_path, retries=-1)
