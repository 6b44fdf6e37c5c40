"""The driver's engine-recovery controller: routing follows health, and only current weights are served.

Per engine the controller keeps a state:

    starting --up--> routed --down--> down --up--> awaiting_weights --verified--> routed
                                        \\--given_up / too many restarts--> given_up

- ``down`` (the engine left the lighthouse quorum, see :mod:`miles.ft.membership`): it is deleted from the
  router at once. Its in-flight requests fail when the process dies (a hung one is killed by its leader),
  and the rollout client re-issues them through the router to the healthy engines: each sample still
  completes exactly once (the manager owns the sample slot; a retried request gets a fresh rid).
- ``up`` again (its leader restarted it in place): the engine serves its checkpoint's weights, not the
  trainer's, so it waits (``awaiting_weights``) until it has the current version: through ``catch_up``
  at once when the run can push weights from the driver alone (e.g. from disk), else in the loop's next
  weight sync, which includes every engine in :meth:`sync_targets` (a new weight group is formed with the
  live engines). :meth:`on_weights_updated` then checks that the engine reports that version and passes
  ``/health_generate``, and only then adds it back to the router.
- An engine that keeps dying is given up after ``--max-engine-restarts`` (its supervisor stops restarting it
  and says so through the lighthouse, or the driver counts more restarts than allowed): a clear error is
  logged and the run goes on with the rest. With none left, :meth:`check` raises :class:`NoEnginesLeftError`.

The loop calls (driver rank only; thread-safe):

    ctl = EngineRecoveryController(cfg.ft, engines={0: url0, 1: url1}, router=router_client,
                                   lighthouse_addr=lh.address, requests_retried=lambda: client.stats["retries"])
    ctl.start(); ctl.wait_routed(timeout=...)
    ... before each weight sync:  targets = ctl.sync_targets()        # [(engine_id, url)] to include
    ... after it succeeded:       ctl.on_weights_updated(version, [url for _, url in targets])
    ... after it failed:          ctl.on_sync_failed(error)           # drops the dead engines; then re-sync
    ... each rollout:             ctl.check(); ctl.metrics()          # ft/engine_restarts, ft/requests_retried, ...
    ctl.stop()
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from miles.config.ft import FTConfig
from miles.fleet.client import EngineError, SyncEngineControl, run_sync
from miles.ft.heartbeat import probe_health
from miles.ft.membership import EngineMembership, MembershipEvent
from miles.ft.timing import FTTimings, ft_timings
from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

STARTING, ROUTED, DOWN, AWAITING, GIVEN_UP = "starting", "routed", "down", "awaiting_weights", "given_up"
CATCHING_UP = "catching_up"  # AWAITING, while the driver pushes it the cached weights (not a sync target)


class NoEnginesLeftError(MilesError):
    """Every engine was given up: the run cannot generate any more."""


@dataclass
class Outage:
    """One engine outage, from the driver's point of view (``time.monotonic()`` seconds)."""

    engine_id: int
    url: str
    incarnation: int
    reason: str
    down_seen_at: float
    removed_at: float | None = None
    back_at: float | None = None           # the new incarnation joined the quorum
    admitted_at: float | None = None       # weights verified, back in the router
    catch_up_version: int | None = None
    given_up: bool = False

    @property
    def removal_s(self) -> float | None:
        return None if self.removed_at is None else self.removed_at - self.down_seen_at

    @property
    def recovery_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.down_seen_at


@dataclass
class _Engine:
    engine_id: int
    url: str
    state: str = STARTING
    incarnation: int = -1
    restarts: int = 0
    reason: str = ""


