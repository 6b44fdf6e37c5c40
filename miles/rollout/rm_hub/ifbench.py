"""``--rm-type ifbench``: IFBench's strict instruction-following check (1.0 when every instruction holds).

The checkers are AllenAI's IFBench (https://github.com/allenai/IFBench), used as a library: its
``evaluation_lib`` module must be importable (clone the repository, install its requirements and add it
to ``PYTHONPATH``). Miles clones it at import time; here nothing is downloaded at run time, so a missing
IFBench is refused when the reward is resolved, before the first rollout.

A sample's ``metadata`` carries the instance: ``instruction_id_list`` (required; without it the score is
0.0), ``kwargs`` (a list with one dict per instruction, or one dict for all; missing entries repeat the
last; ``None`` values dropped), ``prompt_text`` and ``record_id``.
"""

from __future__ import annotations

import importlib
from typing import Any

from miles.config.base import ConfigError


def load_ifbench() -> Any:
    """IFBench's ``evaluation_lib`` module, or a ConfigError saying how to get it."""
    try:
        return importlib.import_module("evaluation_lib")
    except ImportError as e:
        raise ConfigError(f"--rm-type ifbench needs IFBench's evaluation_lib ({e}): git clone "
                          f"https://github.com/allenai/IFBench, pip install its requirements, and put the "
                          f"clone on PYTHONPATH.") from e


def _kwargs_per_instruction(raw: Any, n: int) -> list[dict[str, Any]]:
    if isinstance(raw, list):
        out = [dict(x) if isinstance(x, dict) else {} for x in raw]
    elif isinstance(raw, dict):
        out = [dict(raw) for _ in range(n)]
    else:
        out = [{} for _ in range(n)]
    while len(out) < n:
        out.append(dict(out[-1]) if out else {})
    return [{k: v for k, v in d.items() if v is not None} for d in out[:n]]


def ifbench_reward(response: str | None, metadata: dict[str, Any] | None, lib: Any = None) -> float:
    if not metadata or response is None:
        return 0.0
    ids = [str(x).strip() for x in metadata.get("instruction_id_list") or [] if x is not None and str(x).strip()]
    if not ids:
        return 0.0
    lib = lib if lib is not None else load_ifbench()
    prompt = "" if metadata.get("prompt_text") is None else str(metadata["prompt_text"])
    example = lib.InputExample(key=int(metadata.get("record_id") or 0), instruction_id_list=ids, prompt=prompt,
                               kwargs=_kwargs_per_instruction(metadata.get("kwargs"), len(ids)))
    result = lib.test_instruction_following_strict(example, {prompt: str(response)})
    return 1.0 if result.follow_all_instructions else 0.0


def compute_ifbench_reward(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """Miles's name and signature (the label is not used: the instance is in ``metadata``)."""
    return ifbench_reward(response, metadata)
