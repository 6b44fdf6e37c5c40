"""Fault tolerance for the engine plane (torchft heartbeats, membership, in-place recovery).

Pieces, by where they run:

- driver (global rank 0): :class:`~miles.ft.lighthouse.Lighthouse` (a torchft ``LighthouseServer``),
  :class:`~miles.ft.membership.EngineMembership` (engine membership follows the lighthouse's quorum) and
  :class:`~miles.ft.recovery.EngineRecoveryController` (router removal, weight catch-up, re-admission).
- each engine's leader rank: :class:`~miles.ft.heartbeat.EngineHeartbeat` (heartbeats for its engine
  while ``/health_generate`` probes pass; restarts a hung engine through its supervisor).

Timings come from ``--rollout-health-check-*`` through :func:`~miles.ft.timing.ft_timings`.
torchft is imported lazily (``--use-fault-tolerance`` needs the ``ft`` extra); importing this package
does not import it. ``docs/fault-tolerance.md`` defines the semantics.
"""

from miles.ft.timing import FTTimings, ft_timings

__all__ = ["FTTimings", "ft_timings"]
