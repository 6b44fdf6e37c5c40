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
import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

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
    "build_parser", "megatron_flags", "parse_args",
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


class MilesArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one ``ConfigError`` line (no usage dump, no exit from library code)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")


@lru_cache(maxsize=1)
def megatron_flags() -> frozenset[str]:
    """Megatron-backend flag names (``megatron_flags.txt``), refused by name while no parser defines them."""
    text = (Path(__file__).with_name("megatron_flags.txt")).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.startswith("--"))


def refuse_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """One line for the flags argparse did not recognise: Megatron ones by family, else the first, with a hint."""
    names = [e.split("=", 1)[0] for e in extras if e.startswith("--")]
    if not names:
        raise ConfigError(f"{parser.prog}: unexpected value(s) {' '.join(extras)}: every value needs its --flag.")
    megatron = [n for n in names if n in megatron_flags()]
    if megatron:
        more = f" (and {len(megatron) - 1} more Megatron flags)" if len(megatron) > 1 else ""
        raise ConfigError(f"{megatron[0]}{more} needs --train-backend megatron (not available yet); "
                          "drop the Megatron model/parallelism flags to train with --train-backend fsdp.")
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(names[0], known, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; see docs/flags.md for the flags miles accepts."
    raise ConfigError(f"unrecognized argument {names[0]}{hint}")


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    parser = MilesArgumentParser(prog=prog, description="miles: RL post-training as one SPMD job.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    for mod in _MODULES:
        mod.add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None, is_async: bool = False, validate: bool = True) -> MilesConfig:
    """Parse Miles flags into a MilesConfig. Raises ConfigError (a ValueError) for bad input."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = apply_deprecations(argv)
    parser = build_parser("train_async.py" if is_async else "train.py")
    ns, extras = parser.parse_known_args(argv)
    if extras:
        refuse_unknown(parser, extras)
    cfg = MilesConfig.from_namespace(ns, is_async=is_async)
    if validate:
        from miles.config.validate import validate_config

        validate_config(cfg)
    return cfg
