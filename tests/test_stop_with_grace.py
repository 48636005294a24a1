"""The one way a machine's cell or request is stopped (``Workbench._stop`` for cells,
``AgentHostBackend._stop_request`` for a save): interrupt, wait the grace period for it, then
hang up; its own end is never raised."""

from __future__ import annotations

import asyncio

from smolbench._aio import _stop_with_grace


def test_a_request_that_ends_when_interrupted_is_stopped_in_time() -> None:
    async def main() -> None:
        interrupted = asyncio.Event()

        async def request() -> None:
            await interrupted.wait()
            raise RuntimeError("KeyboardInterrupt in the machine")  # its end: not news

        async def interrupt() -> None:
            interrupted.set()

        task = asyncio.ensure_future(request())
        assert await _stop_with_grace(interrupt, task, 60) is True
        assert task.done() and not task.cancelled()

    asyncio.run(main())


def test_a_request_that_ignores_the_interrupt_is_hung_up_on() -> None:
    async def main() -> None:
        told = []

        async def interrupt() -> None:
            told.append(True)
            raise OSError("the machine does not answer")  # ignored: it still gets its grace period

        task = asyncio.ensure_future(asyncio.Event().wait())
        assert await _stop_with_grace(interrupt, task, 0.05) is False
        assert told and task.cancelled()

    asyncio.run(main())


def test_a_request_already_over_is_not_interrupted() -> None:
    """An interrupt sent then would land in the machine's next cell."""
    async def main() -> None:
        told = []

        async def interrupt() -> None:
            told.append(True)

        async def request() -> None:
            raise RuntimeError("it ended on its own")

        task = asyncio.ensure_future(request())
        await asyncio.wait({task})
        assert await _stop_with_grace(interrupt, task, 60) is True
        assert not told

    asyncio.run(main())
