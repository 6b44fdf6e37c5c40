"""Miles's ``miles.rollout.checkpoint_eval``: the snapshot-eval contract, importable; its runs are refused.

Miles's ``CheckpointEvalFn`` evaluates exported HF checkpoints (``train_async.py`` with ``--eval-hf-dir`` or
``--save-hf``) on a backend of the plugin's own. This project does not dispatch snapshots, so
``--eval-function-path`` naming a ``CheckpointEvalFn`` subclass is refused at start-up with one line
(:func:`miles.rollout.eval_fn.check_eval_function`); the module exists so that plugins importing it load.
``retarget_args`` works on any args object that allows attribute writes (a copy is returned).
"""

from __future__ import annotations

import abc
import copy
import inspect
from typing import Any

from miles.rollout.base_types import RolloutFnEvalInput, RolloutFnEvalOutput, RolloutFnInput

__all__ = ["CheckpointEvalFn", "EvalSkip", "is_checkpoint_eval_fn", "retarget_args"]


def retarget_args(args: Any, router_ip: str, router_port: int, num_gpus: int, num_gpus_per_engine: int) -> Any:
    """A shallow copy of ``args`` pointing at another router (``sglang_router_ip`` / ``sglang_router_port``) and
    sized for ``num_gpus`` GPUs of ``num_gpus_per_engine`` each."""
    values = {"sglang_router_ip": router_ip, "sglang_router_port": router_port, "rollout_num_gpus": num_gpus,
              "rollout_num_gpus_per_engine": num_gpus_per_engine}
    from miles.rollout.plugins import PluginArgs

    if isinstance(args, PluginArgs):  # read-only: a new view with these values first
        return args.with_overrides(values)
    out = copy.copy(args)
    for k, v in values.items():
        setattr(out, k, v)
    return out


class EvalSkip(Exception):
    """Raised by a CheckpointEvalFn to skip one eval point, with its reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CheckpointEvalFn(abc.ABC):
    """Miles's contract for evaluating checkpoint snapshots (refused by this project's runs, see the module)."""

    @abc.abstractmethod
    async def evaluate_checkpoint(self, checkpoint_dir: str, input: RolloutFnEvalInput) -> RolloutFnEvalOutput: ...

    async def __call__(self, input: RolloutFnInput) -> RolloutFnEvalOutput:
        if not input.evaluation or getattr(input, "hf_dir", None) is None:
            raise ValueError("a CheckpointEvalFn evaluates dispatched snapshots (hf_dir), which miles does not export")
        return await self.evaluate_checkpoint(input.hf_dir, input)  # type: ignore[union-attr]

    def dispose(self) -> None:  # noqa: B027 - an optional hook
        """Tear down what ``__init__`` started."""


def is_checkpoint_eval_fn(eval_function_path: str | None) -> bool:
    """Whether ``eval_function_path`` names a CheckpointEvalFn subclass."""
    from miles.utils.misc import load_function

    fn = load_function(eval_function_path)
    return inspect.isclass(fn) and issubclass(fn, CheckpointEvalFn)
