"""Heartbeats to nvidia-resiliency-ext's ``ft_launcher`` when the job runs under it.

``ft_launcher`` (a torchrun superset, extra ``ft``) starts a rank monitor next to every rank and passes its
socket in ``FT_RANK_MONITOR_IPC_SOCKET``. A rank that connected and then sends no heartbeat within
``--ft-rank-heartbeat-timeout`` seconds (``--ft-initial-rank-heartbeat-timeout`` for the first one) is
deemed hung: the launcher terminates the worker group and, within ``--max-restarts``, starts it again,
and the run resumes from its last complete checkpoint (``--load`` defaults to ``--save``).

Every rank beats once per command of the run (the driver when it issues train, sync_weights, save, ...;
the other ranks when they receive one), so a rank that is stopped, deadlocked or stuck in a step goes
silent. The timeout must exceed the longest gap between commands, i.e. one rollout's generation plus
its training step. Outside ``ft_launcher`` (no socket in the environment) nothing happens.

    hb = LauncherHeartbeat.from_env()   # None outside ft_launcher
    hb.beat(); ...; hb.close()
"""

from __future__ import annotations

import os
from typing import Any

from miles.utils.logging import get_logger
from miles.utils.optional import require

logger = get_logger(__name__)

SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by ft_launcher for each rank it starts


class LauncherHeartbeat:
    """This rank's connection to its ``ft_launcher`` rank monitor."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.beats = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> LauncherHeartbeat | None:
        """Connect when running under ``ft_launcher``; None otherwise."""
        env = os.environ if environ is None else environ
        if not env.get(SOCKET_ENV):
            return None
        mod = require("nvidia_resiliency_ext.fault_tolerance", "running under ft_launcher (its rank heartbeats)")
        client = mod.RankMonitorClient()
        try:
            client.init_workload_monitoring()
        except Exception as e:  # noqa: BLE001 - the launcher's own error types; one clear line instead
            raise RuntimeError(f"could not reach ft_launcher's rank monitor at {env[SOCKET_ENV]} ({e}); "
                               "start the job with ft_launcher itself, or unset FT_RANK_MONITOR_IPC_SOCKET") from e
        cfg = getattr(client, "cfg", None)
        logger.info("ft_launcher: rank heartbeats on (timeout %ss, first %ss); one per command of the run",
                    getattr(cfg, "rank_heartbeat_timeout", "?"), getattr(cfg, "initial_rank_heartbeat_timeout", "?"))
        return cls(client)

    def beat(self) -> None:
        self._client.send_heartbeat()
        self.beats += 1

    def close(self) -> None:
        """Disconnect (a clean exit: the monitor stops expecting heartbeats)."""
        try:
            self._client.shutdown_workload_monitoring()
        except OSError as e:
            logger.debug("ft_launcher rank monitor already gone: %s", e)
