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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import yaml

from miles import __version__
from miles.config import algo, cluster, data, ft, megatron, rollout, router, sglang, train, weights
from miles.config import logging as output
from miles.config.algo import AlgoConfig
from miles.config.base import ConfigError, section_from_namespace
from miles.config.cluster import ClusterConfig
from miles.config.data import DataConfig, EvalConfig, RewardConfig
from miles.config.deprecations import apply_deprecations, deprecated_value
from miles.config.ft import FTConfig
from miles.config.logging import OutputConfig
from miles.config.megatron import MegatronConfig
from miles.config.rollout import RolloutConfig
from miles.config.sglang import SGLangConfig
from miles.config.train import BACKEND_DEFAULTS, DEFAULT_BACKEND, CheckpointConfig, TrainConfig
from miles.config.unsupported import unsupported_message
from miles.config.weights import WeightSyncConfig
from miles.utils.logging import get_logger

__all__ = [
    "AlgoConfig", "CheckpointConfig", "ClusterConfig", "ConfigError", "DataConfig", "EvalConfig", "FTConfig",
    "MegatronConfig", "MilesConfig", "OutputConfig", "RewardConfig", "RolloutConfig", "SGLangConfig", "TrainConfig", "WeightSyncConfig",
    "build_parser", "megatron_flags", "parse_args",
]

_MODULES = (cluster, rollout, data, train, algo, weights, ft, output, megatron, sglang)  # sglang last: it leaves flags defined before to them

logger = get_logger(__name__)

SECRET_FIELDS = frozenset({"wandb_key", "sglang_api_key"})  # never written out by MilesConfig.to_dict


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
    megatron: MegatronConfig
    sglang: SGLangConfig
    is_async: bool = False
    # --custom-config-path keys that name no flag: arguments of user functions (plugins read args.KEY)
    custom_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, is_async: bool = False,
                       custom_config: dict[str, Any] | None = None) -> MilesConfig:
        kwargs = {f.name: section_from_namespace(f.type_cls, ns) for f in _section_fields()}
        return cls(**kwargs, is_async=is_async, custom_config=dict(custom_config or {}))

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain data, secrets (``SECRET_FIELDS``) shown as ``***``: for config.json, W&B, --dry-run."""
        out = dataclasses.asdict(self)
        for section in out.values():
            if isinstance(section, dict):
                for name in SECRET_FIELDS & section.keys():
                    if section[name]:
                        section[name] = "***"
                if section.get("router_args"):
                    section["router_args"] = router.shown(section["router_args"])
        return out

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
        "weights": WeightSyncConfig, "ft": FTConfig, "output": OutputConfig, "megatron": MegatronConfig,
        "sglang": SGLangConfig,
    }
    return [_SectionField(k, v) for k, v in classes.items()]


class MilesArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one ``ConfigError`` line (no usage dump, no exit from library code)."""

    full_help = False  # set by --help-all

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")

    def format_help(self) -> str:
        """``--help``: a one-line usage and every group but SGLang's hundreds of forwarded flags (``--help-all``)."""
        if self.full_help or self.usage is not None:
            return super().format_help()
        formatter = self._get_formatter()
        formatter.add_usage("%(prog)s [--flag VALUE ...]   (--help-all: also every --sglang-* and --router-* flag)", self._actions,
                            self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        for group in self._action_groups:
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            if group.title in (sglang.GROUP_TITLE, router.GROUP_TITLE):
                formatter.add_text(f"{len(group._group_actions)} flags, listed by --help-all.")
            else:
                formatter.add_arguments(group._group_actions)
            formatter.end_section()
        formatter.add_text(self.epilog)
        return formatter.format_help()


class _HelpAll(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.full_help = True
        parser.print_help()
        parser.exit()


@lru_cache(maxsize=1)
def megatron_flags() -> frozenset[str]:
    """Megatron-backend flag names (``megatron_flags.txt``), refused by name while no parser defines them."""
    text = (Path(__file__).with_name("megatron_flags.txt")).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.startswith("--"))


@lru_cache(maxsize=1)
def miles_flags() -> frozenset[str]:
    """Miles v0.1.0's flag names (``miles_flags.txt``): one the parser lacks is refused as not implemented."""
    text = (Path(__file__).with_name("miles_flags.txt")).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.startswith("--"))


