"""MoE routing replay, both backends: R3 (``--use-rollout-routing-replay``, arxiv 2510.11370) and R2
(``--use-routing-replay``, arxiv 2507.18071), Miles's meanings.

- R3: the engine returned the experts every token was routed to (``Sample.rollout_routed_experts``, SGLang's
  base64 int32 ``[len(tokens) - 1, num_hidden_layers, top-k]``); every forward of the policy (the old log-prob
  pass and the training forwards) routes each token to exactly those experts.
- R2: the old log-prob forward records the policy's own routing; the training forwards replay it.

Either way only the expert *selection* is replayed: the gate weights are computed from the current router's
logits at the replayed experts (softmax over the experts, gathered, renormalised over the k chosen when
``norm_topk_prob``), so the router keeps its gradient, as Miles does. The reference and teacher models (and the
PPO critic) route by themselves. A token without a replayed row (a sample's last token, which no engine forward
saw; padding; dummy micro-batches) keeps its own top-k.

Wiring (``install(trainer)``, called at the end of both trainers' ``__init__``): the policy's routers get a hook (HF
``Qwen3MoeTopKRouter.forward`` on the FSDP backend; megatron-core's ``TopKRouter.router_replay`` on the Megatron
backend, which a family's router overriding ``routing`` asks too and says so with ``replays_routing``:
DeepSeek-V4's, Gemma 4's, Inkling's (its own module, not a TopKRouter); another is refused by name); ``trainer._prepare`` (the start of every ``train`` call)
loads the samples' routing, and ``trainer._policy_forward`` (and on the Megatron backend ``trainer._stage_forward``,
which a pipeline's earlier stages run) sets, for the policy's micro-batch, the per-token replay rows in the order
the router sees the tokens (FSDP: the packed row or the right-padded ``[k, L]`` rows, flattened; Megatron:
``[s, b]``, this CP rank's chunks and, under sequence parallelism, this TP rank's part). Routers are indexed by their
model-wide layer (under pipeline parallelism a stage's modules number its layers from 0). The rows stay set until
the next policy forward, and are set again when a forward's backward starts (a hook on its output), so activation
recompute inside the backward routes the same way, also under a pipeline's 1F1B order (later forwards before this
backward).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from miles.config.base import ConfigError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

_HF_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
_MCORE_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.router$")
OFF, RECORD, REPLAY = "off", "record", "replay"
HF_REPLAY_MODEL_TYPES = frozenset({"qwen3_moe"})   # HF routers whose forward this module replaces (FSDP backend)


def mode(algo) -> str | None:
    """"r3", "r2" or None from the algorithm flags."""
    if getattr(algo, "use_rollout_routing_replay", False):
        return "r3"
    if getattr(algo, "use_routing_replay", False):
        return "r2"
    return None


def _flag(m: str) -> str:
    return "--use-rollout-routing-replay" if m == "r3" else "--use-routing-replay"


# ------------------------------------------------------------------------------------------ preflight
def preflight_check(cfg, hf_config: dict | None) -> None:
    """Both backends' preflight (``miles.run.preflight``): replay needs a MoE ``--hf-checkpoint`` and, for R2,
    the old log-prob pass."""
    m = mode(cfg.algo)
    if m is None:
        return
    if m == "r2" and cfg.algo.use_rollout_logprobs:
        raise ConfigError("--use-routing-replay records the routing of the old log-prob forward, which "
                          "--use-rollout-logprobs skips: drop one of them (or use --use-rollout-routing-replay).")
    if hf_config is None:
        return
    text = hf_config.get("text_config") or hf_config
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0
    model_type = text.get("model_type") or hf_config.get("model_type")
    if not experts or not (text.get("num_experts_per_tok") or text.get("top_k_experts")):    # Gemma 4: top_k_experts
        raise ConfigError(f"{_flag(m)}: --hf-checkpoint's model ({model_type}) has no MoE layers, so "
                          "there is no routing to replay: drop the flag (it is for MoE models such as Qwen3-MoE).")
    if cfg.train.train_backend == "fsdp" and model_type not in HF_REPLAY_MODEL_TYPES:
        raise ConfigError(f"{_flag(m)} with --train-backend fsdp replays Qwen3-MoE routers, not this {model_type!r} "
                          "model's: use --train-backend megatron, or drop the flag.")
    if m == "r3" and cfg.rollout.rollout_engine == "embedded":
        check_embedded_r3(hf_config)


def check_embedded_r3(hf_config: dict | None, why: str = "") -> None:
    """``--use-rollout-routing-replay`` on the embedded engine (named, or what ``--rollout-engine auto`` picks:
    ``miles.run.preflight.check_engine_kind``): it returns the routed experts of the families it records only."""
    from miles.engine.routed_experts import RECORDED_MODEL_TYPES

    if hf_config is None:
        return
    text = hf_config.get("text_config") or hf_config
    model_type = text.get("model_type") or hf_config.get("model_type")
    if model_type not in RECORDED_MODEL_TYPES:
        raise ConfigError(f"--use-rollout-routing-replay: the embedded engine{f' ({why})' if why else ''} returns "
                          f"routed experts for {', '.join(dict.fromkeys(RECORDED_MODEL_TYPES.values()))} models, not this "
                          f"{model_type!r} one: use --rollout-engine sglang, or drop the flag.")


# ------------------------------------------------------------------------------------------ the state
class ReplayState:
    """Per-sample routing of one ``train`` call and the replay rows of the running policy forward."""

    def __init__(self, m: str, num_layers: int, top_k: int, num_experts: int, moe_layers: list[int]):
        self.mode, self.num_layers, self.top_k, self.num_experts = m, num_layers, top_k, num_experts
        self.moe_layers = moe_layers
        self.routes: list[torch.Tensor | None] = []     # per local sample: [len(tokens), layers, k] int64, -1 = none
        self.stage = OFF
        self.current: torch.Tensor | None = None          # [router tokens, layers, k] on the device
        self.layout: torch.Tensor | None = None           # [router tokens] index into the micro-batch's tokens
        self.recorded: dict[int, torch.Tensor] = {}
        self.replayed_forwards = 0                        # (tests) forwards that replayed at least one row

    # ---------------------------------------------------------------- data
    def begin(self, samples: list) -> None:
        self.stage, self.current, self.layout, self.recorded = OFF, None, None, {}
        self.routes = [None] * len(samples)
        if self.mode == "r3":
            self.routes = [self._decode(i, s) for i, s in enumerate(samples)]

    def _decode(self, i: int, s) -> torch.Tensor:
        import base64

        import numpy as np

        where = f"sample {i} (index {s.index})"
        raw = s.rollout_routed_experts
        if raw is None:
            raise ValueError(f"{where} has no rollout_routed_experts: --use-rollout-routing-replay needs the engine's "
                             "routed experts (the rollout asks for them with return_routed_experts; a custom generate "
                             "function must keep meta_info['routed_experts'] in sample.rollout_routed_experts)")
        if isinstance(raw, str):
            flat = np.frombuffer(base64.b64decode(raw.encode("ascii")), dtype=np.int32)
        else:
            flat = np.asarray(raw, dtype=np.int32).reshape(-1)
        per = self.num_layers * self.top_k
        n = len(s.tokens)
        if flat.size % per or flat.size // per > n - 1:
            raise ValueError(f"{where}: rollout_routed_experts holds {flat.size} expert ids, expected "
                             f"(len(tokens) - 1 = {n - 1}) x {self.num_layers} layers x top-k {self.top_k} (the "
                             "engine serves another model, or the sample's tokens changed after generation)")
        rows = torch.from_numpy(flat.astype(np.int64)).view(-1, self.num_layers, self.top_k)
        bad = rows[:, self.moe_layers]
        if bad.numel() and (int(bad.min()) < 0 or int(bad.max()) >= self.num_experts):
            raise ValueError(f"{where}: rollout_routed_experts names expert ids outside 0..{self.num_experts - 1}")
        out = torch.full((n, self.num_layers, self.top_k), -1, dtype=torch.int64)
        out[: rows.shape[0]] = rows
        return out

    # ---------------------------------------------------------------- one forward
    def start_forward(self, stage: str, sample_ids: list[int], lengths: list[int], layout: torch.Tensor) -> None:
        """``layout`` [router tokens]: each token's index into the concatenated tokens of ``sample_ids`` (-1: none)."""
        self.stage, self.layout, self.recorded = stage, layout, {}
        self.current = None
        if stage != REPLAY:
            return
        parts = [self.routes[i] if self.routes[i] is not None
                 else torch.full((n, self.num_layers, self.top_k), -1, dtype=torch.int64)
                 for i, n in zip(sample_ids, lengths)]
        if all(self.routes[i] is None for i in sample_ids):
            self.stage = OFF
            return
        full = torch.cat(parts).to(layout.device)
        cur = full.index_select(0, layout.clamp(min=0))
        cur[layout < 0] = -1
        self.current = cur
        self.replayed_forwards += 1

    def finish_record(self, sample_ids: list[int], lengths: list[int]) -> None:
        """R2: the recorded per-layer top-k back into the samples' rows."""
        if self.stage != RECORD or self.layout is None:
            return
        total = sum(lengths)
        full = torch.full((total, self.num_layers, self.top_k), -1, dtype=torch.int64)
        valid = (self.layout >= 0).cpu()
        pos = self.layout.cpu()[valid]
        for layer, idx in self.recorded.items():
            full[pos, layer] = idx.cpu().to(torch.int64)[valid]
        for sid, piece in zip(sample_ids, full.split(lengths)):
            self.routes[sid] = piece
        self.recorded, self.stage = {}, OFF

    # ---------------------------------------------------------------- the router's choice
    def select(self, layer: int, scores: torch.Tensor, own: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The top-k expert indices [T, k] this layer uses for ``scores`` [T, E]; ``own()`` its own top-k."""
        if self.stage == RECORD:
            idx = own()
            self.recorded[layer] = idx.detach()
            return idx
        if self.stage != REPLAY or self.current is None:
            return own()
        rep = self.current[:, layer]
        if rep.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay: layer {layer} routes {scores.shape[0]} tokens but the replay "
                               f"layout has {rep.shape[0]} (a token layout this module does not know)")
        missing = (rep < 0).any(-1, keepdim=True)
        if bool(missing.any()):
            rep = torch.where(missing, own().to(rep.dtype), rep)
        return rep


# ------------------------------------------------------------------------------------------ the router hooks
def _hf_router_forward(self, hidden_states):
    """``Qwen3MoeTopKRouter.forward`` with the expert choice from the replay state (same outputs otherwise)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    idx = self._miles_replay.select(self._miles_layer, probs, lambda: torch.topk(probs, self.top_k, dim=-1).indices)
    top = probs.gather(1, idx)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), idx


