"""Timings of the fault-tolerance plane, derived once from the ``--rollout-health-check-*`` flags.

Three clocks matter:

- the health *probe*: ``GET /health_generate`` every ``--rollout-health-check-interval`` seconds, failed
  after ``--rollout-health-check-timeout`` seconds; a (re)started engine has its *cold start*,
  ``--engine-startup-timeout`` plus Miles's grace ``--rollout-health-check-first-wait`` seconds, to pass
  its first probe (failed probes before that do not count);
- the torchft *heartbeat*: the leader rank heartbeats for its engine every ``heartbeat_period`` seconds
  while the engine process is alive and its last probe passed recently; the lighthouse forgets a
  replica ``heartbeat_timeout`` seconds after its last heartbeat;
- the *quorum round*: every participant (the driver and each healthy engine) re-joins the lighthouse's
  quorum every ``heartbeat_period`` seconds; a round waits at most ``join_timeout`` for stragglers.

So a killed engine leaves the quorum about ``heartbeat_period + heartbeat_timeout`` after its death, a
hung one about ``interval + timeout + heartbeat_timeout`` after it stopped answering.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from miles.config.base import ConfigError
from miles.config.ft import FTConfig


@dataclass(frozen=True)
class FTTimings:
    probe_interval: float
    probe_timeout: float
    first_wait: float
    heartbeat_period: float
    heartbeat_timeout: float
    join_timeout: float
    max_engine_restarts: int
    engine_startup_timeout: float = 0.0

    @property
    def cold_start(self) -> float:
        """Seconds a (re)started engine has to pass its first health probe before it is killed."""
        return self.engine_startup_timeout + self.first_wait

    @property
    def hang_detection_bound(self) -> float:
        """Upper bound of seconds from an engine hanging to its leaving the quorum."""
        return self.probe_interval + self.probe_timeout + self.heartbeat_period + self.heartbeat_timeout + self.join_timeout


def ft_timings(ft: FTConfig, engine_startup_timeout: float = 0.0) -> FTTimings:
    """Validate the fault-tolerance flags and derive the heartbeat clocks from them (``engine_startup_timeout``:
    ``--engine-startup-timeout``, part of a restarted engine's cold start)."""
    checks = (
        ("rollout_health_check_interval", ft.rollout_health_check_interval, 0.0, "e.g. 10"),
        ("rollout_health_check_timeout", ft.rollout_health_check_timeout, 0.0, "e.g. 30"),
    )
    for name, value, low, hint in checks:
        if value is None or value <= low:
            raise ConfigError(f"--{name.replace('_', '-')} must be > {low:g} seconds, got {value}: pass {hint}.")
    if ft.rollout_health_check_first_wait is None or ft.rollout_health_check_first_wait < 0:
        raise ConfigError(f"--rollout-health-check-first-wait must be >= 0 seconds, got "
                          f"{ft.rollout_health_check_first_wait}: pass the longest cold start you expect (e.g. 300).")
    if ft.max_engine_restarts is None or ft.max_engine_restarts < 0:
        raise ConfigError(f"--max-engine-restarts must be >= 0, got {ft.max_engine_restarts}: pass 0 to never "
                          f"restart an engine, or a small count such as 3.")
    period = min(max(ft.rollout_health_check_interval / 2.0, 0.1), 1.0)
    hb_timeout = max(4.0 * period, 1.0)
    return FTTimings(
        probe_interval=float(ft.rollout_health_check_interval),
        probe_timeout=float(ft.rollout_health_check_timeout),
        first_wait=float(ft.rollout_health_check_first_wait),
        heartbeat_period=period,
        heartbeat_timeout=hb_timeout,
        join_timeout=hb_timeout,
        max_engine_restarts=int(ft.max_engine_restarts),
        engine_startup_timeout=float(engine_startup_timeout),
    )


class BackgroundLoops:
    """Daemon threads, one per loop, that run until ``stop()``; each loop polls ``self._stop``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _start_loops(self, loops: dict[str, Callable[[], None]]) -> None:
        for name, fn in loops.items():
            t = threading.Thread(target=fn, name=f"miles-ft-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
