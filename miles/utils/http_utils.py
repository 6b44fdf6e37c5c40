"""Miles's ``miles.utils.http_utils``: the JSON-over-HTTP helpers its plugins import (``post``, ``get``,
``wait_http_ok``), plus ports and server readiness.

    from miles.utils.http_utils import post
    out = await post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate", payload)

``post(url, payload, max_retries=60, action="post", headers=None)`` sends ``payload`` as JSON (``action`` is
the HTTP method: ``post``, ``put``, ``get``, ``delete``) and returns the parsed JSON answer (its text when the
answer is not JSON). Every try is bounded by the request timeout (``init_http_client(args)`` takes
``--rollout-request-timeout``, 600 s unless set); connection errors, timeouts, 429 and 5xx are retried
(``max_retries`` tries in all, as Miles counts them) with backoff; another 4xx is final. Failures raise
:class:`HttpError` naming the URL and the last error. One aiohttp session per event loop is kept.

A pure helper: no plane is imported (the rollout's reward server calls and the OPD teacher calls use
:func:`post_json_retrying` too).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import socket
import time
import weakref
from typing import Any

import aiohttp

from miles.utils.errors import MilesError
from miles.utils.logging import get_logger
from miles.utils.net import find_free_port, host_address

logger = get_logger(__name__)

DEFAULT_REQUEST_TIMEOUT = 600.0   # --rollout-request-timeout's default
_state: dict[str, Any] = {"timeout": DEFAULT_REQUEST_TIMEOUT, "limit": 1000}
_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = weakref.WeakKeyDictionary()


class HttpError(MilesError):
    """An HTTP call of a plugin helper failed (after its retries); the message names the URL."""


# ----------------------------------------------------------------------------- ports and servers
def is_port_available(port: int) -> bool:
    """True when ``port`` can be bound on every interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
            s.listen(1)
            return True
        except (OSError, OverflowError):
            return False


def find_available_port(base_port: int) -> int:
    """A free port a random 100..1000 above ``base_port`` (Miles's spreading of ports between processes)."""
    port = base_port + random.randint(100, 1000)
    for _ in range(65536):
        if 0 < port < 65536 and is_port_available(port):
            return port
        port = port + 42 if port < 60000 else port - 43
    return find_free_port()


def wait_for_server_ready(host: str, port: int, process: multiprocessing.Process | None = None,
                          timeout: float = 30) -> None:
    """Poll every 0.5 s until ``host:port`` accepts a TCP connection; RuntimeError when ``process`` (if given)
    dies first or after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and not process.is_alive():
            raise RuntimeError(f"Server process died before port {port} became ready")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"Server at {host}:{port} not ready after {timeout}s")


def get_host_info() -> tuple[str, str]:
    """(host name, the address other nodes reach this host on); ``MILES_HOST_IP`` overrides the address."""
    import os

    return socket.gethostname(), os.environ.get("MILES_HOST_IP") or host_address()


def terminate_process(process: multiprocessing.Process, timeout: float = 1.0) -> None:
    """Terminate ``process``, killing it when it is still alive ``timeout`` seconds later."""
    if not process.is_alive():
        return
    process.terminate()
    process.join(timeout=timeout)
    if process.is_alive():
        process.kill()
        process.join()


# ----------------------------------------------------------------------------- JSON over HTTP
def init_http_client(args: Any) -> None:
    """Take the per-try timeout (``--rollout-request-timeout``) and the connection limit (``--sglang-server-concurrency``
    x engines) from the run's args; the rollout calls it before any plugin runs. Idempotent."""
    timeout = getattr(args, "rollout_request_timeout", None)
    if isinstance(timeout, int | float) and timeout > 0:
        _state["timeout"] = float(timeout)
    concurrency = getattr(args, "sglang_server_concurrency", None)
    if isinstance(concurrency, int) and concurrency > 0:
        engines = max(1, int(getattr(args, "rollout_num_gpus", 1) or 1)
                      // max(1, int(getattr(args, "rollout_num_gpus_per_engine", 1) or 1)))
        _state["limit"] = max(_state["limit"], concurrency * engines)


def request_timeout() -> float:
    return float(_state["timeout"])


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=int(_state["limit"])))
        _sessions[loop] = session
    return session