class _McoreLayerReplay:
    """What megatron-core's ``TopKRouter.router_replay`` is called as (``get_replay_topk``)."""

    def __init__(self, state: ReplayState, layer: int):
        self.state, self.layer = state, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own: dict[str, Any] = {}

        def compute():
            if "r" not in own:
                own["r"] = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            return own["r"][1]
        idx = self.state.select(self.layer, scores, compute)
        if "r" in own and idx is own["r"][1]:
            return own["r"]
        return scores.gather(1, idx), idx


def _router_layers(model: torch.nn.Module, megatron: bool) -> list[tuple[str, int, torch.nn.Module]]:
    """(name, model-wide layer index, router) of every MoE router: under pipeline parallelism a stage's layers are
    numbered from 0 in its module names, so the index is the one megatron-core gave the layer (``layer_number - 1``,
    ``pipeline.global_name``), which the replayed rows are indexed by."""
    out = []
    pattern = _MCORE_ROUTER if megatron else _HF_ROUTER
    for name, mod in model.named_modules():
        if pattern.search(name) is None:
            continue
        if megatron:
            from miles.trainer.megatron.pipeline import global_name

            name = global_name(model, name + ".x")[:-2]
        out.append((name, int(pattern.search(name).group(1)), mod))
    return out


def _replays(router: torch.nn.Module) -> bool:
    """Whether a megatron-core router's ``routing`` asks ``router_replay``: megatron-core's own does; a family's
    router that overrides it says so with ``replays_routing = True`` (DeepSeek-V4's, Gemma 4's)."""
    from megatron.core.transformer.moe.router import TopKRouter

    own = getattr(type(router), "routing", None)
    return own is getattr(TopKRouter, "routing", None) or bool(getattr(router, "replays_routing", False))


