"""The engine leader rank's side: heartbeat for its engine to the lighthouse while it is healthy.

One :class:`EngineHeartbeat` per engine, on the rank that supervises the engine's server process. Three
threads, all bounded by timeouts:

- *probe*: ``GET /health_generate`` every ``--rollout-health-check-interval`` (every 0.25 s while the
  engine is starting, so a restarted engine is back quickly). During ``--rollout-health-check-first-wait``
  after a (re)start failures do not count; the first passing probe makes the engine HEALTHY. A HEALTHY
  engine whose probe fails (no answer within ``--rollout-health-check-timeout``, a non-200, a refused
  connection) is UNHEALTHY: its heartbeats stop at once and, if its process is still alive (a hang), the
  process is killed so that its supervisor restarts it in place. An engine that is never healthy within
  the first wait is killed too.
- *heartbeat*: ``LighthouseClient.heartbeat`` every heartbeat period while HEALTHY and the process is
  alive. A process that exits stops the heartbeats within one period (no need to wait for a probe).
- *quorum*: re-joins the lighthouse's quorum rounds while HEALTHY, carrying ``{"engine_id", "url",
  "incarnation", "state"}``; that is how the driver learns the engine's address and incarnation. An
  engine whose supervisor gave up joins once more with ``state="given_up"`` and its reason, then stops.

The process itself is reached through the small :class:`SupervisedEngine` protocol (``miles.spmd``'s
EngineSupervisor is adapted to it by the caller), so this module imports no other plane.
"""

from __future__ import annotations

import enum
import http.client
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Protocol

from miles.ft.lighthouse import engine_replica_id, lighthouse_client, td
from miles.ft.timing import BackgroundLoops, FTTimings
from miles.utils.logging import get_logger

logger = get_logger(__name__)

STARTING_PROBE_PERIOD = 0.25


class SupervisedEngine(Protocol):
    """What the leader rank's heartbeat needs from the supervisor of its engine process."""

    @property
    def url(self) -> str: ...

    def alive(self) -> bool:
        """True while the current incarnation's process runs."""

    def incarnation(self) -> int:
        """How many times the process was (re)started; changes on every restart."""

    def kill(self, reason: str) -> None:
        """End the current incarnation (SIGKILL; works on a stopped process); the supervisor restarts it."""

    def given_up(self) -> str | None:
        """None, or why the supervisor stopped restarting the engine."""


class EngineState(enum.StrEnum):
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DEAD = "dead"
    GIVEN_UP = "given_up"


