"""Generating one sample: the default single-turn function and the custom-generate contract.

Token in, token out: the engine gets ``sample.tokens`` (the prompt ids from the data source, and in
later turns everything so far) as ``input_ids`` with ``return_logprob=True`` (and, for a sample with images,
SGLang's ``image_data``: each image as ``data:image/png;base64,...``, its tokens already expanded in the ids,
as Miles sends them; a sample's ``routing_key`` as sglang-router's ``X-SMG-Routing-Key`` header); the generated ids and
their log-probs are read from ``meta_info.output_token_logprobs`` and appended unchanged. Nothing is
ever re-tokenized, so the trainer sees exactly the ids the engine produced.

Default (``--custom-generate-function-path`` unset)::

    sample = await generate(client, sample, sampling_params)

Custom (Miles's signature)::

    async def generate(args, sample, sampling_params) -> Sample

``args`` is a read-only :class:`~miles.rollout.plugins.PluginArgs`: the flags (``args.rollout_max_response_len``
...), ``args.client`` (send every engine call through it: the manager gives each sample's requests ids it
can abort) and ``args.tokenizer``. The function fills ``tokens`` (prompt + response), ``response_length``,
``loss_mask`` (one entry per response token: 1 generated, 0 e.g. tool output), ``rollout_log_probs``
(one per response token; 0.0 where masked), ``response``, ``status`` and ``weight_version``.
:class:`MultiTurn` does this bookkeeping; ``generate_with_calculator`` is a worked tool-use example.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from miles.config.rollout import RolloutConfig
from miles.types import Sample, SampleError, SampleStatus

FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class EngineResponseError(RuntimeError):
    """An engine's /generate answer lacks what token-in-token-out needs."""