def _call(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """Call a router/engine client method whether it is async (RouterClient) or not."""
    out = fn(*args)
    if inspect.isawaitable(out):
        return run_sync(out, timeout=timeout)
    return out


class EngineRecoveryController:
    """See the module docstring. ``router`` has ``add_worker(url)`` / ``remove_worker(url)`` (sync or async)."""

    def __init__(self, ft: FTConfig, *, engines: Mapping[int, str], router: Any, lighthouse_addr: str,
                 api_key: str | None = None, initial_version: int | None = None,
                 catch_up: Callable[[int, str, int], int | None] | None = None,
                 requests_retried: Callable[[], int] | None = None, router_timeout: float = 30.0,
                 timings: FTTimings | None = None, events_path: str | os.PathLike | None = None,
                 await_first_sync: bool = False) -> None:
        self.timings = timings or ft_timings(ft)
        # True when a trainer will sync weights before the first rollout: engines joining before that
        # sync wait for it (AWAITING) instead of being routed with their checkpoint's weights
        self.await_first_sync = await_first_sync
        self.max_restarts = self.timings.max_engine_restarts
        self.router = router
        self.api_key = api_key
        self.catch_up = catch_up
        self.requests_retried = requests_retried
        self.router_timeout = router_timeout
        self.membership = EngineMembership(lighthouse_addr, self.timings)
        self._lock = threading.RLock()
        self._router_lock = threading.Lock()
        self._engines = {eid: _Engine(eid, url.rstrip("/")) for eid, url in engines.items()}
        self._version = initial_version   # None: the engines' own checkpoint is current (no sync yet)
        self._outages: list[Outage] = []
        self._open: dict[int, Outage] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition(self._lock)
        self.events_path = Path(events_path) if events_path is not None else None
        self._catch_up_tried: dict[int, tuple[int, int | None]] = {}  # engine -> (incarnation, version) tried

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> EngineRecoveryController:
        self.membership.start()
        self._thread = threading.Thread(target=self._run, name="miles-ft-recovery", daemon=True)
        self._thread.start()
        logger.info("engine recovery on: %d engine(s), max %d restart(s) each, health probe every %gs (timeout %gs, "
                    "first wait %gs)", len(self._engines), self.max_restarts, self.timings.probe_interval,
                    self.timings.probe_timeout, self.timings.first_wait)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.membership.stop(timeout)

    # -- queries for the loop --------------------------------------------------------------------
    def healthy_engine_urls(self) -> list[str]:
        """Engines in rotation (in the router, current weights)."""
        with self._lock:
            return [e.url for e in self._engines.values() if e.state == ROUTED]

    def states(self) -> dict[int, str]:
        with self._lock:
            return {eid: e.state for eid, e in self._engines.items()}

    def sync_targets(self) -> list[tuple[int, str]]:
        """Engines the next weight sync must include: those in rotation and those back awaiting weights."""
        with self._lock:
            return [(e.engine_id, e.url) for e in self._engines.values() if e.state in (ROUTED, AWAITING)]

    def outages(self) -> list[Outage]:
        with self._lock:
            return [Outage(**asdict(o)) for o in self._outages]

    def wait_routed(self, timeout: float, count: int | None = None) -> None:
        """Wait until ``count`` engines (default all not given up) are in rotation; raise after ``timeout``."""
        def ready() -> bool:
            want = count if count is not None else sum(e.state != GIVEN_UP for e in self._engines.values())
            return sum(e.state == ROUTED for e in self._engines.values()) >= max(1, want)
        self._wait(ready, timeout, "engines not in rotation")

    def wait_joined(self, timeout: float) -> None:
        """Wait until every engine has joined the lighthouse quorum at least once (or was given up)."""
        self._wait(lambda: all(e.state != STARTING for e in self._engines.values()), timeout,
                   "engines did not join the lighthouse quorum")

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        with self._changed:
            if not self._changed.wait_for(ready, timeout=timeout):
                raise TimeoutError(f"{what} within {timeout:.0f}s: {self.states()} "
                                   "(is each leader rank heartbeating to the lighthouse? see its log)")

    def check(self) -> None:
        """Raise NoEnginesLeftError when every engine was given up (the run must stop)."""
        with self._lock:
            if self._engines and all(e.state == GIVEN_UP for e in self._engines.values()):
                why = "; ".join(f"engine {e.engine_id} ({e.url}): {e.reason}" for e in self._engines.values())
                raise NoEnginesLeftError(f"every rollout engine was given up after --max-engine-restarts "
                                         f"{self.max_restarts}, so no rollout can be generated: {why}")

    def metrics(self) -> dict[str, float]:
        with self._lock:
            done = [o.recovery_s for o in self._outages if o.recovery_s is not None]
            removal = [o.removal_s for o in self._outages if o.removal_s is not None]
            m = {
                "ft/engine_restarts": float(sum(e.restarts for e in self._engines.values())),
                "ft/engine_failures": float(len(self._outages)),
                "ft/engines_in_rotation": float(sum(e.state == ROUTED for e in self._engines.values())),
                "ft/engines_given_up": float(sum(e.state == GIVEN_UP for e in self._engines.values())),
                "ft/recovery_time_s": done[-1] if done else 0.0,
                "ft/recovery_time_max_s": max(done) if done else 0.0,
                "ft/router_removal_time_s": removal[-1] if removal else 0.0,
            }
        if self.requests_retried is not None:
            m["ft/requests_retried"] = float(self.requests_retried())
        return m

    # -- weight-sync hooks -------------------------------------------------------------------------
    def on_weights_updated(self, version: int, synced_urls: Iterable[str] | None = None) -> list[int]:
        """A weight sync of ``version`` finished; verify and re-admit the engines it brought up to date.

        Returns the ids admitted to the router. ``synced_urls`` None means every sync target.
        """
        with self._lock:
            self._version = int(version)
            synced = None if synced_urls is None else {u.rstrip("/") for u in synced_urls}
            waiting = [e for e in self._engines.values() if e.state == AWAITING and (synced is None or e.url in synced)]
            for e in waiting:  # this sync brought them to the version: no catch-up for it (see _reconcile)
                self._catch_up_tried[e.engine_id] = (e.incarnation, self._version)
        return [e.engine_id for e in waiting if self._verify_and_admit(e, e.incarnation)]

    def on_sync_failed(self, error: BaseException, probe_timeout: float = 5.0) -> list[int]:
        """A weight sync failed: take engines that fail a health probe out now (they are re-admitted after
        they come back and catch up). Returns their ids; the caller re-syncs with :meth:`sync_targets`."""
        dead = []
        for eid, url in self.sync_targets():
            if not self._healthy(url, probe_timeout):
                dead.append(eid)
                self._take_down(eid, None, f"failed during a weight sync ({error})")
        if not dead:
            logger.warning("weight sync failed but every engine passes its health probe: %s", error)
        return dead

    # -- the event thread --------------------------------------------------------------------------
    def _run(self) -> None:
        last_reconcile = time.monotonic()
        while not self._stop.is_set():
            ev = self.membership.next_event(timeout=0.2)
            try:
                if ev is not None:
                    self._handle(ev)
                if time.monotonic() - last_reconcile > 1.0:
                    last_reconcile = time.monotonic()
                    self._reconcile()
            except (EngineError, OSError, RuntimeError, TimeoutError) as e:
                what = f"{ev.kind} of engine {ev.engine_id}" if ev is not None else "reconciling"
                logger.error("engine recovery: handling %s failed: %s", what, e)

    def _handle(self, ev: MembershipEvent) -> None:
        with self._lock:
            e = self._engines.get(ev.engine_id)
            if e is None:
                logger.warning("engine %d (%s) joined the lighthouse but is not one of this run's engines %s; ignored",
                               ev.engine_id, ev.url, sorted(self._engines))
                return
        if ev.kind == "down":
            self._take_down(ev.engine_id, ev, ev.reason)
        elif ev.kind == "given_up":
            self._give_up(e, ev.reason)
        elif ev.kind == "up":
            self._on_up(e, ev)

    def _take_down(self, eid: int, ev: MembershipEvent | None, reason: str) -> None:
        with self._lock:
            e = self._engines[eid]
            if ev is not None and ev.incarnation != e.incarnation and e.state not in (ROUTED, AWAITING, CATCHING_UP):
                return  # an old incarnation we already took down
            if e.state in (DOWN, GIVEN_UP, STARTING):
                return
            was_routed = e.state == ROUTED
            e.state, e.reason = DOWN, reason
            outage = self._open_outage(e, reason, ev.at if ev is not None else time.monotonic())
            self._changed.notify_all()
        logger.warning("engine %d (%s) is down (%s): removing it from the router; its in-flight requests are retried "
                       "on the other engines", eid, e.url, reason)
        if was_routed:
            self._router_remove(e.url)
        with self._lock:
            outage.removed_at = time.monotonic()
        self._write_event(outage, "removed")

    def _give_up(self, e: _Engine, reason: str) -> None:
        with self._lock:
            if e.state == GIVEN_UP:
                return
            was_routed = e.state in (ROUTED, AWAITING)
            e.state, e.reason = GIVEN_UP, reason
            closed = self._open.pop(e.engine_id, None)
            if closed is not None:
                closed.given_up = True
            left = [x.engine_id for x in self._engines.values() if x.state != GIVEN_UP]
            self._changed.notify_all()
        if closed is not None:
            self._write_event(closed, "given_up")
        if was_routed:
            self._router_remove(e.url)
        if left:
            logger.error("engine %d (%s) given up (--max-engine-restarts %d): %s. The run goes on with engine(s) %s",
                         e.engine_id, e.url, self.max_restarts, reason, left)
        else:
            logger.error("engine %d (%s) given up (%s) and no engine is left: the run stops at its next check",
                         e.engine_id, e.url, reason)

    def _on_up(self, e: _Engine, ev: MembershipEvent) -> None:
        with self._lock:
            if e.state == GIVEN_UP:
                logger.warning("engine %d came back (incarnation %d) after it was given up; it stays out of rotation",
                               e.engine_id, ev.incarnation)
                return
            first = e.state == STARTING
            was_routed = e.state == ROUTED
            if not first:
                e.restarts += 1
                if e.state in (ROUTED, AWAITING, CATCHING_UP):  # back before we saw it leave: open the outage now
                    outage = self._open_outage(e, f"restarted (incarnation {e.incarnation} -> {ev.incarnation})", ev.at)
                    outage.removed_at = ev.at if not was_routed else None
            too_many = not first and e.restarts > self.max_restarts
            if not too_many:
                e.incarnation, e.url = ev.incarnation, (ev.url or e.url).rstrip("/")
                e.state = AWAITING
                if e.engine_id in self._open:
                    self._open[e.engine_id].back_at = ev.at
                self._changed.notify_all()  # wait_joined
        if was_routed:
            self._router_remove(e.url)
            with self._lock:
                opened = self._open.get(e.engine_id)
                if opened is not None:
                    opened.removed_at = time.monotonic()
            if opened is not None:
                self._write_event(opened, "removed")
        if too_many:
            self._give_up(e, f"it died {e.restarts} times, more than --max-engine-restarts {self.max_restarts}")
            return
        self._resume(e, ev.incarnation)

    def _open_outage(self, e: _Engine, reason: str, at: float) -> Outage:
        outage = Outage(e.engine_id, e.url, e.incarnation, reason, at)
        self._outages.append(outage)
        self._open[e.engine_id] = outage
        return outage

    def _resume(self, e: _Engine, incarnation: int) -> None:
        """An AWAITING engine: admit it now if its weights are current, or after catching it up."""
        with self._lock:
            version = self._version
        if version is None and self.await_first_sync:
            logger.info("engine %d up (incarnation %d): routed after the initial weight sync", e.engine_id, incarnation)
            return
        if version is None:  # no trainer syncs weights: its checkpoint weights are the current ones
            self._verify_and_admit(e, incarnation)
            return
        if self.catch_up is None:
            logger.info("engine %d back (incarnation %d): out of rotation until the next weight sync brings it to v%d",
                        e.engine_id, incarnation, version)
            return
        with self._lock:
            if e.state != AWAITING or e.incarnation != incarnation:
                return
            e.state = CATCHING_UP
            self._catch_up_tried[e.engine_id] = (incarnation, version)
        logger.info("engine %d back (incarnation %d): pushing it weights v%d before routing to it", e.engine_id,
                    incarnation, version)
        pushed = None
        try:
            pushed = self.catch_up(e.engine_id, e.url, version)
        except (EngineError, OSError, RuntimeError, ValueError) as err:
            logger.warning("engine %d: catching up to v%d failed (%s); it waits for the next weight sync",
                           e.engine_id, version, err)
        with self._lock:
            if e.state != CATCHING_UP or e.incarnation != incarnation:
                return  # it went down meanwhile
            e.state = AWAITING
            if pushed is not None and e.engine_id in self._open:
                self._open[e.engine_id].catch_up_version = pushed
        if pushed is not None:
            self._verify_and_admit(e, incarnation)

    def _reconcile(self) -> None:
        """An engine taken out by :meth:`on_sync_failed` that still heartbeats (its leader saw nothing wrong)
        rejoins as AWAITING after the lighthouse had time to drop it; otherwise it would wait forever."""
        live = self.membership.live()
        t = self.timings
        grace = t.probe_interval + t.probe_timeout + t.heartbeat_timeout + t.join_timeout + 1.0
        now = time.monotonic()
        back = []
        with self._lock:
            for e in self._engines.values():
                m, outage = live.get(e.engine_id), self._open.get(e.engine_id)
                if (e.state == DOWN and m is not None and m.incarnation == e.incarnation and outage is not None
                        and now - outage.down_seen_at > grace):
                    e.state = AWAITING
                    outage.back_at = now
                    back.append(e)
            if self.catch_up is not None and self._version is not None:  # a newer version to catch up to
                retry = [e for e in self._engines.values() if e.state == AWAITING and e not in back
                         and self._catch_up_tried.get(e.engine_id) != (e.incarnation, self._version)]
            else:
                retry = []
        for e in back:
            logger.info("engine %d (%s) still heartbeats %.0fs after it was taken out: it rejoins once its weights are "
                        "current", e.engine_id, e.url, grace)
            self._resume(e, e.incarnation)
        for e in retry:
            self._resume(e, e.incarnation)

    def _write_event(self, o: Outage, event: str) -> None:
        """One JSON line per step of an outage (``removed``, then ``recovered`` or ``given_up``), wall-clock
        seconds, for the run's output dir and the soak."""
        if self.events_path is None:
            return
        offset = time.time() - time.monotonic()
        wall = {k: (None if v is None else v + offset) for k, v in
                (("down_seen", o.down_seen_at), ("removed", o.removed_at), ("back", o.back_at), ("admitted", o.admitted_at))}
        record = {"event": event, "engine_id": o.engine_id, "url": o.url, "incarnation": o.incarnation, "reason": o.reason,
                  **wall, "removal_s": o.removal_s, "recovery_s": o.recovery_s, "given_up": o.given_up,
                  "catch_up_version": o.catch_up_version,
                  "requests_retried": self.requests_retried() if self.requests_retried is not None else None}
        try:
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.events_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            logger.warning("cannot append to %s: %s", self.events_path, err)

    # -- checks and router calls -----------------------------------------------------------------------
    def _healthy(self, url: str, timeout: float) -> bool:
        return probe_health(url, timeout)[0]

    def _engine_version(self, url: str, timeout: float) -> str | None:
        ctl = SyncEngineControl(url, self.api_key, timeout=timeout)
        try:
            info = ctl.get_model_info()
        except EngineError:
            return None
        finally:
            ctl.close()
        v = info.get("weight_version") if isinstance(info, dict) else None
        return None if v is None else str(v)

    def _verify_and_admit(self, e: _Engine, incarnation: int) -> bool:
        timeout = max(self.timings.probe_timeout, 5.0)
        with self._lock:
            version = self._version
        if version is not None:
            got = self._engine_version(e.url, timeout)
            if got != str(version):
                logger.warning("engine %d (%s) reports weight_version %r, not the current v%d: kept out of rotation "
                               "until a weight sync reaches it", e.engine_id, e.url, got, version)
                return False
        if not self._healthy(e.url, timeout):
            logger.warning("engine %d (%s) fails /health_generate after catching up; kept out of rotation",
                           e.engine_id, e.url)
            return False
        with self._lock:
            if e.state != AWAITING or e.incarnation != incarnation:
                return False  # it went down meanwhile
        self._router_add(e.url)
        with self._lock:
            if e.state != AWAITING or e.incarnation != incarnation:
                self._router_remove(e.url)
                return False
            e.state, e.reason = ROUTED, ""
            outage = self._open.pop(e.engine_id, None)
            if outage is not None:
                outage.admitted_at = time.monotonic()
            self._changed.notify_all()
        if outage is not None:
            self._write_event(outage, "recovered")
        if outage is not None:
            logger.info("engine %d (%s) back in rotation %.1fs after it went down%s", e.engine_id, e.url,
                        outage.recovery_s, "" if version is None else f" (weights v{version} verified)")
        else:
            logger.info("engine %d (%s) in rotation", e.engine_id, e.url)
        return True

    def _router_add(self, url: str) -> None:
        with self._router_lock:
            _call(self.router.add_worker, url, timeout=self.router_timeout + 10)

    def _router_remove(self, url: str) -> None:
        with self._router_lock:
            try:
                _call(self.router.remove_worker, url, timeout=self.router_timeout + 10)
            except (EngineError, OSError, TimeoutError) as err:
                logger.error("removing engine %s from the router failed: %s", url, err)