def _get(url: str, timeout: float) -> tuple[bool, str, bool]:
    """(passed, reason, answered): answered is False when no HTTP answer came (hang, refused, reset)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read(4096)
            return resp.status == 200, f"HTTP {resp.status}", True
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}", True
    except TimeoutError:
        return False, f"no answer within {timeout:g}s (--rollout-health-check-timeout)", False
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            return False, f"no answer within {timeout:g}s (--rollout-health-check-timeout)", False
        return False, f"unreachable ({reason})", False


def probe_health(url: str, timeout: float) -> tuple[bool, str]:
    """One health probe: (passed, reason). Never waits longer than about ``2 * timeout`` seconds.

    ``GET /health_generate`` must pass; when it answers non-200, ``GET /health`` is asked too: an engine
    whose generation is paused on purpose (a weight sync, released memory) answers 503 to the first and
    200 to the second, and is healthy. SGLang serves both routes with one handler, so there a broken
    engine fails both.
    """
    base = url.rstrip("/")
    ok, why, answered = _get(base + "/health_generate", timeout)
    if ok or not answered:
        return ok, why
    ok2, why2, _ = _get(base + "/health", timeout)
    if ok2:
        return True, f"paused ({why} on /health_generate, {why2} on /health)"
    return False, why


class EngineHeartbeat(BackgroundLoops):
    """Heartbeats for one engine while its health probes pass; restarts it in place when it hangs."""

    def __init__(self, engine_id: int, engine: SupervisedEngine, lighthouse_addr: str, timings: FTTimings) -> None:
        self.engine_id = engine_id
        self.engine = engine
        self.timings = timings
        self.replica_id = engine_replica_id(engine_id)
        self._lighthouse_addr = lighthouse_addr
        self._lock = threading.Lock()
        self._state = EngineState.STARTING
        self._incarnation = engine.incarnation()
        self._started = time.monotonic()
        self._last_ok = 0.0
        BackgroundLoops.__init__(self)
        self.kills = 0
        self._given_up_reason = ""

    # -- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        with self._lock:
            return self._state

    def _set(self, state: EngineState, why: str = "") -> None:
        with self._lock:
            if self._state == state or self._state == EngineState.GIVEN_UP:
                return
            old, self._state = self._state, state
        log = logger.info if state in (EngineState.HEALTHY, EngineState.STARTING) else logger.warning
        log("engine %d (incarnation %d, %s): %s -> %s%s", self.engine_id, self._incarnation, self.engine.url,
            old.value, state.value, f": {why}" if why else "")

    def _track_incarnation(self) -> None:
        """A new incarnation (the supervisor restarted the process) starts over in STARTING."""
        inc = self.engine.incarnation()
        if inc != self._incarnation:
            with self._lock:
                self._incarnation = inc
                self._started = time.monotonic()
                self._last_ok = 0.0
                if self._state != EngineState.GIVEN_UP:
                    self._state = EngineState.STARTING
            logger.info("engine %d restarted (incarnation %d); waiting for a healthy probe", self.engine_id, inc)

    def _check_given_up(self) -> bool:
        why = self.engine.given_up()
        if why is not None and self.state != EngineState.GIVEN_UP:
            self._set(EngineState.GIVEN_UP, why)
            self._given_up_reason = why
        return why is not None

    def beating(self) -> bool:
        """Whether a heartbeat is due now: HEALTHY, the process alive, and the last pass recent."""
        with self._lock:
            if self._state != EngineState.HEALTHY:
                return False
            fresh = time.monotonic() - self._last_ok < self.timings.probe_interval + self.timings.probe_timeout + 1.0
        return fresh and self.engine.alive()

    # -- threads -------------------------------------------------------------------------------
    def start(self) -> EngineHeartbeat:
        e = self.engine_id
        self._start_loops({f"probe-{e}": self._probe_loop, f"heartbeat-{e}": self._heartbeat_loop,
                           f"quorum-{e}": self._quorum_loop})
        return self

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            if self._check_given_up():
                return
            self._track_incarnation()
            state = self.state
            if state == EngineState.STARTING:
                self._probe_starting()
                period = STARTING_PROBE_PERIOD
            elif state == EngineState.HEALTHY:
                self._probe_healthy()
                period = self.timings.probe_interval
            else:  # UNHEALTHY or DEAD: wait for the supervisor's restart (a new incarnation)
                period = STARTING_PROBE_PERIOD
            self._stop.wait(period)

    def _probe_starting(self) -> None:
        if not self.engine.alive():
            return
        ok, why = probe_health(self.engine.url, min(self.timings.probe_timeout, max(STARTING_PROBE_PERIOD * 4, 1.0)))
        if ok:
            with self._lock:
                self._last_ok = time.monotonic()
            self._set(EngineState.HEALTHY, f"first healthy probe after {time.monotonic() - self._started:.1f}s")
            return
        if time.monotonic() - self._started > self.timings.cold_start:
            self._kill(f"not healthy within its cold start of {self.timings.cold_start:g}s (--engine-startup-timeout "
                       f"{self.timings.engine_startup_timeout:g} + --rollout-health-check-first-wait "
                       f"{self.timings.first_wait:g}; last probe: {why})")

    def _probe_healthy(self) -> None:
        ok, why = probe_health(self.engine.url, self.timings.probe_timeout)
        if ok:
            with self._lock:
                self._last_ok = time.monotonic()
            return
        if not self.engine.alive():
            self._set(EngineState.DEAD, "process exited")
            return
        self._set(EngineState.UNHEALTHY, f"health probe failed: {why}")
        self._kill(f"health probe failed while the process is alive (hung?): {why}")

    def _kill(self, reason: str) -> None:
        self.kills += 1
        self._set(EngineState.UNHEALTHY, reason)
        logger.warning("engine %d: killing incarnation %d so that it restarts in place: %s",
                       self.engine_id, self._incarnation, reason)
        self.engine.kill(reason)

    def _heartbeat_loop(self) -> None:
        client = None
        while not self._stop.is_set():
            if self.state == EngineState.HEALTHY and not self.engine.alive():
                self._set(EngineState.DEAD, "process exited")
            if self.beating():
                try:
                    client = client or lighthouse_client(self._lighthouse_addr)
                    client.heartbeat(self.replica_id, td(max(self.timings.heartbeat_period, 1.0)))
                except (RuntimeError, TimeoutError, OSError) as e:  # torchft's connect/transport errors; retried
                    client = None
                    logger.warning("engine %d: heartbeat to the lighthouse failed: %s", self.engine_id, e)
            self._stop.wait(self.timings.heartbeat_period)

    def _quorum_data(self, state: EngineState, reason: str = "") -> dict:
        return {"engine_id": self.engine_id, "url": self.engine.url, "incarnation": self._incarnation,
                "state": state.value, "reason": reason}

    def _quorum_loop(self) -> None:
        client = None
        round_timeout = td(2 * (self.timings.join_timeout + self.timings.heartbeat_timeout) + 1.0)
        while not self._stop.is_set():
            given_up = self.state == EngineState.GIVEN_UP
            if not (given_up or self.beating()):
                self._stop.wait(self.timings.heartbeat_period / 2)
                continue
            data = self._quorum_data(self.state, self._given_up_reason)
            try:
                client = client or lighthouse_client(self._lighthouse_addr)
                client.quorum(replica_id=self.replica_id, timeout=round_timeout, data=data)
            except TimeoutError:
                continue
            except (RuntimeError, OSError) as e:  # torchft's connect/transport errors; retried next period
                client = None
                logger.warning("engine %d: joining the lighthouse quorum failed: %s", self.engine_id, e)
            if given_up:
                logger.error("engine %d: given up (%s); the driver was told through the lighthouse", self.engine_id,
                             data["reason"])
                return
            self._stop.wait(self.timings.heartbeat_period)


class SupervisorEngine:
    """:class:`SupervisedEngine` over ``miles.spmd.supervisor.EngineSupervisor`` (duck-typed: no import).

    The supervisor must be built with ``max_restarts=--max-engine-restarts``; its restart count is the
    incarnation, and a hang is ended with SIGKILL to the engine process (the supervisor then restarts it).
    """

    def __init__(self, supervisor: object, url: str) -> None:
        self.supervisor = supervisor
        self._url = url.rstrip("/")

    @property
    def url(self) -> str:
        return self._url

    def alive(self) -> bool:
        return bool(self.supervisor.alive)

    def incarnation(self) -> int:
        return int(self.supervisor.restarts)

    def kill(self, reason: str) -> None:
        self.supervisor.kill(signal.SIGKILL)

    def given_up(self) -> str | None:
        if not self.supervisor.given_up:
            return None
        return (f"the engine process exited with code {self.supervisor.returncode} and its supervisor gave up after "
                f"{self.supervisor.max_restarts} restart(s) (--max-engine-restarts {self.supervisor.max_restarts})")


def start_engine_heartbeat(engine_id: int, supervisor: object, url: str, lighthouse_addr: str,
                           timings: FTTimings) -> EngineHeartbeat:
    """On an engine's leader rank, after its supervisor started: heartbeat for the engine until ``stop()``."""
    return EngineHeartbeat(engine_id, SupervisorEngine(supervisor, url), lighthouse_addr, timings).start()
