"""Miles's ``miles.utils.misc``: loading ``module.function`` paths, free ports, and small helpers its plugins import.

``load_function(path)`` returns the object a dotted path names (None for an empty path), consulting
:data:`function_registry` first (tests register in-memory functions under a name); a path that does not import
is one :class:`~miles.config.base.ConfigError` line naming it and the fix (the same loader as every ``--*-path``
flag, :func:`miles.utils.imports.load_function`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from miles.utils import imports
from miles.utils.http_utils import is_port_available
from miles.utils.logging import get_logger
from miles.utils.net import host_address

logger = get_logger(__name__)


class FunctionRegistry:
    """In-memory functions addressable by name through :func:`load_function` (while ``temporary`` is open)."""

    def __init__(self) -> None:
        self._registry: dict[str, object] = {}

    @contextmanager
    def temporary(self, name: str, fn: object) -> Iterator[None]:
        assert name not in self._registry, f"{name!r} is registered already"
        self._registry[name] = fn
        try:
            yield
        finally:
            self._registry.pop(name, None)

    def get(self, name: str) -> object | None:
        return self._registry.get(name)


function_registry = FunctionRegistry()


def load_function(path: str | None, *, sync_required: bool = False) -> Any:
    """The object ``path`` (``package.module.attr``) names; None for an empty path. ``sync_required`` refuses a
    coroutine function (ValueError), for callers that call it synchronously."""
    if not path:
        return None
    fn = function_registry.get(path)
    if fn is None:
        fn = imports.load_function(path, "load_function")
    if sync_required and inspect.iscoroutinefunction(fn):
        raise ValueError(f"load_function({path!r}) resolved to an async function; a synchronous one is required")
    return fn


class SingletonMeta(type):
    """A metaclass whose classes have one instance per process (``clear_all_instances`` forgets them)."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    @staticmethod
    def clear_all_instances() -> None:
        SingletonMeta._instances.clear()


def get_current_node_ip() -> str:
    """The address other nodes reach this host on."""
    return host_address().strip("[]")


def get_free_port(start_port: int = 10000, consecutive: int = 1) -> int:
    """The first port from ``start_port`` up such that it and the ``consecutive - 1`` ports after it are free."""
    port = start_port
    while not all(is_port_available(port + i) for i in range(consecutive)):
        port += 1
        if port + consecutive > 65536:
            raise OSError(f"no {consecutive} consecutive free ports from {start_port} up")
    return port


def should_run_periodic_action(rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None,
                               num_rollout: int | None = None) -> bool:
    """True at every ``interval``-th rollout, at epoch ends and at the last rollout (never when interval is None)."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)


async def as_completed_async(tasks: Iterable[Awaitable[Any]]) -> AsyncIterator[Any]:
    """The results of ``tasks`` in completion order."""
    for fut in asyncio.as_completed(list(tasks)):
        yield await fut


def filter_keys(d: dict[str, Any], interest_keys: Sequence[str]) -> dict[str, Any]:
    """``{k: d[k]}`` for ``interest_keys`` in their order; a missing key is logged with the keys present and raised."""
    try:
        return {k: d[k] for k in interest_keys}
    except KeyError:
        logger.error(f"filter_keys: d.keys={list(d)} interest_keys={list(interest_keys)}")
        raise
