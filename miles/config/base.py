"""The mechanism behind the typed config sections.

Each plane owns one module in ``miles/config`` with ``add_arguments(parser)`` (Miles's flag names,
defaults and help) and one ``@dataclass(kw_only=True)`` section whose field names equal the argparse
dests. ``section_from_namespace`` copies the parsed values into the section; nothing is rewritten.
A unit test checks that every dest lands in exactly one section.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in flags: the message names the flag, the value and the fix."""


def section_from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not hasattr(ns, f.name):
            raise AttributeError(f"config section {cls.__name__} expects flag dest '{f.name}', which no parser defines")
        kwargs[f.name] = getattr(ns, f.name)
    return cls(**kwargs)


def flag(dest: str) -> str:
    """The CLI spelling of a dest: ``rollout_batch_size`` -> ``--rollout-batch-size``."""
    return "--" + dest.replace("_", "-")


def str2bool(v: str | bool) -> bool:
    if isinstance(v, bool):
        return v
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {v!r}")
