"""User extension points given as ``module.function`` paths, loaded and signature-checked at start-up.

Miles's ``--*-path`` flags (``--custom-rm-path``, ``--custom-generate-function-path``,
``--dynamic-sampling-filter-path``) name a function by dotted path. Here they are resolved when the
rollout manager is built, so a typo or a wrong signature fails before the first rollout with a message
naming the flag, the value and the fix, not in the middle of a run.

Every plugin that takes an ``args`` parameter receives a :class:`PluginArgs`: a read-only view over the
typed config sections (``args.rollout_max_response_len``, ``args.reward_key``, ``args.rm_url``, ...),
plus ``args.client`` (the :class:`~miles.fleet.client.EngineClient`) and ``args.tokenizer``. This keeps
Miles's ``custom_rm(args, sample)`` and ``generate(args, sample, sampling_params)`` working unchanged
for code that only reads flags.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

from miles.config.base import ConfigError
from miles.utils.imports import UNSUPPORTED_ATTR, load_function, unsupported  # noqa: F401 - re-exported

# Miles flags refused here (naming one is an error), at the value they have when not given: a plugin written for Miles
# that reads one sees what is true of this run (Miles's multi-turn geo3k example asserts ``not args.partial_rollout``)
REFUSED_FLAG_VALUES: dict[str, Any] = {"partial_rollout": False}


class PluginArgs:
    """Read-only attribute view over config sections, plus the engine client and the tokenizer.

    ``args.x`` returns ``overrides[x]``, else the first section's field ``x`` (sections never share field names),
    else ``extra[x]``, else the value of a Miles flag refused here (``REFUSED_FLAG_VALUES``). Unknown names raise
    AttributeError listing where they were looked up.
    """

    def __init__(self, *sections: Any, client: Any = None, tokenizer: Any = None,
                 extra: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> None:
        values: dict[str, Any] = dict(overrides or {})  # values the run decided (e.g. the router it started)
        for sec in sections:
            if sec is None:
                continue
            if not is_dataclass(sec):
                raise TypeError(f"PluginArgs takes config dataclass sections, got {type(sec).__name__}")
            for f in fields(sec):
                values.setdefault(f.name, getattr(sec, f.name))
        for name, value in (extra or {}).items():  # --custom-config-path keys that name no flag
            values.setdefault(name, value)
        for name, value in REFUSED_FLAG_VALUES.items():
            values.setdefault(name, value)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_sections", [type(s).__name__ for s in sections if s is not None])
        object.__setattr__(self, "client", client)
        object.__setattr__(self, "tokenizer", tokenizer)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"plugin args have no field '{name}' (looked in {', '.join(self._sections)}, client, tokenizer)")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"plugin args are read-only (tried to set '{name}'); keep per-call state on the sample")

    def with_overrides(self, values: dict[str, Any]) -> PluginArgs:
        """A copy of this view in which ``values`` replace (or add) fields; this one is unchanged."""
        out = object.__new__(PluginArgs)
        out.__dict__.update(self.__dict__)
        out.__dict__["_values"] = {**object.__getattribute__(self, "_values"), **values}
        return out


def router_address(router_url: str | None) -> dict[str, Any]:
    """``sglang_router_ip`` / ``sglang_router_port`` of a router URL (Miles's args names), or {}."""
    from urllib.parse import urlsplit

    if not router_url:
        return {}
    parts = urlsplit(router_url)
    return {"sglang_router_ip": parts.hostname, "sglang_router_port": parts.port}


def client_address(client: Any) -> dict[str, Any]:
    """Miles's router address args of the URL an engine client sends ``/generate`` to (the router, or the one engine),
    so that plugins posting to ``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`` reach the
    run's engines; {} without a client."""
    urls = getattr(client, "urls", None)
    return router_address(urls[0]) if isinstance(urls, list | tuple) and urls else {}


def reward_value(sample: Any, args: Any = None) -> Any:
    """Miles's ``sample.get_reward_value(args)``: the reward, or its ``--reward-key`` entry when it is a dict."""
    key = getattr(args, "reward_key", None) if args is not None else None
    reward = sample.reward
    return reward[key] if key and isinstance(reward, dict) else reward


def positional_arity(fn: Callable[..., Any]) -> tuple[int, int | None]:
    """(required, maximum) positional parameters of ``fn``; maximum is None with ``*args``."""
    sig = inspect.signature(fn)
    required, maximum = 0, 0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            maximum += 1
            if p.default is p.empty:
                required += 1
        elif p.kind is p.VAR_POSITIONAL:
            return required, None
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            raise TypeError(f"required keyword-only parameter '{p.name}' is never passed")
    return required, maximum


def choose_arity(fn: Callable[..., Any], accepted: Sequence[int], flag: str, path: str, forms: str) -> int:
    """Pick how many positional arguments to pass ``fn``: the largest of ``accepted`` it can take."""
    try:
        required, maximum = positional_arity(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{flag} {path!r}: unusable signature ({e}); expected {forms}.") from e
    for n in sorted(accepted, reverse=True):
        if required <= n and (maximum is None or n <= maximum):
            return n
    raise ConfigError(f"{flag} {path!r} has signature {inspect.signature(fn)}; expected {forms}.")


def is_async(fn: Callable[..., Any]) -> bool:
    """True for ``async def`` functions and objects whose ``__call__`` is one."""
    call = vars(type(fn)).get("__call__")
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class PluginTimeout(TimeoutError):
    """A user-plugin (or built-in verifier) call did not return within its bound; the message names both."""


_MAX_THREADS = 32       # sync plugin calls running at once (more wait for a slot; the wait is not timed)
_MAX_ABANDONED = 256    # timed-out sync calls still running; past this, new calls fail at once
_thread_slots: asyncio.Semaphore | None = None
_thread_slots_loop: asyncio.AbstractEventLoop | None = None
_abandoned = 0
_abandoned_lock = threading.Lock()


def _slots() -> asyncio.Semaphore:
    global _thread_slots, _thread_slots_loop
    loop = asyncio.get_running_loop()
    if _thread_slots is None or _thread_slots_loop is not loop:
        _thread_slots, _thread_slots_loop = asyncio.Semaphore(_MAX_THREADS), loop
    return _thread_slots


def abandoned_calls() -> int:
    """Sync plugin calls that timed out and whose threads are still running."""
    return _abandoned


async def _in_daemon_thread(fn: Callable[..., Any], args: tuple[Any, ...], timeout: float, what: str,
                            flag: str) -> Any:
    """Run ``fn(*args)`` on a daemon thread (never joined at exit), waiting at most ``timeout`` seconds."""
    global _abandoned
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    state = {"abandoned": False}

    def _deliver(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def _work() -> None:
        global _abandoned
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine, which decides
            ok, value = False, e
        with _abandoned_lock:
            if state["abandoned"]:
                _abandoned -= 1
                return
        try:
            loop.call_soon_threadsafe(_deliver, ok, value)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=_work, name=f"miles-plugin:{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        with _abandoned_lock:
            state["abandoned"] = True
            _abandoned += 1
        raise PluginTimeout(f"{what} did not return within {flag} {timeout:g}s; the call was abandoned "
                            f"(its thread may still be running)") from None


async def call_bounded(fn: Callable[..., Any], args: tuple[Any, ...], timeout: float, what: str,
                       flag: str = "--rm-timeout") -> Any:
    """``fn(*args)`` bounded by ``timeout`` seconds; raises :class:`PluginTimeout` naming ``what`` and ``flag``.

    ``async`` functions are awaited and cancelled at the deadline. Plain functions run on a daemon thread
    (at most ``_MAX_THREADS`` at once) so that one that never returns can be abandoned: it keeps its
    thread, but the caller goes on. When ``_MAX_ABANDONED`` such threads are still stuck, new calls fail
    at once instead of piling up more.
    """
    if is_async(fn):
        try:
            return await asyncio.wait_for(fn(*args), timeout)
        except TimeoutError:
            raise PluginTimeout(f"{what} did not return within {flag} {timeout:g}s; the call was cancelled") from None
    if _abandoned >= _MAX_ABANDONED:
        raise PluginTimeout(f"{what} was not called: {_abandoned} earlier calls timed out ({flag} {timeout:g}s) "
                            f"and are still running; fix the function")
    async with _slots():
        value = await _in_daemon_thread(fn, args, timeout, what, flag)
    if inspect.isawaitable(value):  # a plain function that returned a coroutine
        try:
            return await asyncio.wait_for(value, timeout)
        except TimeoutError:
            raise PluginTimeout(f"{what} did not return within {flag} {timeout:g}s; the call was cancelled") from None
    return value
