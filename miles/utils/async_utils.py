"""Miles's ``miles.utils.async_utils``: one background event loop for synchronous code, and small asyncio helpers.

    from miles.utils.async_utils import run
    rewards = run(batched_async_rm(args, samples))     # from a plain (sync) function

``run(coro)`` runs ``coro`` on the process's shared background loop (a daemon thread, started on first use) and
waits for it; :func:`run_sync` is the same with a timeout. The engine client's sync wrappers use this loop too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

from miles.utils.logging import get_logger

logger = get_logger(__name__)
T = TypeVar("T")

__all__ = ["AsyncLoopThread", "AsyncioGatherUtils", "eager_create_task", "get_async_loop", "run", "run_sync"]


class AsyncLoopThread:
    """An event loop running forever on a daemon thread; ``run(coro)`` blocks until ``coro`` is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="miles-async-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise


_lock = threading.Lock()
_loop_thread: AsyncLoopThread | None = None


def get_async_loop() -> AsyncLoopThread:
    """The process's shared background loop (started on first use)."""
    global _loop_thread
    with _lock:
        if _loop_thread is None or _loop_thread.loop.is_closed():
            _loop_thread = AsyncLoopThread()
        return _loop_thread


def run(coro: Awaitable[T]) -> T:
    """Run ``coro`` on the background loop and return its result (Miles's ``run``). Not from inside that loop."""
    return get_async_loop().run(coro)


def run_sync(coro: Awaitable[T], timeout: float | None = None) -> T:
    """:func:`run` waiting at most ``timeout`` seconds (TimeoutError, and ``coro`` cancelled, past it)."""
    return get_async_loop().run(coro, timeout)


async def eager_create_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``asyncio.create_task(coro)``, then yield once so the task has started before the caller goes on."""
    task = asyncio.create_task(coro)
    await asyncio.sleep(0)
    return task


class AsyncioGatherUtils:
    """Helpers for the results of ``asyncio.gather(..., return_exceptions=True)``."""

    @staticmethod
    def has_error(outputs: Sequence[Any]) -> bool:
        return any(isinstance(o, BaseException) for o in outputs)

    @staticmethod
    def log_error(outputs: Sequence[Any], debug_name: str) -> None:
        for i, o in enumerate(outputs):
            if isinstance(o, BaseException):
                logger.warning(f"{debug_name} error index={i}", exc_info=o)
