"""The driver's view of which engines are alive: it follows the torchft lighthouse's quorum.

The driver joins every quorum round as ``miles_driver_0`` (and heartbeats so that a slow round never
makes it look dead). Each round lists the engines whose leader ranks are heartbeating for them, with
the data they joined with (engine id, url, incarnation, state). Comparing consecutive rounds gives
events, in order:

- ``down``: an engine that was live is missing from a round, or came back with a new incarnation
  before the driver noticed it missing (then ``down`` is followed by ``up``);
- ``up``: an engine is live that was not (first start, or back after a restart);
- ``given_up``: an engine's supervisor stopped restarting it (its leader joins once more to say so).

    m = EngineMembership(lighthouse.address, timings).start()
    ev = m.next_event(timeout=1.0)     # MembershipEvent | None
    m.live()                           # {engine_id: EngineMember}
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from miles.ft.lighthouse import DRIVER_REPLICA_ID, lighthouse_client, parse_engine_replica_id, td
from miles.ft.timing import BackgroundLoops, FTTimings
from miles.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class EngineMember:
    engine_id: int
    url: str
    incarnation: int


@dataclass(frozen=True)
class MembershipEvent:
    kind: str  # "up" | "down" | "given_up"
    engine_id: int
    url: str
    incarnation: int
    reason: str
    at: float  # time.monotonic() when the driver saw it
    quorum_id: int


def diff_rounds(before: dict[int, EngineMember], after: dict[int, EngineMember], given_up: dict[int, tuple[EngineMember, str]],
                quorum_id: int, now: float) -> list[MembershipEvent]:
    """Events that turn the live set ``before`` into ``after`` (pure; exposed for tests)."""
    events: list[MembershipEvent] = []
    for eid, old in sorted(before.items()):
        new = after.get(eid)
        if new is None:
            reason = "given up" if eid in given_up else "left the lighthouse quorum (heartbeats stopped)"
            events.append(MembershipEvent("down", eid, old.url, old.incarnation, reason, now, quorum_id))
        elif new.incarnation != old.incarnation:
            events.append(MembershipEvent("down", eid, old.url, old.incarnation,
                                          f"restarted (incarnation {old.incarnation} -> {new.incarnation})", now, quorum_id))
    for eid, new in sorted(after.items()):
        old = before.get(eid)
        if old is None or old.incarnation != new.incarnation:
            events.append(MembershipEvent("up", eid, new.url, new.incarnation, "joined the lighthouse quorum", now, quorum_id))
    for eid, (member, why) in sorted(given_up.items()):
        events.append(MembershipEvent("given_up", eid, member.url, member.incarnation, why, now, quorum_id))
    return events


class EngineMembership(BackgroundLoops):
    """Follows the lighthouse's quorum rounds from the driver; thread-safe."""

    def __init__(self, lighthouse_addr: str, timings: FTTimings,
                 on_event: Callable[[MembershipEvent], None] | None = None) -> None:
        self._addr = lighthouse_addr
        self.timings = timings
        self._on_event = on_event
        self._events: queue.Queue[MembershipEvent] = queue.Queue()
        self._cond = threading.Condition()
        self._live: dict[int, EngineMember] = {}
        self._given_up: set[int] = set()
        self.quorum_id = -1
        self.rounds = 0
        BackgroundLoops.__init__(self)

    def start(self) -> EngineMembership:
        self._start_loops({"driver-heartbeat": self._heartbeat_loop, "membership": self._round_loop})
        return self

    # -- queries -------------------------------------------------------------------------------
    def live(self) -> dict[int, EngineMember]:
        with self._cond:
            return dict(self._live)

    def next_event(self, timeout: float | None = None) -> MembershipEvent | None:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_for(self, predicate: Callable[[dict[int, EngineMember]], bool], timeout: float) -> bool:
        """Wait until ``predicate(live())`` holds; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(dict(self._live)), timeout=timeout)

    def wait_rounds(self, n: int, timeout: float) -> bool:
        """Wait until ``n`` more quorum rounds have completed (a fresh view of the quorum)."""
        with self._cond:
            target = self.rounds + n
            return self._cond.wait_for(lambda: self.rounds >= target, timeout=timeout)

    # -- threads -------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        client = None
        while not self._stop.is_set():
            try:
                client = client or lighthouse_client(self._addr)
                client.heartbeat(DRIVER_REPLICA_ID, td(max(self.timings.heartbeat_period, 1.0)))
            except (RuntimeError, TimeoutError, OSError) as e:  # torchft's transport errors; retried
                client = None
                logger.warning("driver heartbeat to the lighthouse at %s failed: %s", self._addr, e)
            self._stop.wait(self.timings.heartbeat_period)

    def _round_loop(self) -> None:
        client = None
        round_timeout = td(2 * (self.timings.join_timeout + self.timings.heartbeat_timeout) + 1.0)
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                client = client or lighthouse_client(self._addr)
                quorum = client.quorum(replica_id=DRIVER_REPLICA_ID, timeout=round_timeout, data={"role": "driver"})
                failing_since = None
            except TimeoutError:
                continue
            except (RuntimeError, OSError) as e:  # torchft's transport errors; retried
                client = None
                now = time.monotonic()
                failing_since = failing_since or now
                logger.warning("driver cannot reach the lighthouse at %s for %.0fs: %s", self._addr, now - failing_since, e)
                self._stop.wait(1.0)
                continue
            self._apply(quorum)
            self._stop.wait(self.timings.heartbeat_period)

    def _apply(self, quorum: object) -> None:
        after: dict[int, EngineMember] = {}
        given_up: dict[int, tuple[EngineMember, str]] = {}
        for p in quorum.participants:
            eid = parse_engine_replica_id(p.replica_id)
            if eid is None:
                continue
            data = p.data or {}
            member = EngineMember(eid, str(data.get("url", "")), int(data.get("incarnation", 0)))
            if data.get("state") == "given_up":
                if eid not in self._given_up:
                    given_up[eid] = (member, str(data.get("reason", "")))
            else:
                after[eid] = member
        with self._cond:
            before = self._live
            for eid in self._given_up:
                after.pop(eid, None)
            events = diff_rounds(before, after, given_up, int(quorum.quorum_id), time.monotonic())
            self._given_up.update(given_up)
            self._live = after
            self.quorum_id = int(quorum.quorum_id)
            self.rounds += 1
            self._cond.notify_all()
        for ev in events:
            log = logger.info if ev.kind == "up" else logger.warning
            log("engine %d (%s, incarnation %d) %s: %s", ev.engine_id, ev.url, ev.incarnation, ev.kind, ev.reason)
            self._events.put(ev)
            if self._on_event is not None:
                self._on_event(ev)
