"""Miles's ``miles.rollout.generate_utils.prefill_logprobs``: rescore responses with a prefill-only ``/generate``.

    await recompute_samples_rollout_logprobs_via_prefill(args, samples, url=".../generate", sampling_params=...)

With ``args.recompute_logprobs_via_prefill`` set, each sample with a response (not aborted) is sent whole
(``input_ids`` = prompt + response, ``max_new_tokens: 0``, ``temperature: 0``, ``return_logprob``,
``logprob_start_len`` = prompt length - 1) after a ``/flush_cache`` of the same server, and its
``rollout_log_probs`` become the engine's log-prob of each response token (``metadata["rollout_log_probs_source"]
= "sglang_prefill_recompute"``); unset, nothing happens, as in Miles. The response log-probs are read as the
OPD teacher reads them (:func:`miles.rollout.teacher.response_log_probs`: the tail must be the response's ids).
``--recompute-logprobs-via-prefill`` itself is refused by this project's parser (the embedded engine's prefill and
decode give the same log-probs), so in a run these calls do nothing unless a plugin sets the attribute itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.rollout.generate import routing_headers, sample_image_data
from miles.rollout.teacher import response_log_probs
from miles.types import Sample, SampleStatus
from miles.utils.http_utils import post
from miles.utils.lora import LORA_ADAPTER_NAME, lora_rollout_enabled

__all__ = ["recompute_rollout_logprobs_via_prefill", "recompute_samples_rollout_logprobs_via_prefill"]

SOURCE = "sglang_prefill_recompute"


def _payload(args: Any, sample: Sample, sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    prompt_len = len(sample.tokens) - sample.response_length
    if prompt_len <= 0:
        raise ValueError(f"cannot recompute log-probs via prefill without a prompt token: {len(sample.tokens)} "
                         f"tokens, response_length {sample.response_length}")
    payload: dict[str, Any] = {
        "input_ids": list(sample.tokens),
        "sampling_params": {**dict(sampling_params), "max_new_tokens": 0, "temperature": 0,
                            "skip_special_tokens": False},
        "return_logprob": True, "logprob_start_len": prompt_len - 1}
    if lora_rollout_enabled(args):
        payload["lora_path"] = LORA_ADAPTER_NAME
    images = sample_image_data(sample)
    if images:
        payload["image_data"] = images
    return payload


async def recompute_rollout_logprobs_via_prefill(args: Any, sample: Sample, *, url: str,
                                                 sampling_params: Mapping[str, Any],
                                                 headers: Mapping[str, str] | None = None) -> None:
    """Rescore one sample (see the module docstring); no flush here, as in Miles."""
    if not getattr(args, "recompute_logprobs_via_prefill", False):
        return
    if sample.response_length == 0:
        sample.rollout_log_probs = []
        return
    if sample.status is SampleStatus.ABORTED:
        return
    out = await post(url, _payload(args, sample, sampling_params), headers=dict(headers) if headers else None)
    sample.rollout_log_probs = response_log_probs(out, sample)
    sample.metadata["rollout_log_probs_source"] = SOURCE


async def recompute_samples_rollout_logprobs_via_prefill(args: Any, samples: list[Sample], *, url: str,
                                                         sampling_params: Mapping[str, Any]) -> None:
    """Rescore every sample with a response that is not aborted, each after a ``/flush_cache`` of ``url``'s server
    (a clean prefill, not a cache hit); both carry the sample's ``X-SMG-Routing-Key`` when it has one (under a
    routing-key policy it must, as in Miles)."""
    if not getattr(args, "recompute_logprobs_via_prefill", False):
        return
    flush_url = url.rsplit("/", 1)[0] + "/flush_cache"
    for sample in samples:
        if sample.response_length == 0 or sample.status is SampleStatus.ABORTED:
            continue
        headers = routing_headers(args, sample)   # the sample's engine under a routing-key policy, as Miles
        await post(flush_url, {}, headers=headers)
        await recompute_rollout_logprobs_via_prefill(args, sample, url=url, sampling_params=sampling_params,
                                                     headers=headers)
