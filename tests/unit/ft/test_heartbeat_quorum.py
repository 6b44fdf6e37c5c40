"""Real torchft: a lighthouse here, engine leaders in their own processes heartbeating for real aiohttp
servers; the driver's membership follows the quorum while we SIGKILL and SIGSTOP things."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config import FTConfig
from miles.ft.lighthouse import Lighthouse, torchft_coordination
from miles.ft.membership import EngineMembership, MembershipEvent
from miles.ft.timing import ft_timings
from miles.utils.net import find_free_port
from miles.utils.optional import MissingDependencyError

try:
    torchft_coordination()
except MissingDependencyError as e:
    pytest.skip(str(e), allow_module_level=True)
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve().parent
INTERVAL, TIMEOUT = 0.5, 1.0


def _timings(max_restarts: int = 3, first_wait: float = 10.0, startup_timeout: float = 0.0):
    return ft_timings(FTConfig(use_fault_tolerance=True, rollout_health_check_interval=INTERVAL,
                               rollout_health_check_timeout=TIMEOUT, rollout_health_check_first_wait=first_wait,
                               max_engine_restarts=max_restarts), engine_startup_timeout=startup_timeout)


class Cluster:
    def __init__(self, tmp: Path, timings) -> None:
        self.tmp, self.timings = tmp, timings
        self.lh = Lighthouse.start(timings, bind_host="127.0.0.1")
        self.membership = EngineMembership(self.lh.address, timings).start()
        self.leaders: dict[int, subprocess.Popen] = {}
        self.events: list[MembershipEvent] = []
        self.pending: list[MembershipEvent] = []

    def leader(self, eid: int, *server_args: str) -> None:
        port = find_free_port()
        argv = [sys.executable, str(HERE / "leader_agent.py"), "--lighthouse", self.lh.address, "--engine-id", str(eid),
                "--url", f"http://127.0.0.1:{port}", "--pid-file", str(self.tmp / f"engine{eid}.pid"),
                "--interval", str(INTERVAL), "--timeout", str(TIMEOUT),
                "--max-restarts", str(self.timings.max_engine_restarts),
                "--first-wait", str(self.timings.first_wait),
                "--startup-timeout", str(self.timings.engine_startup_timeout),
                "--", sys.executable, str(HERE / "health_server.py"), "--port", str(port), *server_args]
        self.leaders[eid] = subprocess.Popen(argv)

    def child_pid(self, eid: int, min_incarnation: int = 0) -> tuple[int, int]:
        """(pid, incarnation) of the engine process now running, once the leader has published an incarnation
        of at least ``min_incarnation`` (a restarted engine's pid is published a moment after it is up)."""
        path = self.tmp / f"engine{eid}.pid"
        deadline = time.monotonic() + 30
        while True:
            fields = path.read_text().split() if path.exists() else []
            if len(fields) == 2 and int(fields[1]) >= min_incarnation:
                return int(fields[0]), int(fields[1])
            assert time.monotonic() < deadline, f"engine {eid}: no pid of incarnation >= {min_incarnation}: {fields}"
            time.sleep(0.05)

    def expect(self, kind: str, eid: int, timeout: float) -> MembershipEvent:
        """The first not yet expected event of this kind for this engine (events of others stay queued)."""
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.pending:
                if ev.kind == kind and ev.engine_id == eid:
                    self.pending.remove(ev)
                    return ev
            if time.monotonic() > deadline:
                raise AssertionError(f"no '{kind}' event for engine {eid} within {timeout}s; saw {self.events}")
            ev = self.membership.next_event(timeout=0.2)
            if ev is not None:
                self.events.append(ev)
                self.pending.append(ev)

    def close(self) -> None:
        for p in self.leaders.values():
            if p.poll() is None:
                p.terminate()
        for eid, p in self.leaders.items():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            path = self.tmp / f"engine{eid}.pid"
            try:
                pid = int(path.read_text().split()[0])
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        self.membership.stop()
        self.lh.shutdown()


@pytest.fixture
def cluster(tmp_path):
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(tmp_path, _timings(**kw))
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_engines_leave_on_kill_and_hang_and_come_back_restarted(cluster):
    c = cluster()
    for eid in range(3):
        c.leader(eid)
    for eid in range(3):
        assert c.expect("up", eid, timeout=60).incarnation == 0
    t = c.timings

    # 1. the engine process dies: it leaves the quorum within a few seconds and is back restarted.
    pid, inc = c.child_pid(0)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    down = c.expect("down", 0, timeout=10)
    assert down.at - t_kill < t.heartbeat_period + t.heartbeat_timeout + t.join_timeout + 2.0
    up = c.expect("up", 0, timeout=30)
    assert up.incarnation == inc + 1

    # 2. the engine process hangs (SIGSTOP): the probes time out, heartbeats stop, the leader kills it,
    #    its supervisor restarts it in place.
    pid, inc = c.child_pid(1)
    t_stop = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    down = c.expect("down", 1, timeout=t.hang_detection_bound + 5)
    assert down.at - t_stop < t.hang_detection_bound + 2.0
    up = c.expect("up", 1, timeout=30)
    assert up.incarnation > inc

    # 3. the leader rank itself dies: the engine leaves for good.
    c.leaders[2].kill()
    c.expect("down", 2, timeout=10)
    assert set(c.membership.live()) == {0, 1}
    # nothing else flapped: exactly one down per injected fault
    assert [(e.kind, e.engine_id) for e in c.events if e.kind == "down"] == [("down", 0), ("down", 1), ("down", 2)]


def test_cold_start_is_not_killed_and_a_crashing_engine_is_given_up(cluster):
    c = cluster(max_restarts=1, first_wait=0.0, startup_timeout=8.0)  # Miles's first wait (0): the cold start
    c.leader(0, "--unhealthy-for", "3")  # 503 for 3 s: within --engine-startup-timeout + first wait
    c.leader(1)
    up = c.expect("up", 0, timeout=60)
    assert up.incarnation == 0, "a cold start inside --engine-startup-timeout must not be restarted"
    c.expect("up", 1, timeout=60)
    os.kill(c.child_pid(1)[0], signal.SIGKILL)
    c.expect("up", 1, timeout=30)
    os.kill(c.child_pid(1, min_incarnation=1)[0], signal.SIGKILL)  # the restarted process, not the dead one
    ev = c.expect("given_up", 1, timeout=30)
    assert "--max-engine-restarts 1" in ev.reason
    assert set(c.membership.live()) == {0}