def build_sampling_params(rollout: RolloutConfig, *, max_new_tokens: int | None = None,
                          temperature: float | None = None) -> dict[str, Any]:
    """SGLang ``sampling_params`` from the sampling flags (``--rollout-*``)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens if max_new_tokens is not None else rollout.rollout_max_response_len,
        "temperature": temperature if temperature is not None else rollout.rollout_temperature,
        "top_p": rollout.rollout_top_p,
        "top_k": rollout.rollout_top_k,
        "skip_special_tokens": rollout.rollout_skip_special_tokens,
    }
    if rollout.rollout_stop:
        params["stop"] = list(rollout.rollout_stop)
    if rollout.rollout_stop_token_ids:
        params["stop_token_ids"] = list(rollout.rollout_stop_token_ids)
    return params


def _weight_version(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def parse_output(out: dict[str, Any]) -> tuple[list[int], list[float], SampleStatus, int | None]:
    """(token ids, log-probs, status, weight version) of one /generate answer (SGLang's shape)."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict):
        raise EngineResponseError(f"/generate answer has no meta_info object: {str(out)[:200]}")
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise EngineResponseError("/generate answer has no meta_info.output_token_logprobs (the request must set "
                                  "return_logprob=True, and the engine must honour it)")
    try:
        ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
    except (TypeError, ValueError, IndexError) as e:
        raise EngineResponseError(f"malformed output_token_logprobs entry ({e}): {str(pairs[:3])[:200]}") from e
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in FINISH_STATUS:
        raise EngineResponseError(f"/generate answer has finish_reason {finish!r}; expected stop, length or abort")
    return ids, logprobs, FINISH_STATUS[kind], _weight_version(meta.get("weight_version"))


def append_output(sample: Sample, out: dict[str, Any], decode: Any = None) -> tuple[list[int], SampleStatus]:
    """Append one /generate answer to ``sample`` as trained-on response tokens; returns (new ids, status).

    The response text is the engine's ``text``, or ``decode(ids)`` when given (exact for the ids, stop
    strings included).
    """
    ids, logprobs, status, version = parse_output(out)
    top = (out.get("meta_info") or {}).get("output_top_logprobs")
    if top is not None:  # asked for by top-k OPD (Miles's key): one row per generated token
        sample.metadata.setdefault("opd_student_top_logprobs", []).extend(top[:len(ids)])
    sample.tokens = list(sample.tokens) + ids
    sample.response_length += len(ids)
    sample.prefix_cache_info.add(out.get("meta_info") or {})
    routed = (out.get("meta_info") or {}).get("routed_experts")
    if isinstance(routed, str):  # R3: each answer covers the whole stream so far, prompt included (SGLang)
        sample.rollout_routed_experts = routed
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + logprobs
    sample.response += decode(ids) if decode is not None else (out.get("text") or "")
    if version is not None:
        sample.weight_version = version if sample.weight_version is None else min(sample.weight_version, version)
    raw_version = (out.get("meta_info") or {}).get("weight_version")
    if raw_version is not None:
        sample.weight_versions.append(str(raw_version))
    sample.status = status
    return ids, status


def request_extra(top_logprobs_num: int = 0, routed_experts: bool = False,
                  image_data: list[str] | None = None) -> dict[str, Any] | None:
    """The /generate fields beyond ids, sampling and log-probs: top-k log-probs (top-k OPD), for R3
    (``--use-rollout-routing-replay``) SGLang's ``return_routed_experts``, and a sample's images as SGLang's
    ``image_data`` (one ``data:image/png;base64,...`` per image; the ids hold each image's expanded tokens)."""
    extra: dict[str, Any] = {}
    if top_logprobs_num:
        extra["top_logprobs_num"] = int(top_logprobs_num)
    if routed_experts:
        extra["return_routed_experts"] = True
    if image_data:
        extra["image_data"] = list(image_data)
    return extra or None


def sample_image_data(sample: Sample) -> list[str] | None:
    """The ``image_data`` of a sample's requests (``--multimodal-keys``: its ``metadata["multimodal_inputs"]``, after
    the sample's ``multimodal_inputs`` is stored there), or None for a text sample."""
    sample.store_multimodal_inputs()    # a plugin's Sample.multimodal_inputs (Miles's field), as references
    if not isinstance(sample.metadata, dict) or "multimodal_inputs" not in sample.metadata:  # multimodal.MEDIA_KEY
        return None
    from miles.rollout.multimodal import image_data

    return image_data(sample.metadata)


def routing(sample: Sample) -> dict[str, Any]:
    """The client keyword of a sample's requests: ``routing_key`` when the sample has one (a client that takes no
    such argument still serves a sample without one)."""
    return {"routing_key": sample.routing_key} if sample.routing_key else {}


def routing_headers(args: Any, sample: Sample) -> dict[str, str] | None:
    """Miles's ``compute_routing_headers``: ``{"X-SMG-Routing-Key": key}`` for a sample with a routing key, else None;
    under a routing-key policy (``args.sglang_router_policy`` manual or consistent_hashing) a sample without one is
    refused (SampleError, one line), as in Miles."""
    from miles.config.router import uses_routing_key
    from miles.fleet.client import ROUTING_KEY_HEADER

    policy = getattr(args, "sglang_router_policy", None)
    if uses_routing_key(policy) and not sample.routing_key:
        raise SampleError(f"router policy {policy} routes by {ROUTING_KEY_HEADER}, but sample (index={sample.index}) "
                          "has no routing_key set: set sample.routing_key (the built-in rollout gives each sample one).")
    return {ROUTING_KEY_HEADER: sample.routing_key} if sample.routing_key else None


async def generate(client: Any, sample: Sample, sampling_params: dict[str, Any], *,
                   top_logprobs_num: int = 0, routed_experts: bool = False) -> Sample:
    """The default: one /generate call on ``sample.tokens`` (the prompt ids). ``top_logprobs_num``: also keep
    the engine's top-k log-probs of every generated position (``metadata["opd_student_top_logprobs"]``);
    ``routed_experts``: ask for the MoE routing (R3), kept in ``sample.rollout_routed_experts``."""
    extra = request_extra(top_logprobs_num, routed_experts, sample_image_data(sample))
    out = await client.generate(list(sample.tokens), sampling_params, return_logprob=True, extra=extra,
                                **routing(sample))
    append_output(sample, out)
    return sample


class MultiTurn:
    """Builds one sample over several engine calls and inserted observations, keeping ids exact.

    The whole response (generated turns plus observations) is limited to ``max_new_tokens`` of the
    sampling params (None: no limit but the engine's context length); when it runs out the sample is TRUNCATED.
    """

    def __init__(self, sample: Sample, tokenizer: Any, sampling_params: dict[str, Any], *,
                 routed_experts: bool = False) -> None:
        self.sample, self.tokenizer = sample, tokenizer
        self.extra = request_extra(0, routed_experts, sample_image_data(sample))
        self.sampling_params = dict(sampling_params)
        budget = self.sampling_params.get("max_new_tokens")
        self.budget = int(budget) if budget is not None else None
        self.sample.loss_mask = self.sample.loss_mask or []
        self.sample.rollout_log_probs = self.sample.rollout_log_probs or []

    @property
    def remaining(self) -> int | None:
        return None if self.budget is None else self.budget - self.sample.response_length

    async def generate_turn(self, client: Any, **overrides: Any) -> tuple[list[int], SampleStatus]:
        """One engine call on everything so far; returns the new ids and the turn's status."""
        remaining = self.remaining
        if remaining is not None and remaining <= 0:
            self.sample.status = SampleStatus.TRUNCATED
            return [], SampleStatus.TRUNCATED
        asked = overrides.get("max_new_tokens", remaining)
        limits = [n for n in (remaining, asked) if n is not None]
        params = {**self.sampling_params, **overrides, "max_new_tokens": min(limits) if limits else None}
        out = await client.generate(list(self.sample.tokens), params, return_logprob=True, extra=self.extra,
                                    **routing(self.sample))
        return append_output(self.sample, out, decode=self.decode)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=bool(self.sampling_params.get("skip_special_tokens")))

    def add_observation(self, ids: list[int] | None = None, text: str | None = None) -> bool:
        """Append tool output (ids, or text tokenized on its own) with loss mask 0 and log-prob 0.0.

        Returns False, marking the sample TRUNCATED, when it does not fit the response budget.
        """
        if ids is None:
            if text is None:
                raise ValueError("add_observation needs ids or text")
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.remaining is not None and len(ids) > self.remaining:
            self.sample.status = SampleStatus.TRUNCATED
            return False
        append_observation(self.sample, list(ids), self.decode)
        return True