def _hook_routers(model: torch.nn.Module, state: ReplayState, megatron: bool) -> int:
    n = 0
    for name, layer, mod in _router_layers(model, megatron):
        if megatron:
            if getattr(mod.config, "moe_router_fusion", False):
                raise ConfigError("routing replay with --moe-router-fusion: the fused router takes no replayed "
                                  "experts; drop --moe-router-fusion.")
            if not _replays(mod):
                raise ConfigError(f"{_flag(state.mode)}: {type(mod).__name__} ({name}) chooses its experts without "
                                  "megatron-core's router_replay, so its routing cannot be replayed: drop the flag.")
            mod.router_replay = _McoreLayerReplay(state, layer)
        else:
            if not all(hasattr(mod, a) for a in ("top_k", "weight", "norm_topk_prob", "hidden_dim")):
                raise ConfigError(f"routing replay: {type(mod).__name__} ({name}) is not a top-k softmax router this "
                                  "trainer can replay (Qwen3-MoE's); drop the routing-replay flag for this model.")
            mod._miles_replay, mod._miles_layer = state, layer
            mod.forward = types.MethodType(_hf_router_forward, mod)
        n += 1
    return n


# ------------------------------------------------------------------------------------------ token layouts
def _layout_fsdp(trainer, model, mb) -> torch.Tensor:
    from miles.trainer.batching import padded_rows

    dev = mb.input_ids.device
    total = int(mb.input_ids.shape[1])
    if getattr(trainer, "_images", None) is not None or trainer._as_rows(model, mb):
        probe = _with_ids(mb, torch.arange(total, device=dev).unsqueeze(0))
        ids, _, _ = padded_rows(probe, -1)
        return ids.reshape(-1)
    return torch.arange(total, device=dev)


