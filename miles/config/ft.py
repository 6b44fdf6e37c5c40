"""Fault-tolerance flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    f = parser.add_argument_group("fault tolerance")
    f.add_argument("--use-fault-tolerance", action="store_true", help="Recover dead engines in place (torchft heartbeats).")
    f.add_argument("--rollout-health-check-interval", type=float, default=30.0, help="Seconds between engine health probes.")
    f.add_argument("--rollout-health-check-timeout", type=float, default=30.0, help="Seconds before a probe counts as failed.")
    f.add_argument("--rollout-health-check-first-wait", type=float, default=0.0,
                   help="Grace seconds, after --engine-startup-timeout, a (re)started engine has to pass its first "
                        "health probe (increase for long compilation, e.g. deepgemm).")
    f.add_argument("--max-engine-restarts", type=int, default=3, help="Give an engine up after this many restarts.")


@dataclass(kw_only=True)
class FTConfig:
    use_fault_tolerance: bool
    rollout_health_check_interval: float
    rollout_health_check_timeout: float
    rollout_health_check_first_wait: float
    max_engine_restarts: int
