"""Miles's command line, parsed once and copied into one typed section per plane.

    cfg = parse_args(argv)          # MilesConfig; raises ConfigError on bad combinations
    cfg.cluster.colocate            # ClusterConfig
    cfg.rollout.rollout_temperature # RolloutConfig ...

Flag names, defaults and meanings follow Miles. Deprecated spellings are handled in
``deprecations.py``; cross-section checks live in ``validate.py`` (they never rewrite values).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from miles.config import algo, cluster, data, ft, rollout, train, weights
from miles.config import logging as output
from miles.config.algo import AlgoConfig
from miles.config.base import ConfigError, section_from_namespace
from miles.config.cluster import ClusterConfig
from miles.config.data import DataConfig, EvalConfig, RewardConfig
from miles.config.deprecations import apply_deprecations
from miles.config.ft import FTConfig
from miles.config.logging import OutputConfig
from miles.config.rollout import RolloutConfig
from miles.config.train import CheckpointConfig, TrainConfig
from miles.config.weights import WeightSyncConfig

__all__ = [
    "AlgoConfig", "CheckpointConfig", "ClusterConfig", "ConfigError", "DataConfig", "EvalConfig", "FTConfig",
    "MilesConfig", "OutputConfig", "RewardConfig", "RolloutConfig", "TrainConfig", "WeightSyncConfig",
    "build_parser", "parse_args",
]

_MODULES = (cluster, rollout, data, train, algo, weights, ft, output)


@dataclass(kw_only=True)
class MilesConfig:
    cluster: ClusterConfig
    rollout: RolloutConfig
    data: DataConfig
    reward: RewardConfig
    eval: EvalConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    algo: AlgoConfig
    weights: WeightSyncConfig
    ft: FTConfig
    output: OutputConfig
    is_async: bool = False

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, is_async: bool = False) -> MilesConfig:
        kwargs = {f.name: section_from_namespace(f.type_cls, ns) for f in _section_fields()}
        return cls(**kwargs, is_async=is_async)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


@dataclass
class _SectionField:
    name: str
    type_cls: type


def _section_fields() -> list[_SectionField]:
    classes = {
        "cluster": ClusterConfig, "rollout": RolloutConfig, "data": DataConfig, "reward": RewardConfig,
        "eval": EvalConfig, "train": TrainConfig, "checkpoint": CheckpointConfig, "algo": AlgoConfig,
        "weights": WeightSyncConfig, "ft": FTConfig, "output": OutputConfig,
    }
    return [_SectionField(k, v) for k, v in classes.items()]


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="miles: RL post-training as one SPMD job.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    for mod in _MODULES:
        mod.add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None, is_async: bool = False, validate: bool = True) -> MilesConfig:
    """Parse Miles flags into a MilesConfig. Raises ConfigError (a ValueError) for bad input."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = apply_deprecations(argv)
    ns = build_parser("train_async.py" if is_async else "train.py").parse_args(argv)
    cfg = MilesConfig.from_namespace(ns, is_async=is_async)
    if validate:
        from miles.config.validate import validate_config

        validate_config(cfg)
    return cfg