def _layout_megatron(trainer, mb) -> torch.Tensor:
    from miles.trainer.megatron import context_parallel
    from miles.trainer.megatron.forward import padded_batch, row_multiple

    g = trainer.groups
    cp, sp = g.cp_size, trainer._sequence_parallel
    total = int(mb.input_ids.shape[1])
    probe = _with_ids(mb, torch.arange(total, device=mb.input_ids.device).unsqueeze(0))
    ids, pos, index = padded_batch(probe, -1, row_multiple(trainer))
    if cp > 1:
        ids = context_parallel.shard_rows(ids, pos, index, g.cp_rank, cp).input_ids
    seq = ids.t()                                                      # [s, b]: the router's token order
    if sp:
        s_loc = seq.shape[0] // g.tp_size
        seq = seq[g.tp_rank * s_loc:(g.tp_rank + 1) * s_loc]
    return seq.reshape(-1)


def _restore_on_backward(state: ReplayState, out) -> None:
    """The replay rows of this forward set again when its backward starts (a hook on its first output that needs a
    gradient): a pipeline's 1F1B schedule runs later micro-batches' forwards before this one's backward, and
    activation recompute inside the backward must route as the forward did."""
    first = out[0] if isinstance(out, tuple) else out
    if state.stage == RECORD or not isinstance(first, torch.Tensor) or not first.requires_grad:
        return
    saved = (state.stage, state.current, state.layout)

    def restore(grad):
        state.stage, state.current, state.layout = saved
        return grad

    first.register_hook(restore)


