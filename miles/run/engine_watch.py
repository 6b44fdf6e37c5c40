"""Without ``--use-fault-tolerance``: an engine that stops answering ends its rank (and so the job) in bounded time.

An engine process that exits is seen by its supervisor at once (``fleet.start_engine``'s ``on_exit``). One that is
alive but does not answer -- stopped (SIGSTOP, a debugger), deadlocked, wedged in a driver call -- is not: its
requests would wait ``--rollout-request-timeout`` x (``--rollout-request-retries`` + 1) (40 min by default) and a
weight sync to it ``--update-weight-timeout``, all without a line. So the engine's leader rank probes it:

    watch = EngineWatch(supervisor, url, name=..., interval=30, timeout=30, log_path=...).start()

After the engine's first answer to ``GET /health``, every ``interval`` seconds (``--rollout-health-check-interval``)
a probe must get an HTTP answer, of any status (503 included: a paused or busy engine still answers), within
``timeout`` seconds (``--rollout-health-check-timeout``); a failed probe is repeated at once, and two failures in a
row while the process is alive mean it is hung. The rank then SIGKILLs the engine's process group (this ends a
stopped process too) and exits with one line naming the engine, its URL, pid and the bound, and the launcher ends
the job. Detection within ``interval + 2 x timeout`` of the hang (90 s with the defaults).

With ``--use-fault-tolerance`` this is the heartbeat's job (``miles.ft.heartbeat``): the engine is killed and
restarted instead.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.spmd.supervisor import EngineSupervisor

logger = get_logger(__name__)

FIRST_ANSWER_POLL_S = 0.5


def answers(url: str, timeout: float) -> bool:
    """Whether ``GET url/health`` gets any HTTP answer within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:  # noqa: S310 - our engine
            resp.read(64)
        return True
    except urllib.error.HTTPError:  # an answer (503 while paused or busy, 401 ...): the server is responsive
        return True
    except (OSError, ValueError):  # timeout, refused, reset
        return False


class EngineWatch:
    def __init__(self, supervisor: EngineSupervisor, url: str, *, name: str, interval: float, timeout: float,
                 log_path: Path | None = None) -> None:
        self.sup, self.url, self.name = supervisor, url, name
        self.interval, self.timeout, self.log_path = float(interval), float(timeout), log_path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"miles-watch-{name}", daemon=True)

    @property
    def bound_s(self) -> float:
        """Longest time from a hang to its detection."""
        return self.interval + 2 * self.timeout

    def start(self) -> EngineWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _alive(self) -> bool:
        return self.sup.alive and not self._stop.is_set()

    def _run(self) -> None:
        while not answers(self.url, self.timeout):  # its cold start: the driver bounds it (--engine-startup-timeout)
            if not self._alive() or self._stop.wait(FIRST_ANSWER_POLL_S):
                return
        logger.debug("%s answers at %s; probing every %gs (timeout %gs)", self.name, self.url, self.interval,
                     self.timeout)
        while not self._stop.wait(self.interval):
            t0 = time.monotonic()
            if answers(self.url, self.timeout) or answers(self.url, self.timeout):
                continue
            if not self._alive():  # it exited (the supervisor reports that) or the run is closing
                return
            self._hung(time.monotonic() - t0)

    def _hung(self, silent_s: float) -> None:
        from miles.spmd.errors import exit_rank_now
        from miles.utils.errors import MilesError

        pid = self.sup.pid
        self.sup.kill_now()  # its process group, with SIGKILL (a stopped process dies of it); no restart, no on_exit
        log = f" (its log: {self.log_path})" if self.log_path is not None else ""
        exit_rank_now(MilesError(
            f"{self.name} (pid {pid}, {self.url}) is hung or stopped: two /health probes got no answer within "
            f"--rollout-health-check-timeout {self.timeout:g}s each ({silent_s:.1f}s); it was killed, and without "
            f"--use-fault-tolerance the run cannot go on without it{log}. Pass --use-fault-tolerance to restart "
            "such an engine in place."))
