"""Forward passes and the KV cache.

``ModelRunner`` loads any HF causal LM from a local directory with transformers and serves two calls:
``prefill`` (new requests, padded into one batch) and ``decode`` (one token for every running request);
with the paged cache also ``decode_mixed`` (a decode step whose forward also carries a prompt chunk).
Running requests occupy KV slots ``0..n-1`` (the scheduler keeps them compact), so a decode step works
on the static-shaped views ``cache[:bucket]``.

Two implementations sit behind it:

* ``_NativeLM`` for the Llama / Qwen2 / Qwen3 / Mistral family: our own attention over a slot-based
  static KV cache ``[slots, kv_heads, max_context, head_dim]`` per layer, reusing the HF modules for
  the projections, norms (incl. Qwen3's q/k norm), MLP and rotary tables (so rope_theta and rope scaling
  come from the HF config). The decode step has static shapes per (batch bucket, context bucket) and is
  captured as a CUDA graph on GPU (``cuda_graph=True``).
* ``_GenericLM`` for every other architecture: the HF forward with one ``DynamicCache`` per slot,
  one request at a time. Slow but general: "any HF causal LM" loads.

Modules: ``runner_options`` (RunnerOptions, buckets, dtype / KV-cache resolution), ``native_layers`` (fused norms,
RoPE, weight fusion), ``native_lm`` (construction, KV-cache plumbing, prefill), ``native_decode`` (decode and mixed
steps, CUDA graph capture), ``generic_lm`` (the HF path); this module: model loading, ``ParamIndex``, and
``ModelRunner`` (weight access, memory release / resume).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from miles.engine.generic_lm import _GenericLM
from miles.engine.native_layers import prefill_attention_kernels
from miles.engine.native_lm import _NativeLM
from miles.engine.paged_cache import PagedKV
from miles.engine.runner_options import (
    MIX_RIDERS,
    NATIVE_MODEL_TYPES,
    PAGE_SIZES,
    RunnerOptions,
    _available_bytes,
    graph_batch_sizes,
    resolve_dtype,
    resolve_kv_cache,
)
from miles.engine.weights import checkpoint_parts, checkpoint_renames, drop_mtp, mtp_layer_names
from miles.utils.build_imports import engine_missing_package_error, serving_class
from miles.utils.logging import get_logger

logger = get_logger("miles.engine.model_runner")


class ParamIndex(dict):
    """The live tensors by HF name (``state_dict`` names; iteration and ``len`` cover those only). transformers 5
    fuses MoE experts into 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I];
    Nemotron-H's non-gated ``mixer.experts.up_proj``) while checkpoints, SGLang and the trainers' exports name them
    per expert (``mlp.experts.<e>.gate_proj.weight`` ...): lookups by those names return views into the fused
    storage (made on lookup, so none outlives a release of the weights), and updates and reads by either name
    reach the same weights. ``renames`` (``weights.checkpoint_renames``): the checkpoint's names of tensors that
    transformers renames on load (Nemotron-H's ``backbone.*``), looked up as the names they load into. ``parts``
    (``weights.checkpoint_parts``): the checkpoint's other names that transformers converts on load, each a view of
    part of a live tensor (transformers' conversion reverted, as the trainers export it: DeepSeek-V4's native names)."""

    def __init__(self, params: dict[str, torch.Tensor], renames: dict[str, str] | None = None,
                 parts: dict[str, tuple[str, Any]] | None = None):
        super().__init__(params)
        self.aliases: dict[str, tuple[str, int, int | None]] = {}     # name -> (fused name, expert, half)
        for name, p in params.items():
            if p.dim() == 3 and name.endswith(".experts.gate_up_proj"):
                for e in range(p.shape[0]):
                    self.aliases[f"{name[:-13]}.{e}.gate_proj.weight"] = (name, e, 0)
                    self.aliases[f"{name[:-13]}.{e}.up_proj.weight"] = (name, e, 1)
            elif p.dim() == 3 and name.endswith((".experts.down_proj", ".experts.up_proj")):
                base, proj = name.rsplit(".", 1)
                for e in range(p.shape[0]):
                    self.aliases[f"{base}.{e}.{proj}.weight"] = (name, e, None)
        self.renames: dict[str, str] = {}                              # checkpoint name -> parameter name
        for ext, name in (renames or {}).items():
            if dict.__contains__(self, ext) or ext in self.aliases:     # a live name already: never shadowed
                continue
            if dict.__contains__(self, name):
                self.renames[ext] = name
            elif name in self.aliases:
                self.aliases[ext] = self.aliases[name]
        self.parts: dict[str, tuple[str, Any]] = {}                     # checkpoint name -> (live name, Part)
        for ext, (name, part) in (parts or {}).items():
            if not (dict.__contains__(self, ext) or ext in self.aliases or ext in self.renames) \
                    and dict.__contains__(self, name):
                self.parts[ext] = (name, part)

    def _view(self, name: str) -> torch.Tensor:
        if name in self.parts:
            live, part = self.parts[name]
            return part.of(dict.__getitem__(self, live).detach())
        fused, e, half = self.aliases[name]
        t = dict.__getitem__(self, fused).detach()[e]
        return t if half is None else t.chunk(2, dim=0)[half]

    def get(self, name, default=None):
        if dict.__contains__(self, name):
            return dict.__getitem__(self, name)
        if name in self.renames:
            return dict.__getitem__(self, self.renames[name])
        return self._view(name) if name in self.aliases or name in self.parts else default

    def __missing__(self, name):
        return dict.__getitem__(self, self.renames[name]) if name in self.renames else self._view(name)

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self.aliases or name in self.renames or name in self.parts


def unclamp_shared_experts(model: torch.nn.Module) -> int:
    """``--no-activation-func-clamp-shared-expert``: transformers' shared experts whose SwiGLU clamps at ``limit``
    (DeepSeek-V4's ``DeepseekV4MLP``) computed unclamped, the routed experts' clamp kept; as the trainer computes them
    with Miles's flag (``miles.trainer.megatron.fork_flags``). ValueError, one line, when the model has none."""
    found = [m for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] == "shared_experts" and isinstance(getattr(m, "limit", None), (int, float))]
    if not found:
        raise ValueError(f"--no-activation-func-clamp-shared-expert: {type(model).__name__} has no shared experts with "
                         "a clamped SwiGLU (DeepSeek-V4's swiglu_limit); drop the flag")
    for m in found:
        m.limit = float("inf")             # clamp(max=inf) and clamp(-inf, inf) leave every value as it is
    return len(found)


class ModelRunner:
    """The model, its KV cache, weight access, and memory release/resume."""

    def __init__(self, model_path: str | Path, opts: RunnerOptions):
        from transformers import AutoConfig, AutoModelForImageTextToText

        self.model_path = str(model_path)
        from miles.utils.model_dir import check_model_dir

        check_model_dir(self.model_path, "--hf-checkpoint")  # ModelDirError (a ValueError): one line naming the file
        self.device = torch.device(opts.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--device {opts.device}: CUDA is not available in this process; use --device cpu")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        config = AutoConfig.from_pretrained(self.model_path)
        self.dtype = resolve_dtype(opts.dtype, self.device, config)
        from miles.engine import vlm

        self.is_vlm = vlm.is_vlm(config)   # Qwen3-VL: images on /generate, the generic HF path (miles.engine.vlm)
        # a multimodal type without a causal LM (Kimi-K2.5, Inkling's released layout): its own model, served on text
        auto_cls = AutoModelForImageTextToText if self.is_vlm else serving_class(config)
        try:
            model = auto_cls.from_pretrained(self.model_path, dtype=self.dtype)
        except ModuleNotFoundError as e:   # the class imports an optional package when built (Inkling's tower)
            raise engine_missing_package_error(e, self.model_path, config, auto_cls) from None
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        if not opts.clamp_shared_expert:
            logger.info("--no-activation-func-clamp-shared-expert: %d shared experts served unclamped",
                        unclamp_shared_experts(self.model))
        self.config = self.model.config
        text_cfg = getattr(self.config, "text_config", None) if self.is_vlm else None
        self.is_mtp_name = mtp_layer_names(text_cfg or self.config)   # the checkpoint's MTP layers: not served, skipped
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        limit = int(getattr(text_cfg or self.config, "max_position_embeddings", 0) or 4096)
        max_ctx = opts.max_context_len
        if max_ctx is None:
            max_ctx = min(limit, 4096)
        if max_ctx < 2:
            raise ValueError(f"--max-context-len {max_ctx} is too small; give at least prompt + response length")
        if max_ctx > limit:
            logger.warning("--max-context-len %d exceeds the model's max_position_embeddings %d", max_ctx, limit)
        self.max_ctx = max_ctx
        self.max_slots = int(opts.max_running_requests)
        if self.max_slots < 1:
            raise ValueError(f"--max-running-requests {self.max_slots} must be at least 1")
        self.paged = resolve_kv_cache(opts.kv_cache, self.device) == "paged"
        if opts.page_size not in PAGE_SIZES:
            raise ValueError(f"--page-size {opts.page_size} is not one of {', '.join(map(str, PAGE_SIZES))}")
        self.page_size = opts.page_size
        if opts.max_total_tokens is not None:
            if opts.max_total_tokens < max_ctx:
                raise ValueError(f"--max-total-tokens {opts.max_total_tokens} is less than one request's context "
                                 f"({max_ctx} tokens, --max-context-len): raise it or lower --max-context-len")
            if not self.paged:  # the paged cache admits by free pages instead
                self.max_slots = min(self.max_slots, opts.max_total_tokens // max_ctx)
        self.graph_batch_sizes = graph_batch_sizes(self.max_slots, opts.cuda_graph_bs, opts.cuda_graph_max_bs)
        self.deterministic = opts.deterministic
        if self.deterministic:  # one decode shape, all the slots (see _NativeLM); captured when a bucket allows it
            self.graph_batch_sizes = [b for b in self.graph_batch_sizes if b == self.max_slots]
            if opts.cuda_graph and self.device.type == "cuda" and not self.graph_batch_sizes:
                logger.warning("--enable-deterministic-inference decodes every step at all %d slots, which "
                               "--cuda-graph-bs/--cuda-graph-max-bs do not capture: decode runs without a CUDA graph; "
                               "capture %d to have one", self.max_slots, self.max_slots)
        native = opts.native and getattr(self.config, "model_type", "") in NATIVE_MODEL_TYPES and not self.is_vlm
        self.impl: _NativeLM | _GenericLM
        if native:
            try:
                pages = self._pool_pages(opts, max_ctx) if self.paged else None
                # served adapters run through Python hooks per forward: no CUDA graphs then
                self.impl = _NativeLM(self.model, self.max_slots, max_ctx, self.device, self.dtype,
                                      opts.cuda_graph and not opts.enable_lora,
                                      self.graph_batch_sizes, pages, self.page_size, opts.deterministic,
                                      mix_step_tokens=opts.mix_step_tokens)
            except (AttributeError, NotImplementedError) as e:
                logger.warning("native forward unavailable for %s (%s); using the generic HF path", self.config.model_type, e)
                native = False
        if not native:
            generic = vlm.VLMGenericLM if self.is_vlm else _GenericLM
            self.impl = generic(self.model, self.max_slots, max_ctx, self.device)
            self.paged = False
        self.native = native
        self.kv: PagedKV | None = getattr(self.impl, "kv", None)
        need, avail = self.impl.cache_bytes(), _available_bytes(self.device)
        # a pool sized from free memory fits by construction (_pool_pages); an explicit --max-total-tokens may not
        if need > 0.9 * avail and self.kv is not None and opts.max_total_tokens is not None:
            raise ValueError(f"the KV page pool needs {need / 2**30:.1f} GiB but only {avail / 2**30:.1f} GiB is free; "
                             f"lower --max-total-tokens")
        if need > 0.9 * avail:
            raise ValueError(f"the KV cache needs {need / 2**30:.1f} GiB ({self.max_slots} slots x {max_ctx} tokens) but only "
                             f"{avail / 2**30:.1f} GiB is free; lower --max-running-requests or --max-context-len")
        self._renames = checkpoint_renames(self.model_path, self.model)   # e.g. Nemotron-H's backbone.* names
        self.lora = None
        if opts.enable_lora:   # sglang --enable-lora: adapters named by /generate's lora_path (miles.engine.lora)
            from miles.engine.lora import LoraServing

            self.lora = LoraServing(self.model, self.max_slots + MIX_RIDERS + 2, self.device,
                                    max_rank=opts.max_lora_rank, max_loaded=opts.max_loaded_loras,
                                    target_modules=opts.lora_target_modules,
                                    experts_shared_outer=opts.experts_shared_outer_loras, renames=self._renames)
            self.impl.lora = self.lora
            if native:
                self.impl.unfuse()
        self.impl.allocate_cache()
        self.eos_token_ids = self._eos_ids()
        self._parts = checkpoint_parts(self.model_path, self.model)       # e.g. DeepSeek-V4's native names
        self._params = ParamIndex(self.model.state_dict(keep_vars=True), self._renames, self._parts)
        self._weights_backup: dict[int, torch.Tensor] | None = None
        self.weights_epoch = 0   # bumped by every weight load: cached prompt KV/logits from before are stale
        self.weights_released = False
        self.kv_released = False
        layout = (f"paged KV cache of {self.kv.pool.num_pages - 1} pages x {self.page_size} tokens" if self.kv is not None
                  else f"slot KV cache of {self.max_slots} x {max_ctx} tokens")
        logger.info("loaded %s (%s, %s) on %s: %s forward, %d running requests at most, %s, %.1f MiB%s",
                    self.model_path, self.config.model_type, self.dtype, self.device, "native" if native else "generic HF",
                    self.max_slots, layout, need / 2**20, ", CUDA graphs" if getattr(self.impl, "use_graphs", False) else "")

    def _pool_pages(self, opts: RunnerOptions, max_ctx: int) -> int:
        """Pages in the pool (+1 scratch page): --max-total-tokens, else as much as the slot cache, capped by memory."""
        ps = self.page_size
        cfg = self.config
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        el = torch.tensor([], dtype=self.dtype).element_size()
        page_bytes = 2 * int(cfg.num_hidden_layers) * ps * n_kv * head_dim * el
        one_request = -(-max_ctx // ps)
        if opts.max_total_tokens is not None:
            return -(-opts.max_total_tokens // ps) + 1
        pages = self.max_slots * one_request + 1
        avail = _available_bytes(self.device)
        fraction = getattr(opts, "mem_fraction_static", None)
        if fraction is not None and self.device.type == "cuda":  # sglang's meaning: weights + KV pool of total memory
            total = torch.cuda.mem_get_info(self.device)[1]
            cap = int(fraction * total) - (total - avail)
        else:
            cap = int(0.85 * avail)
        if pages * page_bytes > cap:
            fit = max(cap // page_bytes, 0)
            if fit < one_request + 1:
                raise ValueError(f"the KV page pool would get {fit} pages of {ps} tokens but one request's context needs "
                                 f"{one_request} (--max-context-len {max_ctx}); free memory or lower --max-context-len")
            logger.info("KV page pool capped by free memory: %d pages (%d tokens)", fit, (fit - 1) * ps)
            pages = fit
        return pages

    # ------------------------------------------------------------------ paged KV bookkeeping (no-ops for slots)
    def free_pages(self) -> int | None:
        return self.kv.pool.num_free if self.kv is not None else None

    def pages_for(self, ntok: int) -> int:
        return -(-ntok // self.page_size)

    def grow_pages(self, slots: list[int]) -> None:
        """One more page for each slot whose next token starts a page (the caller checked free_pages)."""
        if self.kv is not None:
            self.kv.grow_one_page(slots)

    def release_slot(self, slot: int) -> None:
        self.impl.release_slot(slot)

    @property
    def chunk_row(self) -> int | None:
        """The block-table row of a prompt prefilled in chunks (paged native cache), else None (no chunking)."""
        return self.kv.chunk_row if self.kv is not None else None

    def prefill_chunk(self, row: int, tokens: list[int], start: int, want_full: bool):
        with prefill_attention_kernels(self.device):
            return self.impl.prefill_chunk(row, tokens, start, want_full)

    @property
    def mix_tokens(self) -> int:
        """Prompt tokens a mixed prefill + decode step can carry (paged native cache without sliding windows), else 0."""
        return getattr(self.impl, "mix_tokens", 0) if self.native else 0

    def decode_mixed(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int, row: int, chunk: list[int],
                     start: int) -> torch.Tensor:
        return self.impl.decode_mixed(tokens, positions, max_len, row, chunk, start)

    def decode_mixed_many(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int,
                          chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        return self.impl.decode_mixed_many(tokens, positions, max_len, chunks)

    @property
    def mix_step_tokens(self) -> int:
        """Prompt tokens one mixed step carries at most, over all its prompts (0: no mixed steps)."""
        return self.impl.mix_step_tokens if self.mix_tokens else 0

    @property
    def ride_rows(self) -> list[int]:
        """The block-table rows of the prompts prefilled inside decode steps (paged native cache; else none)."""
        return list(self.kv.ride_rows) if self.kv is not None and self.mix_tokens else []

    def pages_held(self, row: int) -> int:
        return len(self.kv.tables[row]) if self.kv is not None else 0

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        self.impl.share_prefix(src, dst, length)

    def share_prefix_many(self, src: int, dsts: list[int], length: int) -> None:
        """``share_prefix(src, dst, length)`` for every ``dst`` (batched where the cache can)."""
        many = getattr(self.impl, "share_prefix_many", None)
        if many is not None:
            return many(src, dsts, length)
        for dst in dsts:
            self.impl.share_prefix(src, dst, length)

    @property
    def can_share_running_prefix(self) -> bool:
        """Whether a running request's first ``length`` tokens of KV can seed a new request (native caches: the
        slot cache copies them, the paged cache shares the full pages); the generic HF path cannot crop its cache."""
        return self.native

    def kv_tokens(self) -> int:
        """KV tokens the cache holds in all (sglang's max_total_num_tokens)."""
        if self.kv is not None:
            return (self.kv.pool.num_pages - 1) * self.page_size
        return self.max_slots * self.max_ctx

    def kv_stats(self) -> dict[str, int]:
        if self.kv is None:
            return {}
        pool = self.kv.pool
        return {"kv_pages_total": pool.num_pages - 1, "kv_pages_in_use": pool.num_used, "kv_pages_peak": self.kv.peak_used,
                "kv_page_size": self.page_size}

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None)):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, list | tuple):
                ids.update(int(x) for x in e)
        return ids

    # ------------------------------------------------------------------ forward
    def prefill(self, slot_start: int, seqs: list[list[int]], full_for: list[bool], mm: list | None = None):
        """``mm``: per sequence its images (``miles.engine.vlm.ImageBatch``) or None; only a VLM takes them.
        Batch-invariant mode: each sequence is prefilled on its own (its forward's shapes are its own length's)."""
        if self.deterministic and len(seqs) > 1:
            outs = [self.prefill(slot_start + i, [s], [f], None if mm is None else [mm[i]])
                    for i, (s, f) in enumerate(zip(seqs, full_for))]
            return torch.cat([last for last, _ in outs]), [full[0] for _, full in outs]
        with prefill_attention_kernels(self.device):
            if mm is not None and any(b is not None for b in mm):
                return self.impl.prefill(slot_start, seqs, full_for, mm)
            return self.impl.prefill(slot_start, seqs, full_for)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        return self.impl.decode(tokens, positions, max_len)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.impl.move_slot(src, dst, length)
        if self.lora is not None:
            self.lora.move_row(src, dst)

    def set_lora(self, row: int, index: int) -> None:
        """KV row ``row`` now holds a request of adapter ``index`` (0: the base model); no-op without adapters."""
        if self.lora is not None:
            self.lora.set_row(row, index)

    @property
    def has_routed_experts(self) -> bool:
        """MoE routing is recorded (a MoE model, which runs on the generic HF path)."""
        rec = getattr(self.impl, "recorder", None)
        return rec is not None and rec.enabled

    def record_routes(self, slot: int, on: bool) -> None:
        """Record ``slot``'s MoE routing from its next forward on (its request asked for routed experts), or stop and
        drop its rows; a slot released or freshly admitted does not record until told. A no-op where nothing is."""
        if self.has_routed_experts:
            self.impl.record_routes(slot, on)

    def routed_experts(self, slot: int) -> torch.Tensor | None:
        return self.impl.routed_experts(slot) if self.has_routed_experts else None

    @torch.no_grad()
    def pick_cpu_threads(self, rows: int = 64, reps: int = 5) -> int:
        """On CPU with more than one intra-op thread: time a one-token forward of ``rows`` rows (a decode step's
        matmuls; no KV cache is touched) on the calling thread's intra-op threads and on one, and keep the faster
        for every forward from now on. A tiny model decodes faster on one thread (its ops take microseconds, less
        than an OpenMP fork / join), a larger one on all of them. Each side: the best of ``reps`` forwards after a
        warm one. Returns the count kept (the count as it was on GPU, on one thread, or when the forward fails)."""
        n = torch.get_num_threads()
        if self.device.type != "cpu" or n == 1 or not self.ready:
            return n
        ids = torch.zeros(min(rows, self.max_slots), 1, dtype=torch.long)

        def best(threads: int) -> float:
            torch.set_num_threads(threads)
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                self.model(input_ids=ids, use_cache=False)
                times.append(time.perf_counter() - t0)
            return min(times[1:])

        try:
            t_n, t_1 = best(n), best(1)
        except Exception:  # noqa: BLE001 - a model whose forward needs more than ids keeps the process's threads
            torch.set_num_threads(n)
            logger.debug("CPU thread check skipped: the one-token forward failed", exc_info=True)
            return n
        keep = 1 if t_1 < t_n else n
        torch.set_num_threads(keep)
        logger.info("CPU forwards on %d thread(s): a %d-row one-token forward took %.2f ms on %d, %.2f ms on 1",
                    keep, ids.shape[0], t_n * 1e3, n, t_1 * 1e3)
        return keep

    def warm_up(self) -> None:
        """Capture the decode CUDA graphs ahead of the first requests (a no-op where there are none to capture)."""
        warm = getattr(self.impl, "warm_up", None)
        if warm is not None and self.ready:
            t0 = time.perf_counter()
            n = warm()
            if n:
                logger.info("captured %d decode CUDA graphs in %.1f s", n, time.perf_counter() - t0)

    # ------------------------------------------------------------------ weights
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """HF parameter names (as in the safetensors files, tied aliases included) -> live tensors."""
        return self._params

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor], *, strict_names: bool = True) -> int:
        """Copy ``tensors`` into the live weights in place (CUDA graphs stay valid). Validates everything first."""
        params = self._params
        tensors = drop_mtp(tensors, self.is_mtp_name)      # the checkpoint's MTP layers: not served, skipped
        if self.weights_released:
            raise ValueError("weights are released (release_memory_occupation); resume them before updating")
        for name, t in tensors.items():
            p = params.get(name)
            if p is None:
                if strict_names:
                    raise ValueError(f"unknown parameter name '{name}'; the engine uses HF names such as "
                                     f"'{next(iter(params))}'")
                continue
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"parameter '{name}' has shape {tuple(p.shape)}, the update has {tuple(t.shape)}")
        n = 0
        self.weights_epoch += 1
        for name, t in tensors.items():
            p = params.get(name)
            if p is not None:
                p.data.copy_(t.to(device=p.device, dtype=p.dtype, non_blocking=True))
                n += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return n

    def snapshot(self, names=None) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the named weights (all when None), for rollback."""
        names = list(self._params) if names is None else list(names)
        return {n: self._params[n].detach().to("cpu", copy=True) for n in names if n in self._params}

    # ------------------------------------------------------------------ memory
    def clear_cache(self) -> None:
        # Native: nothing to drop. The only KV shared across requests is a running request's prompt (the scheduler's
        # holders), and a flush needs nothing running; every read is masked to positions its own request wrote.
        # Zeroing the whole cache (512 MiB for 128 slots x 2,048 tokens of the quickstart model) cost more than the
        # rest of a weight sync together.
        if not self.native:
            self.impl.free_cache()

    def release(self, tags: set[str]) -> None:
        # CPU: host memory is not a device's to give back to a colocated trainer; the weights and the KV cache stay
        # (freeing the cache and zeroing it again at resume cost 0.55 s a step at 128 slots x 2,048 positions)
        if "kv_cache" in tags and not self.kv_released:
            if self.device.type != "cpu":
                self.impl.free_cache()
            self.kv_released = True
        if "cuda_graph" in tags or "weights" in tags:
            self.impl.drop_graphs()
        if "weights" in tags and not self.weights_released:
            if self.native:  # the fused q/k/v and gate/up buffers hold the weights' memory too
                self.impl.unfuse()
            backup: dict[int, torch.Tensor] = {}
            for p in {id(p): p for p in self.model.parameters()}.values():
                # GPU: a pinned host copy, then the device memory is freed; CPU: the tensor itself is kept
                host = p.data.to("cpu", copy=True).pin_memory() if self.device.type == "cuda" else p.data
                backup[id(p)] = host
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._weights_backup = backup
            self.weights_released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tags: set[str]) -> None:
        if "weights" in tags and self.weights_released:
            backup = self._weights_backup or {}
            for p in {id(p): p for p in self.model.parameters()}.values():
                p.data = backup[id(p)].to(self.device, non_blocking=True)
            self._weights_backup = None
            self.weights_released = False
            if self.native:
                self.impl.fuse()
            self._params = ParamIndex(self.model.state_dict(keep_vars=True), self._renames, self._parts)
        if "kv_cache" in tags and self.kv_released:
            if self.device.type != "cpu":
                self.impl.allocate_cache()
            else:                                      # the cache's contents stay; its bookkeeping starts afresh
                self.impl.reset_cache()
            self.kv_released = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def ready(self) -> bool:
        return not (self.weights_released or self.kv_released)
