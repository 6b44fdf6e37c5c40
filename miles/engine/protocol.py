"""Request bodies of SGLang's HTTP protocol as msgspec structs, and their validation.

Field names and defaults mirror SGLang's ``GenerateReqInput``, ``SamplingParams`` and the weight/control
request structs (``sglang/srt/managers/io_struct.py``, ``sglang/srt/sampling/sampling_params.py``; the
SGLang commit they were checked against is in docs/engine-protocol.md). Every control struct carries
SGLang's ``BaseReq`` fields ``rid`` and ``http_worker_ipc``.
Unknown fields are rejected (``BadRequest`` naming the field, answered as HTTP 400). Fields SGLang accepts
but this engine cannot honour (grammars, penalties, video/audio inputs, LoRA, ...) are accepted only at
their default value (``image_data`` is taken on a vision-language model: ``miles.engine.vlm``); any other value is a 400 that names the field and says it is unsupported here.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

TOP_K_ALL = 1 << 30
_SAMPLING_EPS = 1e-6


class BadRequest(ValueError):
    """A request body SGLang's structs would reject (or this engine cannot serve): HTTP 400."""


class _Req(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _Control(_Req, kw_only=True):
    """SGLang's ``BaseReq``: every control/weight request may carry these (accepted, not used here)."""

    rid: str | list[str] | None = None
    http_worker_ipc: str | None = None


# ----------------------------------------------------------------------------- generation
class SamplingParams(_Req):
    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_new_tokens: int | None = 0
    n: int | None = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None


# Accepted at their default only (name -> default); anything else is "unsupported by the embedded engine".
_UNSUPPORTED_SAMPLING = {
    "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "custom_params": None, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
}


class GenerateReqInput(_Req):
    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int | list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    # Accepted and ignored (routing, bookkeeping and metrics hints; sglang-router adds "model").
    model: str | None = None
    log_metrics: bool = True
    session_id: str | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    received_time: float | None = None
    external_trace_header: dict[str, Any] | None = None
    background: bool = False
    return_bytes: bool = False
    http_worker_ipc: str | None = None
    disagg_prefill_dp_rank: int | None = None
    kv_router_hint: dict[str, Any] | None = None
    # Accepted at their default only.
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    return_entropy: bool = False
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: bool = False
    video_config: Any = None
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    positional_embed_overrides: Any = None
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    return_prompt_token_ids: bool = False
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    multi_item_delimiter_indices: Any = None
    cache_salt: Any = None


_UNSUPPORTED_GENERATE = {
    "input_embeds": None, "video_data": None, "audio_data": None, "modalities": None,
    "session_params": None, "lora_id": None, "custom_logit_processor": None,
    "return_hidden_states": False, "return_entropy": False,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "return_sampling_mask": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "return_indexer_topk": False,
    "positional_embed_overrides": None, "require_reasoning": False, "max_thinking_tokens": None,
    "return_prompt_token_ids": False, "need_wait_for_mm_inputs": False, "num_items_assigned": None,
    "encoder_urls": None, "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "multi_item_delimiter_indices": None,
}


class GenSpec(msgspec.Struct, kw_only=True):
    """One normalised generation (one prompt, one of its ``n`` samples) as the scheduler sees it."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int | None
    min_new_tokens: int
    temperature: float           # 1.0 for greedy rows (top_k == 1), as SGLang normalises
    top_p: float
    top_k: int                   # TOP_K_ALL when off
    min_p: float
    stop_token_ids: list[int]
    stop_strs: list[str]
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    stream_interval: int
    logit_bias: dict[int, float] | None
    sampling_seed: int | None
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    return_text_in_logprobs: bool
    index: int                   # position in the response list
    # SGLang's routed-experts return (R3): meta_info["routed_experts"] = base64 of int32 [tokens - 1 - start, layers,
    # top-k], the experts each token that ran through the model was routed to, rows from routed_experts_start_len
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # SGLang's image_data of this prompt (one reference per image, in prompt order; the n samples of a prompt share
    # the list), and the engine's decoded form of it (``miles.engine.vlm.ImageBatch``, set before submission)
    image_data: list[str] | None = None
    mm: Any = None
    # SGLang's lora_path: the name of the loaded LoRA adapter this request runs with (None: the base model), and the
    # engine's index of it (``miles.engine.lora``; set before submission)
    lora_path: str | None = None
    lora_index: int = 0


TEXT_ONLY = ("this model takes no images (not a vision-language model); drop image_data or serve a "
             "vision-language model such as Qwen3-VL")


def _image_refs(value: Any, n_items: int, is_batch: bool) -> list[list[str] | None]:
    """SGLang's ``image_data`` per prompt: a single prompt takes one image (a string) or a list of them; a batch takes
    one such entry per prompt (null for a prompt without images). Each image is a string (data URL, path, base64)."""
    def refs(v: Any, where: str) -> list[str] | None:
        if v is None:
            return None
        items = v if isinstance(v, list) else [v]
        for k, x in enumerate(items):
            if not isinstance(x, str) or not x:
                raise BadRequest(f"GenerateReqInput.{where}[{k}] must be a non-empty string (a data:image/...;base64 "
                                 f"URL or a local file path), got {type(x).__name__}")
        return list(items) or None
    if value is None:
        return [None] * n_items
    if not is_batch:
        return [refs(value, "image_data")]
    if not isinstance(value, list) or len(value) != n_items:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise BadRequest(f"GenerateReqInput.image_data must have one entry per prompt of the batch ({n_items}), got {got}")
    return [refs(v, f"image_data[{i}]") for i, v in enumerate(value)]


# ----------------------------------------------------------------------------- control / weights
class AbortReq(_Req):
    rid: str | None = ""
    http_worker_ipc: str | None = None
    abort_all: bool = False
    finished_reason: Any = None
    abort_message: str | None = None
    weight_versions: Any = None


class PauseGenerationReqInput(_Control, kw_only=True):
    mode: str = "abort"


class ContinueGenerationReqInput(_Control, kw_only=True):
    torch_empty_cache: bool = True  # SGLang empties the CUDA allocator cache before resuming


class FlushCacheReqInput(_Control, kw_only=True):
    timeout_s: float | None = None  # wait up to this long for the cache to be free (SGLang's field)


class MemoryOccupationReqInput(_Control, kw_only=True):
    tags: list[str] | None = None


class InitWeightsUpdateGroupReqInput(_Control, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Control, kw_only=True):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReqInput(_Control, kw_only=True):
    selector: Any = "all"


class EndWeightUpdateReqInput(_Control, kw_only=True):
    selector: Any = None


class UpdateWeightsFromDistributedReqInput(_Control, kw_only=True):
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str] | None = None
    dtype_names: list[str] | None = None
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False
    selector: Any = None
    p2p_ranges: list[list[list[int]]] | None = None  # miles's p2p mode: per trainer rank, its [start, end) bytes


class UpdateWeightsFromTensorReqInput(_Control, kw_only=True):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False
    selector: Any = None


class UpdateWeightFromDiskReqInput(_Control, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class UpdateWeightVersionReqInput(_Control, kw_only=True):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default: send false to keep paused/running requests


class LoadLoRAAdapterReqInput(_Control, kw_only=True):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(_Control, kw_only=True):
    lora_name: str
    lora_id: str | None = None


class LoadLoRAAdapterFromTensorsReqInput(_Control, kw_only=True):
    """SGLang's struct; its newer releases (and Miles's client) send ``serialized_named_tensors`` (one entry per TP
    rank) instead of ``serialized_tensors``, with ``upsert`` and ``expected_checksums``: both forms are taken."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_tensors: str | None = None
    serialized_named_tensors: list[str] | None = None
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    upsert: bool = False
    expected_checksums: dict[str, str] | None = None


