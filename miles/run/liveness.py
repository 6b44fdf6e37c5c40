"""Which rank went silent: per-rank liveness counters in the job's rendezvous store.

    beat = Liveness.start(rank, world_size, period_s=1.0)   # every rank, after init_distributed
    beat.silent_ranks()  # after a collective timed out: ranks whose counter stopped advancing

A collective that times out (gloo, NCCL) cannot say which member is missing. Every rank therefore
bumps ``miles/alive/<rank>`` in the default store from a daemon thread; a stopped (SIGSTOP), frozen
or dead process stops bumping, a rank merely waiting in a collective keeps going. After a timeout,
``silent_ranks`` reads the counters twice a few periods apart and names the ranks that did not move,
so the job's error says "rank 1 is silent (hung or stopped)" instead of only naming the group.
Counters (not clocks) are compared, so clock skew between nodes does not matter.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from miles.utils.logging import get_logger

logger = get_logger(__name__)

PREFIX = "miles/alive/"


class Liveness:
    def __init__(self, store: Any, rank: int, world_size: int, period_s: float) -> None:
        self.store, self.rank, self.world_size, self.period_s = store, rank, world_size, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="miles-liveness", daemon=True)

    @classmethod
    def start(cls, rank: int, world_size: int, period_s: float = 1.0) -> Liveness | None:
        """Beat into torch.distributed's default store; None when there is none (not initialised)."""
        import torch.distributed as dist

        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError) as e:
            logger.debug("no liveness counters (no default store: %s)", e)
            return None
        beat = cls(store, rank, world_size, period_s)
        beat._thread.start()
        return beat

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"{PREFIX}{self.rank}", 1)
            except (RuntimeError, OSError) as e:  # the store went away: the job is ending
                logger.debug("liveness beat stopped: %s", e)
                return
            self._stop.wait(self.period_s)

    def counters(self, timeout_s: float = 5.0) -> list[int] | None:
        """Every rank's counter; None when the store does not answer within ``timeout_s`` (its host is
        silent too: under mpirun/Slurm that is rank 0), so a failing rank never waits on it for long."""
        out: list[list[int]] = []

        def read() -> None:
            try:
                out.append([int(self.store.add(f"{PREFIX}{r}", 0)) for r in range(self.world_size)])
            except (RuntimeError, OSError) as e:
                logger.debug("could not read liveness counters: %s", e)

        t = threading.Thread(target=read, name="miles-liveness-read", daemon=True)
        t.start()
        t.join(timeout_s)
        return out[0] if out else None

    def silent_ranks(self, periods: float = 3.0) -> list[int] | None:
        """Ranks (other than this one) whose counter did not advance over ``periods`` beat periods;
        None when the counters cannot be read."""
        before = self.counters()
        if before is None:
            return None
        time.sleep(self.period_s * periods)
        after = self.counters()
        if after is None:
            return None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def close(self) -> None:
        self._stop.set()


def name_silent_ranks(exc: BaseException, beat: Liveness | None) -> BaseException:
    """For a timed-out collective: the same error, naming the silent ranks (or ``exc`` unchanged)."""
    from miles.spmd.errors import CollectiveTimeoutError

    if beat is None or not (isinstance(exc, (CollectiveTimeoutError, TimeoutError)) or _backend_timeout(exc)):
        return exc
    silent = beat.silent_ranks()
    if silent is None:
        note = "the rendezvous store does not answer either, so its host (rank 0 under mpirun/Slurm) is silent."
    elif silent:
        who = ", ".join(f"rank {r}" for r in silent)
        note = f"{who} stopped responding (hung, stopped or frozen: no liveness beat for {3 * beat.period_s:g}s)."
    else:
        note = "every other rank is alive, so one is stuck inside its code or is very slow (see the ranks' logs)."
    return type(exc)(f"{exc} {note}") if isinstance(exc, CollectiveTimeoutError) else CollectiveTimeoutError(
        f"{exc} {note}")


def _backend_timeout(exc: BaseException) -> bool:
    """A gloo/NCCL timeout that reached us untranslated (a collective outside ``Groups.guard``)."""
    text = str(exc).lower()
    return (isinstance(exc, RuntimeError) and any(m in text for m in ("timed out", "timeout"))
            and any(m in text for m in ("gloo", "nccl", "collective")))
