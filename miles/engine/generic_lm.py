"""``_GenericLM``: every architecture the native forward does not cover runs transformers' own forward, one
``DynamicCache`` (or the cache its config builds) per slot, one request at a time; it records MoE routing for the
requests that ask (``routed_experts``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from miles.engine.routed_experts import RoutedExpertsRecorder

_CONFIG_CACHE = ("deepseek_v4",)


class _GenericLM:
    """Any HF causal LM: its own forward, one DynamicCache per slot, one request at a time."""

    def __init__(self, model, max_slots: int, max_ctx: int, device: torch.device):
        self.model, self.max_slots, self.max_ctx, self.device = model, max_slots, max_ctx, device
        self.caches: list = [None] * max_slots
        # MoE routing of every token each slot's forwards ran (SGLang's return_routed_experts), recorded only for the
        # slots whose request asked (``record_routes``): the other forwards run without the router hooks
        self.recorder = RoutedExpertsRecorder(model, getattr(model.config, "text_config", None) or model.config)
        self.routes: list[list[torch.Tensor] | None] = [None] * max_slots
        self.record: list[bool] = [False] * max_slots
        self.use_graphs = False
        self.lora = None   # miles.engine.lora.LoraServing when adapters are served
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (input and output)
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _run(self, ids: torch.Tensor, cache, slot: int | None = None, append: bool = False, **model_kw: torch.Tensor):
        """One HF forward of ``ids`` on ``cache`` (``model_kw``: further model inputs, e.g. a VLM's positions and
        pixels); records the run's expert routing for ``slot`` when it records (appended to the slot's when
        ``append``)."""
        rec = slot is not None and self.record[slot] and self.recorder.enabled
        if self.lora is not None:
            self.lora.tokens(None if slot is None else torch.full((ids.numel(),), slot, dtype=torch.long,
                                                                  device=self.device))
        if rec:
            self.recorder.begin()
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kw: cache}, **model_kw)
        if rec:
            rows = self.recorder.end(ids.shape[-1])
            self.routes[slot] = (self.routes[slot] or []) + [rows] if append else [rows]
        return out.logits, out[self.cache_kw] if self.cache_kw in out else out.past_key_values

    def record_routes(self, slot: int, on: bool) -> None:
        """Whether ``slot``'s forwards record their MoE routing from now on; off drops the rows it holds."""
        self.record[slot] = on
        if not on:
            self.routes[slot] = None

    def routed_experts(self, slot: int) -> torch.Tensor | None:
        """``[tokens run, layers, top-k]`` int32 of the request in ``slot`` (None for a dense model or a slot that
        does not record)."""
        parts = self.routes[slot]
        return None if not parts else torch.cat(parts)

    def cache_bytes(self) -> int:
        return 0

    def allocate_cache(self) -> None:
        self.caches = [None] * self.max_slots

    def free_cache(self) -> None:
        self.caches = [None] * self.max_slots

    reset_cache = allocate_cache

    def drop_graphs(self) -> None:
        pass

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.caches[dst], self.caches[src] = self.caches[src], None
        self.routes[dst], self.routes[src] = self.routes[src], None
        self.record[dst], self.record[src] = self.record[src], False

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        import copy

        self.caches[dst] = copy.deepcopy(self.caches[src])
        parts = self.routes[src]   # the prompt's rows, for a ``dst`` that records (set before the share)
        self.routes[dst] = [torch.cat(parts)[:length]] if parts and self.record[dst] else None

    def release_slot(self, slot: int) -> None:
        self.caches[slot] = None
        self.routes[slot] = None
        self.record[slot] = False

    KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

    def _new_cache(self, cache_cls):
        """An empty cache for one sequence. A model whose config.json names layers other than (windowed) attention
        gets the cache built from its config, as transformers' ``generate`` builds it: DeepSeek sparse attention's
        "indexed_attention" (DeepSeek-V3.2, GLM-5: the indexer's keys), the recurrent "linear_attention" / "conv"
        / "hybrid" layers (Nemotron-H's Mamba-2, Qwen3-Next / Qwen3.5's gated DeltaNet: a conv and a recurrent state
        per layer, which a cache of lazily added key/value layers cannot hold) and the stateless "moe" / "mlp" layers;
        so does DeepSeek-V4 (sliding window plus compressor state per layer type). Each request has its own cache and
        runs alone (batch 1), so a recurrent state never mixes requests."""
        config = getattr(self.model, "config", None)
        text = config.get_text_config(decoder=True) if config is not None else None
        layer_types = set(getattr(text, "layer_types", None) or ())
        own = bool(layer_types - self.KV_LAYER_TYPES) or getattr(text, "model_type", None) in _CONFIG_CACHE or \
            getattr(config, "model_type", None) in _CONFIG_CACHE
        return cache_cls(config=config) if own else cache_cls()

    @torch.no_grad()
    def prefill(self, slot_start: int, seqs: list[list[int]], full_for: list[bool]):
        from transformers import DynamicCache

        def forward(row: int, slot: int, ids: torch.Tensor) -> torch.Tensor:
            logits, self.caches[slot] = self._run(ids, self._new_cache(DynamicCache), slot)
            return logits

        return self._prefill_rows(slot_start, seqs, full_for, forward)

    def _prefill_rows(self, slot_start: int, seqs: list[list[int]], full_for: list[bool],
                      forward: Callable[[int, int, torch.Tensor], torch.Tensor]):
        """Each sequence prefilled on its own (batch 1): ``forward(row, slot, ids)`` runs ``ids`` [1, T] into
        ``slot``'s new cache and returns the logits; the last position's logits of every row (stacked) and all of
        them for the rows ``full_for`` asks (else None)."""
        last, full = [], []
        for i, s in enumerate(seqs):
            ids = torch.tensor([s], dtype=torch.long, device=self.device)
            logits = forward(i, slot_start + i, ids)
            last.append(logits[0, -1].float())
            full.append(logits[0].float() if full_for[i] else None)
        return torch.stack(last), full

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        rows = []
        for i in range(tokens.shape[0]):
            logits, self.caches[i] = self._run(tokens[i: i + 1][None], self.caches[i], i, append=True,
                                               **self._decode_inputs(i, positions))
            rows.append(logits[0, -1].float())
        return torch.stack(rows)

    def _decode_inputs(self, slot: int, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Further model inputs of ``slot``'s decode step (none; a VLM's M-RoPE positions)."""
        return {}
