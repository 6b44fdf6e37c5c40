"""sglang-router: the real Rust router (PyPI ``sglang-router``) in front of the engines.

- ``RouterProcess``: starts ``python -m sglang_router.launch_router`` as a supervised child of the driver
  rank (bounded startup wait, log file, dies with its parent, ``stop()``).
- ``RouterClient``: the router's worker API. ``POST /workers`` is asynchronous on the router side (it
  health-checks the worker first), so ``add_worker`` polls ``GET /workers`` until the engine is listed;
  ``remove_worker`` is ``DELETE /workers/{id}`` plus the same wait.
- ``connect_or_start_router``: use ``--sglang-router-ip/--sglang-router-port`` when given, else start one.
- ``remove_dead_workers``: the router's own health checks only mark a worker unhealthy, never remove it;
  the controller probes each worker and deletes the dead ones.

Facts about sglang-router 0.3.2 this module relies on (checked against the real binary; docs/rollout.md):
worker ids are derived from the URL (re-adding a URL gives the same id); ``/abort_request`` is not
routed (404); with ``--api-key`` the router demands ``Authorization: Bearer <key>`` on ``/workers`` and
``/generate`` (``/liveness``, ``/health``, ``/readiness`` stay open); it sends a worker's own ``api_key``
(given in ``POST /workers``) on every call to that worker, or passes the client's header through when
the worker has none; its health probes of ``/health`` carry no key (SGLang exempts ``/health*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.config.base import ConfigError
from miles.config.rollout import RolloutConfig
from miles.config.router import SECRETS, load_spec, router_cli, router_policies
from miles.fleet.control import EngineControl
from miles.fleet.engines import engine_url
from miles.fleet.http_base import EngineError, _Http
from miles.utils.logging import get_logger
from miles.utils.net import find_free_port

logger = get_logger(__name__)

ROUTER_POLICIES = router_policies()  # sglang-router 0.3.2's --policy choices (miles/config/sglang_router_args.json)


_SECRET_FLAGS = frozenset(a.router_flag for a in load_spec().values() if a.name in SECRETS)


def router_argv(host: str, port: int, settings: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """``python -m sglang_router.launch_router --host H --port P`` and ``settings`` (router name -> value; None
    and False leave the router's default) in the router's own spelling."""
    return [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            *router_cli({k: v for k, v in settings.items() if v is not None})]


class RouterError(EngineError):
    """A router call or the router process failed."""


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        # PR_SET_PDEATHSIG; SIGKILL, which also ends a stopped router (a SIGTERM would stay pending in it)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _http_ok(url: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300, f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, str(getattr(e, "reason", e))


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class RouterProcess:
    """One ``sglang_router.launch_router`` child process."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, argv: list[str]):
        self.proc, self.url, self.log_path, self.argv = proc, url, log_path, argv

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(
        cls,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str | None = None,
        extra_args: Sequence[str] = (),
        timeout: float = 60.0,
        *,
        api_key: str | None = None,
        request_timeout_secs: int | None = None,
        health_check_interval_secs: int = 5,
        health_failure_threshold: int = 2,
        retry_max_retries: int = 3,
        worker_startup_timeout_secs: int = 120,
        log_path: str | os.PathLike | None = None,
        log_level: str = "warn",
        python: str = sys.executable,
        die_with_parent: bool = True,
        router_args: Mapping[str, Any] | None = None,
    ) -> RouterProcess:
        """Start the router and wait (at most ``timeout`` s) until ``/liveness`` answers.

        Its Prometheus endpoint binds ``host`` on a free port (the router's default is 0.0.0.0:29000,
        which collides between routers and listens on every interface). ``die_with_parent`` asks the
        kernel to SIGTERM the router when the thread that started it exits. ``router_args`` (the user's
        ``--router-*`` flags, ``RolloutConfig.router_args``) override the settings above for the same router flag.
        """
        if policy is not None and policy not in ROUTER_POLICIES:
            raise ConfigError(f"--sglang-router-policy {policy!r} is not one of {', '.join(ROUTER_POLICIES)}.")
        port = port or find_free_port(host)
        settings: dict[str, Any] = {
            "policy": policy, "prometheus_host": host, "log_level": log_level,
            "health_check_interval_secs": health_check_interval_secs, "health_failure_threshold": health_failure_threshold,
            "retry_max_retries": retry_max_retries, "worker_startup_timeout_secs": worker_startup_timeout_secs,
            "shutdown_grace_period_secs": 5,
            "request_timeout_secs": int(request_timeout_secs) if request_timeout_secs is not None else None,
            "api_key": api_key or None}
        user = dict(router_args or {})
        if "prometheus_port" not in user:
            settings["prometheus_port"] = find_free_port(user.get("prometheus_host", host))
        argv = router_argv(host, port, {**settings, **user}, python=python) + list(extra_args)
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"miles-router-{port}-", suffix=".log")
            os.close(fd)
            log_path = name
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    preexec_fn=_set_pdeathsig if (die_with_parent and sys.platform == "linux") else None)
        router = cls(proc, engine_url(host, port), log_path, argv)
        shown = " ".join("***" if i and argv[i - 1] in _SECRET_FLAGS else a for i, a in enumerate(argv))
        logger.info("starting sglang-router (pid %d): %s", proc.pid, shown)
        deadline = time.monotonic() + timeout
        why = "not started"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RouterError(router.url, "launch_router", None,
                                  f"the router exited with code {proc.returncode} during startup; log {log_path}:\n"
                                  f"{_tail(log_path)}")
            ok, why = _http_ok(router.url + "/liveness", timeout=2.0)
            if ok:
                logger.info("sglang-router ready at %s (log %s)", router.url, log_path)
                return router
            time.sleep(0.2)
        router.stop()
        raise RouterError(router.url, "/liveness", None,
                          f"the router did not become live within {timeout:.0f}s (last: {why}); log {log_path}:\n"
                          f"{_tail(log_path)}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("sglang-router pid %d ignored SIGTERM for %.0fs; killing it", self.pid, timeout)
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _norm(url: str) -> str:
    return url.rstrip("/")


class RouterClient(_Http):
    """Async client of the router's worker API (and its liveness)."""

    def __init__(self, url: str, timeout: float = 30.0, api_key: str | None = None, poll_interval: float = 0.2):
        super().__init__(api_key, timeout, connection_limit=8)
        self.url = _norm(url)
        self.poll_interval = poll_interval

    def __repr__(self) -> str:
        return f"RouterClient({self.url})"

    async def _call(self, method: str, endpoint: str, payload: Any = None, timeout: float | None = None) -> Any:
        try:
            return await self._request(method, self.url, endpoint, payload, timeout)
        except EngineError as e:
            raise RouterError(e.url, e.endpoint, e.status, e.message) from e

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the router answers ``/liveness`` and, with the client's key, ``GET /workers``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._call("GET", "/liveness", timeout=2.0)
                await self._call("GET", "/workers", timeout=5.0)
                return
            except RouterError as e:
                if (e.status is not None and e.status < 500) or time.monotonic() >= deadline:
                    raise RouterError(self.url, e.endpoint, e.status,
                                      f"router not ready within {timeout:.0f}s: {e.message}") from e
            await asyncio.sleep(self.poll_interval)

    async def list_workers(self) -> list[dict]:
        body = await self._call("GET", "/workers")
        if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
            raise RouterError(self.url, "/workers", 200, f"unexpected answer: {str(body)[:300]}")
        return body["workers"]

    async def find_worker(self, url: str) -> dict | None:
        url = _norm(url)
        return next((w for w in await self.list_workers() if _norm(w.get("url", "")) == url), None)

    async def add_worker(self, url: str, api_key: str | None = None, timeout: float | None = None) -> str:
        """Register an engine (which should already be healthy); return its worker id once listed.

        ``api_key`` (default: the client's) is what the router sends to this engine on its own calls.
        """
        url, limit = _norm(url), timeout or self.timeout
        existing = await self.find_worker(url)
        if existing is not None:
            return existing["id"]
        key = api_key if api_key is not None else self.api_key
        body = await self._call("POST", "/workers", {"url": url, **({"api_key": key} if key else {})})
        worker_id = body.get("worker_id") if isinstance(body, dict) else None
        if not worker_id:
            raise RouterError(self.url, "/workers", 200, f"no worker_id in the answer to adding {url}: {body}")
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if await self.find_worker(url) is not None:
                logger.info("router %s: added engine %s (id %s)", self.url, url, worker_id)
                return worker_id
            await asyncio.sleep(self.poll_interval)
        status = await self._job_status(worker_id)
        with contextlib.suppress(RouterError):  # drop the pending add so it cannot appear later
            await self._call("DELETE", f"/workers/{worker_id}")
        raise RouterError(self.url, "/workers", None,
                          f"engine {url} was not added within {limit:.0f}s (router job: {status}); "
                          "is it up and healthy, and does it accept the run's API key?")

    async def _job_status(self, worker_id: str) -> str:
        try:
            body = await self._call("GET", f"/workers/{worker_id}", timeout=5.0)
            return str(body.get("job_status") or body) if isinstance(body, dict) else str(body)
        except RouterError as e:
            return str(e)

    async def remove_worker(self, url_or_id: str, timeout: float | None = None) -> bool:
        """Deregister an engine by URL or worker id; False if the router does not list it."""
        limit = timeout or self.timeout
        workers = await self.list_workers()
        target = next((w for w in workers if w.get("id") == url_or_id or _norm(w.get("url", "")) == _norm(url_or_id)),
                      None)
        if target is None:
            return False
        try:
            await self._call("DELETE", f"/workers/{target['id']}")
        except RouterError as e:
            if e.status == 404:
                return False
            raise
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if all(w.get("id") != target["id"] for w in await self.list_workers()):
                logger.info("router %s: removed engine %s", self.url, target.get("url"))
                return True
            await asyncio.sleep(self.poll_interval)
        raise RouterError(self.url, f"/workers/{target['id']}", None,
                          f"engine {target.get('url')} still listed {limit:.0f}s after DELETE")

    async def wait_healthy(self, url: str, timeout: float | None = None) -> dict:
        """Until the router lists ``url`` as healthy; returns its worker record."""
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        last = None
        while time.monotonic() < deadline:
            last = await self.find_worker(url)
            if last is not None and last.get("is_healthy"):
                return last
            await asyncio.sleep(self.poll_interval)
        raise RouterError(self.url, "/workers", None,
                          f"engine {url} not healthy in the router within {limit:.0f}s (record: {last})")


async def remove_dead_workers(router: RouterClient, api_key: str | None = None, probe_timeout: float = 5.0,
                              attempts: int = 2, interval: float = 0.5) -> list[str]:
    """Probe every worker's ``/health`` directly; DELETE those failing ``attempts`` probes in a row.

    Returns the removed URLs. Used by the driver's health loop (the router never removes workers itself).
    """
    removed = []
    for w in await router.list_workers():
        url = w.get("url", "")
        ctl = EngineControl(url, api_key if api_key is not None else router.api_key, timeout=probe_timeout)
        try:
            for i in range(attempts):
                if await ctl.health():
                    break
                if i + 1 < attempts:
                    await asyncio.sleep(interval)
            else:
                logger.warning("engine %s failed %d health probes: removing it from router %s", url, attempts,
                               router.url)
                if await router.remove_worker(w["id"]):
                    removed.append(url)
        finally:
            await ctl.close()
    return removed


def connect_or_start_router(rollout: RolloutConfig, *, host: str, api_key: str | None = None,
                            startup_timeout: float = 60.0, log_path: str | os.PathLike | None = None,
                            extra_args: Sequence[str] = ()) -> tuple[str, RouterProcess | None]:
    """The router URL for this run: a running one from ``--sglang-router-ip/--sglang-router-port``,
    else a new child router on ``host`` (returned so that the driver stops it at exit), started with the
    user's ``--router-*`` flags."""
    ip, port = rollout.sglang_router_ip, rollout.sglang_router_port
    if (ip is None) != (port is None):
        raise ConfigError(f"--sglang-router-ip ({ip}) and --sglang-router-port ({port}) go together: give both "
                          "to use a running router, or neither to let miles start one.")
    if ip is not None:
        if rollout.router_args:
            flag = load_spec()[next(iter(rollout.router_args))].flag
            raise ConfigError(f"{flag} cannot apply: --sglang-router-ip {ip} names a running router, which miles "
                              f"does not start; set it on that router, or drop --sglang-router-ip/--sglang-router-port.")
        url = engine_url(ip, port)
        ok, why = _http_ok(url + "/liveness", timeout=min(10.0, startup_timeout))
        if not ok:
            raise ConfigError(f"--sglang-router-ip {ip} --sglang-router-port {port}: no router answers at "
                              f"{url}/liveness ({why}). Start it first, or drop both flags to let miles start one.")
        logger.info("using the running sglang-router at %s", url)
        return url, None
    proc = RouterProcess.start(host, None, rollout.sglang_router_policy, extra_args, startup_timeout,
                               api_key=api_key, request_timeout_secs=rollout.sglang_router_request_timeout_secs,
                               log_path=log_path, router_args=rollout.router_args)
    return proc.url, proc
