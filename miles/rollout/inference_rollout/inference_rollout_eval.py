"""Miles's ``miles.rollout.inference_rollout.inference_rollout_eval.run_eval_datasets``.

    data = await run_eval_datasets(GenerateState(args), prompt_dataset_cache={})
    # {name: {"rewards": [...], "truncated": [...], "samples": [...]}} for every eval dataset of the run

Called inside an evaluation (an ``--eval-function-path`` function, or a rollout function called to evaluate),
it runs this project's built-in evaluation of the run's eval datasets (``--eval-config`` / ``--eval-prompt-data``:
``args.eval_datasets``) on the run's engines, as :func:`miles.rollout.sglang_rollout.generate_rollout` with
``evaluation=True`` does, and returns Miles's eval data. The prompts are the run's own eval datasets, loaded
once; ``prompt_dataset_cache`` is accepted for Miles's signature and left empty. Evaluating on another server
(Miles's ``CheckpointEvalFn`` with ``retarget_args``) is not provided: state args pointing elsewhere are refused.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.base_types import GenerateState
from miles.rollout.rollout_fn import RolloutFunctionError

__all__ = ["run_eval_datasets"]


async def run_eval_datasets(state: GenerateState, prompt_dataset_cache: dict[Any, Any]) -> dict[str, dict[str, Any]]:
    """The built-in evaluation's data of the evaluation in progress (see the module docstring)."""
    from miles.rollout.eval_fn import builtin_eval_of, current_builtin_eval

    handle = builtin_eval_of(state.args) or current_builtin_eval()
    if handle is None:
        raise RolloutFunctionError("run_eval_datasets runs the run's built-in evaluation, so it is called only "
                                   "while the run evaluates (inside an --eval-function-path call, or a rollout "
                                   "function called with evaluation=True).")
    own = getattr(handle, "address", None)
    asked = (getattr(state.args, "sglang_router_ip", None), getattr(state.args, "sglang_router_port", None))
    if own is not None and None not in asked and asked != own:
        raise RolloutFunctionError(f"run_eval_datasets evaluates on the run's engines ({own[0]}:{own[1]}); args "
                                   f"retargeted to {asked[0]}:{asked[1]} (Miles's CheckpointEvalFn) are not provided.")
    return await handle.arun()