class LoadLoRAAdapterFromDistributedReqInput(_Control, kw_only=True):
    """The adapter's metadata; its tensors arrive by broadcast over the weight-update group ``group_name`` in
    ``names`` order (Miles's SGLang: ``load_lora_adapter_from_distributed``)."""

    lora_name: str
    config_dict: dict[str, Any]
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    upsert: bool = False
    lora_id: str | None = None


class GetWeightsByNameReqInput(_Control, kw_only=True):
    name: str
    truncate_size: int = 100


def decode(body: bytes, cls: type[msgspec.Struct], *, empty_ok: bool = False) -> Any:
    """Parse a JSON body into ``cls``; every problem becomes a ``BadRequest`` naming the field."""
    if not body.strip():
        if empty_ok:
            return cls()
        raise BadRequest(f"{cls.__name__}: the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{cls.__name__}: {e}") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"{cls.__name__}: the body is not valid JSON ({e})") from None


# ----------------------------------------------------------------------------- normalisation
def _lora_paths(value: Any, n_items: int, is_batch: bool) -> list[str | None]:
    """SGLang's ``lora_path``: one adapter name for every prompt, or (a batch) one per prompt, None for the base."""
    items = value if isinstance(value, list) else [value] * n_items
    if isinstance(value, list) and (not is_batch or len(value) != n_items):
        raise BadRequest(f"GenerateReqInput.lora_path has {len(value)} entries for {n_items} prompt(s)")
    for x in items:
        if x is not None and (not isinstance(x, str) or not x):
            raise BadRequest(f"GenerateReqInput.lora_path: {x!r} is not the name of a loaded LoRA adapter")
    return items