def refuse_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """One line for the flags argparse did not recognise: Megatron ones by family, else the first, with a hint."""
    names = [e.split("=", 1)[0] for e in extras if e.startswith("--")]
    if not names:
        raise ConfigError(f"{parser.prog}: unexpected value(s) {' '.join(extras)}: every value needs its --flag.")
    for n in names:
        if (why := unsupported_message(n)) is not None:
            raise ConfigError(why)
    megatron = [n for n in names if n in megatron_flags()]
    if megatron:
        more = f" (and {len(megatron) - 1} more Megatron flags)" if len(megatron) > 1 else ""
        raise ConfigError(f"{megatron[0]}{more}: a Megatron-LM flag that miles's Megatron backend does not take (yet); "
                          "drop it (docs/flags.md lists the Megatron flags miles accepts).")
    not_built = [n for n in names if n in miles_flags()]
    if not_built:
        more = f" (and {len(not_built) - 1} more)" if len(not_built) > 1 else ""
        raise ConfigError(f"{not_built[0]}{more}: a Miles v0.1.0 flag that miles does not implement; drop it "
                          "(docs/flags.md lists the flags miles accepts).")
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(names[0], known, n=1)
    if names[0].startswith(("--sglang-", "--no-sglang-")):  # not one of SGLang's ServerArgs flags
        raise ConfigError(sglang.unknown_flag_line(names[0], close[0] if close else None))
    hint = f"; did you mean {close[0]}?" if close else "; see docs/flags.md for the flags miles accepts."
    raise ConfigError(f"unrecognized argument {names[0]}{hint}")


def build_parser(prog: str = "train.py", backend: str = DEFAULT_BACKEND) -> argparse.ArgumentParser:
    """The full parser, with the defaults of ``backend`` (``train.BACKEND_DEFAULTS``, Miles's per-backend values)."""
    parser = MilesArgumentParser(prog=prog, description="miles: RL post-training as one SPMD job.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    for mod in _MODULES:
        mod.add_arguments(parser)
    parser.add_argument("--help-all", action=_HelpAll, nargs=0, dest="help", default=argparse.SUPPRESS,
                        help="Show every flag, with SGLang's forwarded server flags, and exit.")
    parser.add_argument("--version", action="version", version=f"miles {__version__}", dest="help")
    parser.set_defaults(**BACKEND_DEFAULTS.get(backend, {}))
    return parser


def train_backend_of(argv: list[str]) -> str:
    """``--train-backend`` as given (the last one wins, as in argparse), before the full parse."""
    pre = MilesArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--train-backend", default=DEFAULT_BACKEND)
    ns, _ = pre.parse_known_args(argv)
    return ns.train_backend


def load_custom_config(value: str) -> dict[str, Any]:
    """``--custom-config-path``: a YAML file, or ``base64:PAYLOAD`` carrying the same document (as Miles)."""
    import base64
    import binascii

    try:
        if value.startswith("base64:"):
            text = base64.b64decode(value[len("base64:"):], validate=True).decode("utf-8")
        else:
            text = Path(value).read_text()
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, binascii.Error, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"--custom-config-path {value!r}: cannot read it as YAML ({type(e).__name__}: {first}); "
                          "pass a YAML file of KEY: VALUE lines.") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"--custom-config-path {value!r} must hold a YAML mapping of KEY: VALUE, "
                          f"got a {type(data).__name__}.")
    return data


def _apply_custom_config(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, Any]:
    """Keys naming a flag set it (over the command line, as Miles does, logged); the rest are returned."""
    if not ns.custom_config_path:
        return {}
    dests = {a.dest for a in parser._actions}
    extra: dict[str, Any] = {}
    for key, value in load_custom_config(ns.custom_config_path).items():
        if key in dests and key != "custom_config_path":
            if deprecated_value("--" + key.replace("_", "-"), value):  # Miles's alias of "not given"
                value = parser.get_default(key)
            logger.info("--custom-config-path sets %s = %r (was %r)", key, value, getattr(ns, key))
            setattr(ns, key, value)
        else:
            extra[key] = value
    return extra


def parse_args(argv: list[str] | None = None, is_async: bool = False, validate: bool = True) -> MilesConfig:
    """Parse Miles flags into a MilesConfig. Raises ConfigError (a ValueError) for bad input."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = apply_deprecations(argv)
    parser = build_parser("train_async.py" if is_async else "train.py", backend=train_backend_of(argv))
    ns, extras = parser.parse_known_args(argv)
    if extras:
        refuse_unknown(parser, extras)
    custom = _apply_custom_config(parser, ns)
    cfg = MilesConfig.from_namespace(ns, is_async=is_async, custom_config=custom)
    if validate:
        from miles.config.validate import validate_config

        validate_config(cfg)
        cfg.megatron.validate(cfg.train.train_backend)
    return cfg
