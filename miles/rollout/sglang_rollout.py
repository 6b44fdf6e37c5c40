"""Miles's legacy rollout module (``miles.rollout.sglang_rollout``), as the paths Miles scripts name.

- ``generate`` (``--custom-generate-function-path miles.rollout.sglang_rollout.generate``): Miles's
  default single-turn generate function, ``generate(args, sample, sampling_params) -> Sample``; the
  same as leaving the flag unset (and, as Miles's, it resumes an aborted sample within the budget left).
- ``GenerateState(args)``: what Miles's custom generate functions import from here (``.tokenizer``,
  ``.sampling_params``), see :mod:`miles.rollout.base_types`.
- ``generate_rollout`` (``--rollout-function-path`` / Miles's default under
  ``MILES_USE_LEGACY_ROLLOUT_V1=1``): selecting it selects this project's built-in rollout
  (:class:`~miles.rollout.manager.RolloutManager`); it is a name, not called, except with ``evaluation=True``
  from an ``--eval-function-path`` function, where it runs the built-in evaluation (:mod:`miles.rollout.eval_fn`).
"""

from __future__ import annotations

from typing import Any

from miles.rollout import generate as gen
from miles.rollout.base_types import GenerateState, RolloutFnEvalOutput
from miles.rollout.rollout_fn import RolloutFunctionError
from miles.types import Sample, SampleError, SampleStatus

__all__ = ["GenerateState", "generate", "generate_rollout"]


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One ``/generate`` on the sample's ids through ``args.client`` (token in, token out). As Miles's: a sample
    handed back after an abort continues within what is left of ``max_new_tokens`` (none left: TRUNCATED, no
    request); a finished one is refused (``SampleError``, an AssertionError as Miles's ``assert``). The sample's
    ``routing_key`` is sent as ``X-SMG-Routing-Key``; under ``--sglang-router-policy manual`` a sample without one is
    refused, as Miles's ``compute_routing_headers`` does."""
    from miles.rollout.opd_topk import student_top_k

    if sample.status not in (SampleStatus.PENDING, SampleStatus.ABORTED):
        raise SampleError(f"miles.rollout.sglang_rollout.generate: sample {sample.index} has status "
                          f"{sample.status}; only a pending or an aborted (resumed) sample is generated.")
    gen.routing_headers(args, sample)   # a routing-key policy needs the sample's key (sent by gen.generate)
    params = dict(sampling_params)
    if sample.response_length and params.get("max_new_tokens") is not None:
        left = int(params["max_new_tokens"]) - sample.response_length
        if left < 0:
            raise SampleError(f"miles.rollout.sglang_rollout.generate: sample {sample.index} has "
                              f"{sample.response_length} response tokens already, more than max_new_tokens "
                              f"{params['max_new_tokens']}.")
        if left == 0:
            sample.status = SampleStatus.TRUNCATED
            return sample
        params["max_new_tokens"] = left
    return await gen.generate(args.client, sample, params, top_logprobs_num=student_top_k(args),
                              routed_experts=bool(getattr(args, "use_rollout_routing_replay", False)))


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """Miles's default rollout. With ``evaluation=True``, called by an ``--eval-function-path`` function (Miles's
    eval_delegate_rollout does), it runs the built-in evaluation over the run's eval datasets and returns
    ``RolloutFnEvalOutput(data={name: {"rewards", "truncated", "samples"}})``. For training it is a name only:
    ``--rollout-function-path`` naming it runs the built-in RolloutManager."""
    from miles.rollout.eval_fn import builtin_eval_of

    handle = builtin_eval_of(args) if evaluation else None
    if handle is not None:
        return RolloutFnEvalOutput(data=handle(rollout_id))
    if evaluation:
        raise RolloutFunctionError("miles.rollout.sglang_rollout.generate_rollout(..., evaluation=True) runs the "
                                   "built-in evaluation only inside an --eval-function-path call, with the args it "
                                   "was given.")
    raise RolloutFunctionError("miles.rollout.sglang_rollout.generate_rollout names the built-in rollout (selected by "
                               "--rollout-function-path or by default); it is not called as a function.")