def _per_item(value: Any, n_items: int, name: str, is_batch: bool) -> list[Any]:
    if is_batch and isinstance(value, list):
        if len(value) != n_items:
            raise BadRequest(f"GenerateReqInput: '{name}' has {len(value)} entries for a batch of {n_items} prompts")
        return list(value)
    if not is_batch and isinstance(value, list) and name not in ("token_ids_logprob",):
        raise BadRequest(f"GenerateReqInput: '{name}' is a list but the request has a single prompt")
    return [value] * n_items


def parse_sampling_params(raw: dict[str, Any] | None, where: str = "sampling_params") -> SamplingParams:
    try:
        sp = msgspec.convert(raw or {}, SamplingParams)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{where}: {e}") from None
    for name, default in _UNSUPPORTED_SAMPLING.items():
        if getattr(sp, name) not in (None, default):
            raise BadRequest(f"{where}.{name}={getattr(sp, name)!r} is not supported by the embedded engine "
                             f"(it is SGLang-only); leave it at its default {default!r} or use --rollout-engine sglang")
    return sp


def _verify_sampling(sp: SamplingParams, where: str, vocab_size: int) -> dict[str, Any]:
    """SGLang's ``SamplingParams.__post_init__`` + ``verify``: None means default; temperature 0 is greedy."""
    t = 1.0 if sp.temperature is None else float(sp.temperature)
    top_p = 1.0 if sp.top_p is None else float(sp.top_p)
    top_k = -1 if sp.top_k is None else int(sp.top_k)
    min_p = 0.0 if sp.min_p is None else float(sp.min_p)
    min_new = 0 if sp.min_new_tokens is None else int(sp.min_new_tokens)
    n = 1 if sp.n is None else int(sp.n)
    if not math.isfinite(t) or t < 0.0:
        raise BadRequest(f"{where}.temperature must be a non-negative finite number, got {t}")
    if 0 <= t < _SAMPLING_EPS:
        t, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"{where}.top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"{where}.min_p must be in [0, 1], got {min_p}")
    if top_k < 1:
        raise BadRequest(f"{where}.top_k must be -1 (disable) or at least 1, got {top_k}")
    if min_new < 0:
        raise BadRequest(f"{where}.min_new_tokens must be in [0, max_new_tokens], got {min_new}")
    if sp.max_new_tokens is not None:
        if sp.max_new_tokens < 0:
            raise BadRequest(f"{where}.max_new_tokens must be at least 0, got {sp.max_new_tokens}")
        if min_new > sp.max_new_tokens:
            raise BadRequest(f"{where}.min_new_tokens must be in [0, max_new_tokens({sp.max_new_tokens})], got {min_new}")
    if n < 1:
        raise BadRequest(f"{where}.n must be at least 1, got {n}")
    if sp.stream_interval is not None and sp.stream_interval < 1:
        raise BadRequest(f"{where}.stream_interval must be at least 1, got {sp.stream_interval}")
    bias = None
    if sp.logit_bias:
        bias = {}
        for k, v in sp.logit_bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise BadRequest(f"{where}.logit_bias keys must be token ids, got {k!r}") from None
            if not 0 <= tid < vocab_size:
                raise BadRequest(f"{where}.logit_bias must have keys in [0, {vocab_size - 1}], got {tid}")
            bias[tid] = float(v)
    stop = sp.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stop_ids = [int(x) for x in (sp.stop_token_ids or [])]
    for x in stop_ids:
        if not 0 <= x < vocab_size:
            raise BadRequest(f"{where}.stop_token_ids: {x} is outside the vocabulary [0, {vocab_size - 1}]")
    return dict(
        max_new_tokens=sp.max_new_tokens, min_new_tokens=min_new, temperature=t, top_p=top_p, top_k=top_k,
        min_p=min_p, stop_token_ids=stop_ids, stop_strs=stops, ignore_eos=bool(sp.ignore_eos),
        skip_special_tokens=True if sp.skip_special_tokens is None else bool(sp.skip_special_tokens),
        spaces_between_special_tokens=True if sp.spaces_between_special_tokens is None else bool(sp.spaces_between_special_tokens),
        no_stop_trim=bool(sp.no_stop_trim), stream_interval=sp.stream_interval or 1, logit_bias=bias,
        sampling_seed=sp.sampling_seed, n=n,
    )


