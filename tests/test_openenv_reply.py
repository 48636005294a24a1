"""``smolbench serve``'s app over a stand-in for the warm parent (no machines): what
--max-reply and --max-sessions bound, and what a big reply costs the server to send.

:class:`FakeParent` answers resets with an observation made ahead and deletes a session's
"machine" when the test lets it, so the server's own code (OpenEnv's app, smolbench's
routes and sessions) runs as ``smolbench serve`` runs it, in this process.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces as S

from smolbench import SmolbenchError

pytest.importorskip("openenv.core.env_server.interfaces")

from smolbench.openenv import MAX_REPLY, MachineEnvironment, app_for, json_size, space_json_size  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


class FakeHost:
    """smolbench's loop, as ``gym._host.Host`` gives it: a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float | None = None, **_: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class FakeParent:
    """What ``app_for`` and ``MachineEnvironment`` use of ``gym.machines.Machines``: a
    session's "machine" is made at its first reset and lives until its close's deletion
    ends (held while ``deleting`` is clear)."""

    def __init__(self, space: Any, obs: Any = None, host: FakeHost | None = None, root: FakeParent | None = None) -> None:
        self.host = host or FakeHost()
        self.observation_space, self.action_space = space, S.Discrete(2)
        self.obs, self.parent, self.described = obs, None, {}
        self.records = SimpleNamespace(client_name=None)
        self.eps = [SimpleNamespace(ref=None)]
        self.closed = False
        self.root = root or self
        if root is None:
            self.alive = self.most = 0  # machines alive now, and at most
            self.deleting = threading.Event()
            self.deleting.set()
            self.lock = threading.Lock()

    def sibling(self) -> FakeParent:
        return FakeParent(self.observation_space, self.obs, self.host, self.root)

    async def start_sibling(self) -> None:
        r = self.root
        with r.lock:
            r.alive += 1
            r.most = max(r.most, r.alive)
        self.made = True

    async def reset(self, i: int, seed: Any, options: Any) -> tuple[Any, dict[str, Any]]:
        return self.obs, {}

    async def close(self, let_go: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if getattr(self, "made", False):
            while not self.root.deleting.is_set():
                await asyncio.sleep(0.01)
            with self.root.lock:
                self.root.alive -= 1


@pytest.fixture
def fakes() -> Iterator[list[FakeParent]]:
    made: list[FakeParent] = []
    yield made
    for p in made:
        p.host.stop()


def fake(fakes: list[FakeParent], space: Any, obs: Any = None) -> FakeParent:
    p = FakeParent(space, obs)
    fakes.append(p)
    return p


def ws_ask(ws: Any, type_: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    ws.send_text(json.dumps({"type": type_, "data": data or {}}))
    return dict(json.loads(ws.receive_text()))


# -- --max-reply, from the observation space ---------------------------------------------

SPACES = [S.Box(-1, 1, (3, 4), np.float32), S.Box(0, 255, (2, 2, 2), np.uint8), S.MultiBinary([3, 5]),
          S.MultiDiscrete([2, 3, 4]), S.Discrete(7), S.Text(12, min_length=2),
          S.Dict({"a": S.Box(0, 1, (2,), np.int64), "pos": S.Tuple((S.Discrete(3), S.Text(5)))})]


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_a_space_s_reply_sizes_bound_what_each_reply_is_counted_at(space: Any) -> None:
    """The start's check and each reply's count agree: every observation in the space is
    counted within the space's bounds, and an array's at exactly them."""
    low, high = space_json_size(space)
    for seed in range(5):
        space.seed(seed)
        obs = space.sample()
        assert low <= json_size((obs, {})) <= high, (obs, low, high)
    if isinstance(space, (S.Box, S.MultiBinary, S.MultiDiscrete)):
        assert low == high == json_size((space.sample(), {}))


def test_a_space_no_reply_of_which_fits_max_reply_is_refused_once_before_serving(fakes: list[FakeParent]) -> None:
    """Each reply is checked against --max-reply; an observation space past it failed every
    reset of every session (a machine made for each), never at the start. Now the server
    refuses it in one line as it learns the spaces, naming the option and the size needed;
    a session made anyway (the library's MachineEnvironment) refuses its first reset before
    any machine is made."""
    big = fake(fakes, S.MultiBinary(1 << 22))  # 4 Mi int8s: ~20 MiB of JSON, counted as "-128,"
    low, high = space_json_size(big.observation_space)
    assert low == high > MAX_REPLY
    with pytest.raises(SmolbenchError) as got:
        app_for(big, max_sessions=1)  # on the old code: an app whose every reset is refused
    said = str(got.value)
    assert f"take at least {low:,} bytes as JSON" in said and f"--max-reply ({MAX_REPLY:,})" in said, said
    assert f"--max-reply {high} or more" in said and "\n" not in said, said
    env = MachineEnvironment(big.sibling())
    with pytest.raises(SmolbenchError, match="every reset would be refused"):
        env.reset(seed=1)
    assert big.most == 0  # no machine made for it
    app = app_for(big, max_sessions=1, max_reply=high)  # an operator who raised it: served
    app.state.smolbench_pool.shutdown()


def test_a_space_only_some_replies_of_which_fit_is_served_with_a_warning(fakes: list[FakeParent]) -> None:
    from smolbench.openenv import reply_room

    space = S.Dict({"log": S.Text(1 << 20, min_length=0), "img": S.Box(0, 255, (64, 64), np.uint8)})
    low, high = space_json_size(space)
    assert low < 65536 < high
    said = reply_room(space, 65536)
    assert said is not None and f"up to {high:,} bytes" in said and f"--max-reply {high} serves" in said
    assert reply_room(space, high) is None