def _with_ids(mb, ids: torch.Tensor):
    import dataclasses

    return dataclasses.replace(mb, input_ids=ids)


# ------------------------------------------------------------------------------------------ installation
def install(trainer) -> ReplayState | None:
    """Hook the policy's routers and wrap ``trainer._prepare`` / ``trainer._policy_forward`` (module docstring).
    None (nothing changed) without a routing-replay flag."""
    m = mode(trainer.algo)
    if m is None:
        return None
    megatron = trainer.backend == "megatron"
    if megatron:
        shape = trainer.shape
        num_layers, top_k, experts = int(shape.num_layers), int(shape.moe_router_topk or 0), int(shape.num_experts or 0)
        pattern = getattr(shape, "moe_layer_pattern", None)
    else:
        c = trainer.model.lm.config
        c = getattr(c, "text_config", None) or c
        if getattr(c, "model_type", None) not in HF_REPLAY_MODEL_TYPES:
            raise ConfigError(f"{_flag(m)} with --train-backend fsdp replays Qwen3-MoE routers, not this "
                              f"{getattr(c, 'model_type', None)!r} model's: use --train-backend megatron, or drop it.")
        num_layers, top_k = int(c.num_hidden_layers), int(getattr(c, "num_experts_per_tok", 0) or 0)
        experts, pattern = int(getattr(c, "num_experts", 0) or getattr(c, "num_local_experts", 0) or 0), None
    if not experts or not top_k:
        raise ConfigError(f"{_flag(m)}: the model has no MoE layers, so there is no routing to replay: drop the flag.")
    state = ReplayState(m, num_layers, top_k, experts, [])
    n = _hook_routers(trainer.model, state, megatron)
    if n == 0:
        raise ConfigError(f"{_flag(m)}: no MoE router found in the policy model: drop the flag for this model.")
    layers = sorted({layer for _, layer, _ in _router_layers(trainer.model, megatron)})
    state.moe_layers = list(pattern and [i for i, v in enumerate(pattern) if v] or layers)
    trainer.routing_replay = state
    prepare = trainer._prepare

    def _prepare(samples, data, policy):
        state.begin(samples)
        return prepare(samples, data, policy)

    def replaying(forward):
        """``forward`` (the policy's forward of one micro-batch) with the replay rows of that micro-batch set."""
        def wrapped(model, mb, *args, **kw):
            if model is not trainer.model:
                return forward(model, mb, *args, **kw)
            if mb.is_dummy:
                state.stage, state.current = OFF, None
                out = forward(model, mb, *args, **kw)
                _restore_on_backward(state, out)
                return out
            stage = REPLAY if (m == "r3" or model.training) else RECORD
            layout = _layout_megatron(trainer, mb) if megatron else _layout_fsdp(trainer, model, mb)
            lengths = [int(x) for x in (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()]
            state.start_forward(stage, mb.sample_ids, lengths, layout)
            out = forward(model, mb, *args, **kw)
            _restore_on_backward(state, out)
            state.finish_record(mb.sample_ids, lengths)
            return out
        return wrapped

    trainer._policy_forward = replaying(trainer._policy_forward)
    if megatron:      # a pipeline's earlier stages run the policy through _stage_forward (pipeline.py)
        trainer._stage_forward = replaying(trainer._stage_forward)
    trainer._prepare = _prepare
    logger.info("routing replay (%s, %s): %d MoE routers of the policy replay %s", m.upper(), _flag(m), n,
                "the rollout's routing" if m == "r3" else "the old log-prob pass's routing")
    return state