def normalize_generate(req: GenerateReqInput, tokenize, vocab_size: int, new_rid,
                       max_samples: int | None = None, image_error: str | None = TEXT_ONLY) -> tuple[list[GenSpec], bool]:
    """Expand a ``GenerateReqInput`` into one ``GenSpec`` per (prompt, sample). Returns (specs, is_batch).

    ``tokenize(text) -> list[int]`` raises BadRequest when the server has no tokenizer; ``new_rid()`` makes ids.
    More than ``max_samples`` generations (prompts x ``n``) is a BadRequest naming --max-samples-per-request.
    ``image_error``: None when the model takes images (``image_data`` is kept on the specs; the engine checks it),
    else why it does not (``image_data`` is then a BadRequest with that reason).
    """
    for name, default in _UNSUPPORTED_GENERATE.items():
        if getattr(req, name) not in (None, default):
            raise BadRequest(f"GenerateReqInput.{name} is not supported by the embedded engine; "
                             f"leave it unset or use --rollout-engine sglang")
    if req.image_data is not None and req.image_data != [] and image_error is not None:
        raise BadRequest(f"GenerateReqInput.image_data: {image_error}")
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("GenerateReqInput: give exactly one of 'text' or 'input_ids'")
    if req.input_ids is not None:
        ids = req.input_ids
        if len(ids) > 0 and all(isinstance(x, list) for x in ids):
            prompts, is_batch = [list(x) for x in ids], True
        elif all(isinstance(x, int) for x in ids):
            prompts, is_batch = [list(ids)], False
        else:
            raise BadRequest("GenerateReqInput.input_ids must be a list of token ids or a list of such lists, not a mix")
    else:
        is_batch = isinstance(req.text, list)
        texts = req.text if is_batch else [req.text]
        prompts = [tokenize(t) for t in texts]
    if is_batch and not prompts:
        raise BadRequest("GenerateReqInput: the batch is empty")
    n_items = len(prompts)
    for i, p in enumerate(prompts):
        if not p:
            raise BadRequest(f"GenerateReqInput: prompt {i} has no tokens")
        for t in p:
            if not 0 <= t < vocab_size:
                raise BadRequest(f"GenerateReqInput.input_ids: token id {t} (prompt {i}) is outside the vocabulary [0, {vocab_size - 1}]")
    sps = req.sampling_params
    if is_batch and isinstance(sps, list):
        if len(sps) != n_items:
            raise BadRequest(f"GenerateReqInput: 'sampling_params' has {len(sps)} entries for a batch of {n_items} prompts")
        sp_list = sps
    elif isinstance(sps, list):
        raise BadRequest("GenerateReqInput: 'sampling_params' is a list but the request has a single prompt")
    else:
        sp_list = [sps] * n_items
    rlp = _per_item(req.return_logprob, n_items, "return_logprob", is_batch)
    lsl = _per_item(req.logprob_start_len, n_items, "logprob_start_len", is_batch)
    tln = _per_item(req.top_logprobs_num, n_items, "top_logprobs_num", is_batch)
    til = req.token_ids_logprob
    if til is not None and is_batch and len(til) > 0 and isinstance(til[0], list):
        til_list = _per_item(til, n_items, "token_ids_logprob", True)
    else:
        til_list = [til] * n_items
    image_refs = _image_refs(req.image_data, n_items, is_batch) if image_error is None else [None] * n_items
    loras = _lora_paths(req.lora_path, n_items, is_batch)
    rids = req.rid
    rre = bool(req.return_routed_experts)
    re_start = int(req.routed_experts_start_len or 0)
    if re_start < 0:
        raise BadRequest(f"GenerateReqInput.routed_experts_start_len={re_start} must be >= 0")
    specs: list[GenSpec] = []
    norm = [_verify_sampling(parse_sampling_params(sp, f"sampling_params[{i}]" if is_batch else "sampling_params"),
                             f"sampling_params[{i}]" if is_batch else "sampling_params", vocab_size)
            for i, sp in enumerate(sp_list)]
    n_samples = norm[0]["n"]
    if any(d["n"] != n_samples for d in norm):
        raise BadRequest("sampling_params.n must be the same for every prompt of a batch")
    if max_samples is not None and n_items * n_samples > max_samples:
        raise BadRequest(f"sampling_params.n={n_samples} x {n_items} prompt(s) = {n_items * n_samples} generations "
                         f"exceeds this engine's limit of {max_samples} per request (--max-samples-per-request); "
                         f"send fewer samples per request or start the engine with a larger --max-samples-per-request")
    if isinstance(rids, list):
        if not is_batch or len(rids) != n_items:
            raise BadRequest(f"GenerateReqInput: 'rid' has {len(rids)} entries for {n_items} prompt(s)")
    index = 0
    for i, prompt in enumerate(prompts):
        d = dict(norm[i])
        n = d.pop("n")
        for j in range(n):
            if isinstance(rids, list):
                rid = rids[i] if n == 1 else f"{rids[i]}_{j}"
            elif isinstance(rids, str):
                rid = rids if (n_items == 1 and n == 1) else f"{rids}_{index}"
            else:
                rid = new_rid()
            start = lsl[i]
            start = -1 if start is None else int(start)
            if start >= len(prompt):
                raise BadRequest(f"GenerateReqInput.logprob_start_len={start} must be below the prompt length {len(prompt)}")
            tl = tln[i] or 0
            if tl < 0:
                raise BadRequest(f"GenerateReqInput.top_logprobs_num must be >= 0, got {tl}")
            tids = til_list[i]
            if tids is not None:
                tids = [int(x) for x in tids]
                for x in tids:
                    if not 0 <= x < vocab_size:
                        raise BadRequest(f"GenerateReqInput.token_ids_logprob: {x} is outside the vocabulary")
            if d["sampling_seed"] is not None and n > 1:
                d["sampling_seed"] = norm[i]["sampling_seed"] + j  # distinct, reproducible samples
            specs.append(GenSpec(rid=rid, input_ids=prompt, return_logprob=bool(rlp[i]), logprob_start_len=start,
                                 top_logprobs_num=int(tl), token_ids_logprob=tids,
                                 return_text_in_logprobs=req.return_text_in_logprobs, index=index,
                                 return_routed_experts=rre, routed_experts_start_len=re_start,
                                 image_data=image_refs[i], lora_path=loras[i], **d))
            index += 1
    return specs, is_batch or n_samples > 1
