"""FT timings from the flags, and the health probe against a real aiohttp server that hangs or dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config import ConfigError, FTConfig
from miles.ft.heartbeat import probe_health
from miles.ft.membership import EngineMember, diff_rounds
from miles.ft.timing import ft_timings
from miles.utils.net import port_open

HERE = Path(__file__).resolve().parent


def _ft(**kw) -> FTConfig:
    base = dict(use_fault_tolerance=True, rollout_health_check_interval=10.0, rollout_health_check_timeout=30.0,
                rollout_health_check_first_wait=300.0, max_engine_restarts=3)
    base.update(kw)
    return FTConfig(**base)


def test_timings_from_defaults_detect_a_dead_engine_within_seconds():
    t = ft_timings(_ft())
    assert t.heartbeat_period == 1.0
    assert t.heartbeat_timeout == 4.0
    assert t.heartbeat_period + t.heartbeat_timeout + t.join_timeout <= 10.0
    assert t.hang_detection_bound == pytest.approx(10 + 30 + 1 + 4 + 4)
    fast = ft_timings(_ft(rollout_health_check_interval=0.5, rollout_health_check_timeout=1.0))
    assert fast.heartbeat_period == 0.25 and fast.heartbeat_timeout == 1.0


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("rollout_health_check_interval", 0.0, "--rollout-health-check-interval"),
    ("rollout_health_check_timeout", -1.0, "--rollout-health-check-timeout"),
    ("rollout_health_check_first_wait", -5.0, "--rollout-health-check-first-wait"),
    ("max_engine_restarts", -1, "--max-engine-restarts"),
])
def test_bad_flags_name_the_flag_and_value(field, value, flag):
    with pytest.raises(ConfigError, match=flag) as e:
        ft_timings(_ft(**{field: value}))
    assert str(value) in str(e.value)


def test_diff_rounds_orders_down_before_up_and_sees_fast_restarts():
    a = {0: EngineMember(0, "u0", 0), 1: EngineMember(1, "u1", 0), 2: EngineMember(2, "u2", 0)}
    b = {0: EngineMember(0, "u0", 1), 2: EngineMember(2, "u2", 0), 3: EngineMember(3, "u3", 0)}
    ev = [(e.kind, e.engine_id, e.incarnation) for e in diff_rounds(a, b, {}, 7, 0.0)]
    assert ev == [("down", 0, 0), ("down", 1, 0), ("up", 0, 1), ("up", 3, 0)]
    assert diff_rounds(a, a, {}, 7, 0.0) == []


@pytest.fixture
def server(free_port):
    procs = []

    def start(*extra: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(HERE / "health_server.py"), "--port", str(free_port), *extra])
        procs.append(p)
        deadline = time.monotonic() + 30
        while not port_open("127.0.0.1", free_port):
            assert p.poll() is None, "health server exited"
            assert time.monotonic() < deadline, "health server did not start in 30s"
            time.sleep(0.05)
        return p

    yield start, f"http://127.0.0.1:{free_port}"
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait(10)


def test_probe_passes_then_fails_on_hang_and_death(server):
    start, url = server
    proc = start()
    assert probe_health(url, 2.0) == (True, "HTTP 200")
    os.kill(proc.pid, signal.SIGSTOP)  # a hang: the kernel still accepts the connection
    t0 = time.monotonic()
    ok, why = probe_health(url, 0.5)
    elapsed = time.monotonic() - t0
    assert not ok and "no answer within 0.5s" in why and "--rollout-health-check-timeout" in why
    assert 0.4 < elapsed < 2.0
    os.kill(proc.pid, signal.SIGCONT)
    assert probe_health(url, 2.0)[0]
    proc.kill()
    proc.wait(10)
    ok, why = probe_health(url, 0.5)
    assert not ok and why.startswith("unreachable")


def test_probe_reports_unhealthy_status(server):
    start, url = server
    start("--status", "503")
    assert probe_health(url, 2.0) == (False, "HTTP 503")


def test_paused_engine_is_healthy(server):
    start, url = server
    start("--paused")
    ok, why = probe_health(url, 2.0)
    assert ok and why.startswith("paused")