async def close_http_client() -> None:
    """Close this event loop's session (the next call opens a new one)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None and not session.closed:
        await session.close()


async def _answer(resp: aiohttp.ClientResponse) -> Any:
    text = await resp.text()
    try:
        return await resp.json(content_type=None)
    except ValueError:
        return text


async def request_json_retrying(session: aiohttp.ClientSession, method: str, url: str, payload: Any, *,
                                timeout: float, max_retries: int, name: str, error: type[Exception] = HttpError,
                                headers: dict[str, str] | None = None, bound_text: str | None = None) -> Any:
    """``method`` ``url`` with ``payload`` as JSON, each try bounded by ``timeout`` s; 429, 5xx, connection errors
    and timeouts are retried ``max_retries`` times with backoff (0.25 s doubling, at most 4 s), another 4xx is
    final. The parsed JSON answer (the text when it is not JSON); failures raise ``error`` naming ``name``."""
    last = ""
    bound = aiohttp.ClientTimeout(total=timeout)
    for attempt in range(max_retries + 1):
        if attempt:
            await asyncio.sleep(min(0.25 * 2 ** (attempt - 1), 4.0))
        try:
            body = {} if payload is None and method not in ("GET", "DELETE") else payload
            async with session.request(method, url, json=body, headers=headers, timeout=bound) as resp:
                if resp.status == 429 or resp.status >= 500:
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    continue
                if resp.status >= 400:
                    raise error(f"{name} answered HTTP {resp.status}: {(await resp.text())[:200]}")
                return await _answer(resp)
        except aiohttp.InvalidURL as e:  # no try can succeed
            raise error(f"{name}: invalid URL ({e})") from None
        except (TimeoutError, aiohttp.ClientError) as e:
            last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    bound_text = bound_text or f"{timeout:g}s per try"
    raise error(f"{name} failed {max_retries + 1} times ({bound_text}); last error: {last}")


async def post_json_retrying(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], *, timeout: float,
                             max_retries: int, name: str, error: type[Exception] = RuntimeError) -> Any:
    """POST ``payload`` on ``session`` (see :func:`request_json_retrying`); the message names ``--rm-max-retries``."""
    return await request_json_retrying(session, "POST", url, payload, timeout=timeout, max_retries=max_retries,
                                       name=name, error=error,
                                       bound_text=f"--rm-timeout {timeout:g}s, --rm-max-retries {max_retries}")


async def post(url: str, payload: Any, max_retries: int = 60, action: str = "post",
               headers: dict[str, str] | None = None) -> Any:
    """Miles's ``post``: ``action`` (an HTTP method) on ``url`` with ``payload`` as JSON; see the module docstring."""
    method = action.upper()
    if method not in ("POST", "PUT", "PATCH", "GET", "DELETE"):
        raise ValueError(f"http_utils.post: action {action!r} is not an HTTP method (post, put, patch, get, delete)")
    return await request_json_retrying(_session(), method, url, payload, timeout=request_timeout(),
                                       max_retries=max(0, int(max_retries) - 1), name=f"{method} {url}",
                                       headers=headers)


async def get(url: str) -> Any:
    """Miles's ``get``: GET ``url`` once (bounded by the request timeout), the parsed JSON answer; HttpError otherwise."""
    return await request_json_retrying(_session(), "GET", url, None, timeout=request_timeout(), max_retries=0,
                                       name=f"GET {url}")


async def wait_http_ok(url: str, *, json_payload: Any = None, timeout: float = 180.0,
                       request_timeout: float = 60.0) -> None:
    """Poll ``url`` (POST ``json_payload`` when given, else GET) every 5 s until it answers HTTP 200;
    TimeoutError naming the URL and the last answer after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = "no attempt made"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=request_timeout)) as session:
        while True:
            try:
                call = (session.post(url, json=json_payload) if json_payload is not None else session.get(url))
                async with call as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{url} not ready after {timeout}s: {last}")
            await asyncio.sleep(min(5.0, left))
