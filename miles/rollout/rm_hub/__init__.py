"""Built-in verifiers behind ``--rm-type`` (one module each); ``miles.rollout.rewards`` dispatches to them.

The names and meanings follow Miles v0.1.0's reward hub: ``math``, ``deepscaler``, ``gemma_math``,
``dapo``, ``f1``, ``gpqa``, ``ifbench``, ``random``, ``deterministic_random``, ``remote_rm`` and the
``boxed_<type>`` prefix; plus this project's ``exact_match``, ``quickstart`` and ``math_lenient``.

Miles's plugin functions of the hub, for reward and generate plugins that score samples themselves:

- ``await async_rm(args, sample, **kwargs)``: the reward of one sample as the run would compute it: the sample's
  ``custom_rm_path`` / ``--custom-rm-path`` function (called ``f(args, sample, **kwargs)``), else the
  ``rm_type`` (``metadata["rm_type"]``, else ``--rm-type``) through the same verifiers as ``--rm-type``,
  ``remote_rm`` posting to ``--rm-url``. The raw value is returned (a dict for ``dapo``). An unknown type raises
  NotImplementedError naming it. Built-in verifiers are bounded by ``--rm-timeout`` (60 s without args).
- ``await batched_async_rm(args, samples, inplace_set_reward_field=False, **kwargs)``: the rewards of
  ``samples`` (``--custom-rm-path`` called once with the whole list, as Miles's group reward), or, with
  ``inplace_set_reward_field``, set on each sample (AssertionError when one already has a reward) and None.
- ``grade_answer_verl``, ``extract_boxed_answer``, ``f1_score``, ``compute_gpqa_reward``,
  ``compute_score_dapo``, ``get_deepscaler_rule_based_reward``: the verifiers by Miles's names.
"""

from __future__ import annotations

import asyncio
import numbers
from typing import Any

from .deepscaler import get_deepscaler_rule_based_reward, get_gemma_math_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .math_dapo_utils import compute_score as compute_score_dapo
from .math_utils import extract_answer as extract_boxed_answer
from .math_utils import grade_answer_verl

__all__ = ["async_rm", "batched_async_rm", "compute_gpqa_reward", "compute_score_dapo", "extract_boxed_answer",
           "f1_score", "get_deepscaler_rule_based_reward", "get_gemma_math_reward", "grade_answer_verl", "remote_rm"]

DEFAULT_RM_TIMEOUT = 60.0   # --rm-timeout's default


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, numbers.Real) and value > 0 else default


def _resolve_reward_config(args: Any, sample: Any) -> tuple[str | None, str]:
    """(custom reward path, reward type) of a sample: a ``sample.reward_spec``'s fields when set, else the sample's
    ``metadata["rm_type"]``, else ``--custom-rm-path`` / ``--rm-type``."""
    spec = getattr(sample, "reward_spec", None)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    path = (getattr(spec, "custom_rm_path", None) if spec is not None else None) or getattr(args, "custom_rm_path", None)
    rm_type = ((getattr(spec, "rm_type", None) if spec is not None else None) or metadata.get("rm_type")
               or getattr(args, "rm_type", None) or "")
    return (path if isinstance(path, str) and path else None), str(rm_type).strip()


async def remote_rm(args: Any, sample: Any) -> Any:
    """POST ``{prompt, response, label}`` to ``--rm-url``: ``--rm-timeout`` per try, ``--rm-max-retries`` retries."""
    from miles.rollout.rewards import RemoteReward

    url = getattr(args, "rm_url", None)
    if not isinstance(url, str) or not url:
        raise ValueError("rm_type remote_rm needs --rm-url URL")
    retries = getattr(args, "rm_max_retries", 3)
    remote = RemoteReward(url, _number(getattr(args, "rm_timeout", None), DEFAULT_RM_TIMEOUT),
                          retries if isinstance(retries, int) and retries >= 0 else 3)
    try:
        return await remote.score(sample)
    finally:
        await remote.aclose()


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The reward of one sample (see the module docstring)."""
    from miles.rollout.plugins import call_bounded, maybe_await
    from miles.rollout.rewards import builtin_call
    from miles.utils.misc import load_function

    path, rm_type = _resolve_reward_config(args, sample)
    if path is not None:
        return await maybe_await(load_function(path)(args, sample, **kwargs))
    if not rm_type:
        raise NotImplementedError("Rule-based RM type is not specified: pass --rm-type or set metadata['rm_type'].")
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    found = builtin_call(rm_type)
    if found is None:
        from miles.rollout.rewards import registered_rewards

        raise NotImplementedError(f"Rule-based RM for {rm_type} is not implemented; known: "
                                  f"{', '.join(registered_rewards())}, or boxed_<type>.")
    fn, _ = found
    if getattr(fn, "miles_inline", False):
        return fn(args, sample)
    timeout = _number(getattr(args, "rm_timeout", None), DEFAULT_RM_TIMEOUT)
    return await call_bounded(fn, (args, sample), timeout, f"rm_type {rm_type}")


async def batched_async_rm(args: Any, samples: list[Any], inplace_set_reward_field: bool = False,
                           **kwargs: Any) -> list[Any] | None:
    """The rewards of ``samples`` (see the module docstring)."""
    from miles.rollout.plugins import maybe_await
    from miles.utils.misc import load_function

    if inplace_set_reward_field:
        rewards = await batched_async_rm(args, samples, **kwargs)
        for sample, reward in zip(samples, rewards or [], strict=True):
            assert sample.reward is None, f"Overriding sample.reward from {sample.reward} to {reward}, is this intended?"
            sample.reward = reward
        return None
    path = getattr(args, "custom_rm_path", None)
    if isinstance(path, str) and path:
        return await maybe_await(load_function(path)(args, samples, **kwargs))
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