def append_observation(sample: Sample, ids: list[int], decode: Any) -> None:
    """Append ``ids`` (tool or environment output) to ``sample`` as response tokens not trained on: loss mask 0,
    log-prob 0.0, ``response`` += ``decode(ids)``. A loss mask of None (every response token trained on) becomes
    explicit first; log-probs of None stay None when the sample has a response without them."""
    n = sample.response_length
    sample.tokens = list(sample.tokens) + list(ids)
    sample.loss_mask = (list(sample.loss_mask) if sample.loss_mask is not None else [1] * n) + [0] * len(ids)
    if sample.rollout_log_probs is not None or n == 0:
        sample.rollout_log_probs = list(sample.rollout_log_probs or []) + [0.0] * len(ids)
    sample.response_length = n + len(ids)
    sample.response += decode(ids)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_arithmetic(expr: str) -> float | int:
    """Evaluate + - * / // % and parentheses on numbers; ValueError for anything else."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not plain arithmetic: {ast.dump(node)[:60]}")

    if len(expr) > 200:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from e


def calculator_observation(turn_text: str) -> str | None:
    """The tool answer for a turn ending in ``<calc>EXPR</calc>``, or None when the turn calls no tool."""
    if not turn_text.rstrip().endswith("</calc>") or "<calc>" not in turn_text:
        return None
    expr = turn_text[turn_text.rfind("<calc>") + len("<calc>"):turn_text.rstrip().rfind("</calc>")]
    try:
        value = safe_arithmetic(expr)
        return f"<result>{value:g}</result>" if isinstance(value, float) else f"<result>{value}</result>"
    except (ValueError, OverflowError) as e:
        return f"<result>error: {e}</result>"


async def generate_with_calculator(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Example ``--custom-generate-function-path miles.rollout.generate.generate_with_calculator``.

    The model may end a turn with ``<calc>EXPR</calc>``; the tool's ``<result>VALUE</result>`` is
    appended (loss mask 0) and generation continues, for up to ``metadata["max_turns"]`` turns (4).
    """
    turn = MultiTurn(sample, args.tokenizer, sampling_params,
                     routed_experts=bool(getattr(args, "use_rollout_routing_replay", False)))
    stops = list(sampling_params.get("stop") or []) + ["</calc>"]
    for _ in range(int(sample.metadata.get("max_turns", 4))):
        ids, status = await turn.generate_turn(args.client, stop=stops)
        if status is not SampleStatus.COMPLETED:
            break
        observation = calculator_observation(turn.decode(ids))
        if observation is None or not turn.add_observation(text=observation):
            break
    return sample
