"""The fleet's HTTP plumbing, shared by ``EngineClient`` (``client``) and ``EngineControl`` (``control``) and the
router's client: one aiohttp session per event loop, the API-key header, and ``EngineError`` with a readable message
out of SGLang's, FastAPI's or the router's error bodies."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from miles.utils.errors import MilesError


class EngineError(MilesError):
    """An engine (or router) call failed. ``status`` is None when no HTTP answer came (connection, timeout)."""

    def __init__(self, url: str, endpoint: str, status: int | None, message: str, *, timed_out: bool = False):
        self.url, self.endpoint, self.status, self.message = url, endpoint, status, message
        self.timed_out = timed_out
        what = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{endpoint} on {url} failed ({what}): {message}")

    @property
    def retryable(self) -> bool:
        """Worth retrying (maybe elsewhere): no answer, a 5xx, or 429 (busy)."""
        return self.status is None or self.status >= 500 or self.status == 429


def _error_message(body: Any) -> str:
    """A readable message out of SGLang's, FastAPI's or the router's error bodies."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or json.dumps(err))
        if isinstance(err, str):
            return err
        for key in ("message", "detail", "error_message"):    # error_message: SGLang's LoRAUpdateOutput
            if body.get(key):
                return str(body[key])
        return json.dumps(body)[:1000]
    return str(body)[:1000] if body not in (None, "") else "(empty body)"


def _auth_hint(status: int, message: str) -> str:
    if status == 401:
        return f"{message} -- the engine/router wants an API key: pass the run's key (--sglang-api-key) to the client"
    return message


class _Http:
    """One aiohttp session per event loop, an auth header, and uniform error handling."""

    def __init__(self, api_key: str | None, timeout: float, connection_limit: int = 100):
        if timeout <= 0:
            raise ValueError(f"HTTP timeout must be > 0 seconds, got {timeout}")
        self.api_key = api_key
        self.timeout = float(timeout)
        self._limit = connection_limit
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, force_close=False),
                headers=self._headers())
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _request(self, method: str, url: str, endpoint: str, payload: Any = None,
                       timeout: float | None = None, params: dict[str, str] | None = None,
                       headers: dict[str, str] | None = None) -> Any:
        """Send one request (``headers``: added to the session's); return the parsed body of a 2xx answer, raise
        EngineError otherwise."""
        session = await self._get_session()
        limit = self.timeout if timeout is None else float(timeout)
        try:
            async with session.request(method, url.rstrip("/") + endpoint, json=payload, params=params, headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                raw = await resp.read()
                body: Any = raw.decode("utf-8", "replace")
                if raw and (resp.content_type == "application/json" or raw[:1] in (b"{", b"[")):
                    try:
                        body = json.loads(raw)
                    except ValueError:
                        pass
                if not (200 <= resp.status < 300):
                    raise EngineError(url, endpoint, resp.status, _auth_hint(resp.status, _error_message(body)))
                return body
        except TimeoutError as e:
            raise EngineError(url, endpoint, None, f"timed out after {limit:.1f}s", timed_out=True) from e
        except aiohttp.ClientError as e:
            raise EngineError(url, endpoint, None, f"{type(e).__name__}: {e}") from e


def _check_success(url: str, endpoint: str, body: Any) -> Any:
    """SGLang's control endpoints answer ``{"success": bool, "message": str}``; a false one is an error."""
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineError(url, endpoint, 200, _error_message(body))
    return body
