"""LoRA (``--lora-rank R``): trainable low-rank adapters on frozen linears, our own implementation.

    spec = LoraSpec.from_config(cfg.train)                  # None when --lora-rank is 0
    lora = attach(model, spec, tp_rank=r, tp_size=tp, tp_group=g, seed=seed)   # base frozen, hooks on
    optimizer = build_adamw(lora, ...)                      # the adapters are the only trained parameters
    with merged(lora): export(model)                        # W + (alpha / r) * B @ A, restored after

A target linear ``y = W x`` becomes ``y = W x + (alpha / r) * B (A dropout(x))`` with ``A`` [r, in] and
``B`` [out, r]; ``B`` starts at zero (the model is the base model at step 0) and ``A`` Kaiming-uniform, drawn
from a generator seeded by the trainer seed and the module's name (the same on every rank). The adapters
live in their own module (``LoraAdapters``), not in the model: the model's parameters, names, converter,
export and checkpoint code are unchanged, and a forward hook on each target adds its delta.

Megatron tensor parallelism follows the base weight's split:

- column-parallel (``linear_qkv``, ``linear_fc1``; W [out/tp, in]): ``A`` replicated, ``B`` split on rows
  like W; ``A x`` passes megatron-core's copy-to-TP region, so its gradient is summed over TP (every rank
  then holds the same ``A`` gradient).
- row-parallel (``linear_proj``, ``linear_fc2``; W [out, in/tp], input split): ``A`` split on columns like
  W, ``B`` replicated; ``A x`` is a TP-partial sum, reduced over TP before ``B``.

- replicated (multi-latent attention's down projections ``linear_q_down_proj`` / ``linear_kv_down_proj``, whole on
  every TP rank): ``A`` and ``B`` whole.

So ``B @ A`` has W's local shape on every rank and ``merged`` adds it to the local shard: the export
gathers and converts merged weights exactly as it does base weights (HF names; the engines need no LoRA).

Under sequence parallelism (``--sequence-parallel``, each TP rank holding a slice of the sequence where megatron-core
does, the module's own ``sequence_parallel``): a column-parallel target's input is this rank's slice, so ``A x`` is
gathered from the sequence-parallel region (backward: reduce-scattered); a row-parallel target's ``A x`` is
reduce-scattered to this rank's slice before ``B``; a replicated target sees this rank's slice only. The factors
every TP rank holds whole (column's ``A``, row's ``B``, replicated's both) then have a gradient from this rank's part
of the sequence: ``finish_grads`` sums them over TP first, as megatron-core sums its sequence-parallel norms.

Target names (``--target-modules``, Miles's): ``all-linear`` or a comma list of HF names (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; multi-latent attention's ``q_a_proj``,
``kv_a_proj_with_mqa``, ``q_b_proj``, ``kv_b_proj``) or Megatron names (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``, ``linear_q_proj``, ``linear_q_down_proj``, ``linear_kv_down_proj``,
``linear_q_up_proj``, ``linear_kv_up_proj``; ``miles.config.lora``). Megatron fuses q/k/v and gate/up, so,
as in Miles's standard ``--lora-type lora``, any of q/k/v selects the fused ``linear_qkv`` (one ``A``, a
``B`` whose rows are q, k and v) and gate/up select ``linear_fc1``; a name selects the modules of that leaf name the
model has (as Megatron-Bridge's LoRA, which Miles uses), the ones that select nothing are logged.

MoE experts (Miles's semantics, radixark/miles@v0.1.0:miles/backends/megatron_utils/lora_utils.py and its
``--experts-shared-outer-loras`` help in radixark/miles@v0.1.0:miles/utils/arguments.py; Megatron-Bridge's ``LoRA`` matches a target by
the module's leaf name): the expert names are the dense ones, so ``gate_proj`` / ``up_proj`` / ``linear_fc1``
select the dense MLPs' ``linear_fc1``, the shared experts' and every routed expert's (``mlp.experts.
local_experts.E.linear_fc1``, HF ``mlp.experts.E.{gate,up}_proj``), and ``down_proj`` / ``linear_fc2`` the
``linear_fc2`` of each. Two layouts of the routed experts' adapters:

- per-expert (the default): each expert ``E`` has its own ``A_E`` and ``B_E`` on ``linear_fc1`` and on
  ``linear_fc2``; ``delta W_E = (alpha / r) B_E @ A_E``.
- ``--experts-shared-outer-loras`` (SGLang's ``experts_shared_outer_loras=True`` serving contract, Miles's
  "gate_up lora_A and down lora_B shared across experts, expert_dim=1"): the *outer* factors, those on the
  hidden-size side, are one tensor per layer shared by all its experts: ``linear_fc1``'s ``A`` [r, hidden]
  (``delta W1_E = (alpha / r) B1_E @ A1``) and ``linear_fc2``'s ``B`` [hidden, r] (``delta W2_E = (alpha / r)
  B2 @ A2_E``); the inner ones (``B1_E`` [2 ffn, r], ``A2_E`` [r, ffn]) stay per expert.

Expert parallelism: EP rank ``p`` holds the adapters of its local experts (seeded by the *global* expert's
name, so EP 1 and EP 2 draw the same ``A``); their gradients are reduced as the experts' weights are (summed over
the expert-data-parallel group, divided by the DP size: ``moe.reduce_expert_grads``). A shared outer factor is
replicated on every EP rank and each rank's copy sees only its own experts' tokens, so its gradient is first summed
over the EP group (Miles's ``_lora_grad_sum_group = "ep"``) and then reduced as an expert's. The merged export
gathers the merged experts over EP as the base export does, so the engines still receive plain merged weights.

Pipeline parallelism (``--pipeline-model-parallel-size``): each stage attaches adapters to the layers it holds,
named, selected and seeded by the layer's model-wide index (``pipeline.global_name``: ``decoder.layers.<global
i>``), so every PP size draws the same adapters. The gradients are reduced per stage (over the stage's TP / EP / DP
groups, as above); the gradient norm and the trainable count are summed over the pipeline group. ``merged`` merges
this stage's targets, and the pipeline export (``export._iter_pipeline``) broadcasts each stage's merged weights
under their global names, so the engines receive the whole merged model. ``full_pairs`` (and the PEFT adapter)
gathers the stages' adapters over the pipeline group; ``--save`` writes each rank's adapters (its stage's), and a
checkpoint resumes at the same pipeline size only.

Context parallelism (``--context-parallel-size``): a target linear maps each token on its own, so the hooks need
nothing; each CP rank's adapter gradients are its sequence chunks', summed over DP x CP as the base weights' are
(``finish_grads``; a routed expert's over the expert-DP group, which spans the CP ranks).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miles.config.base import ConfigError
from miles.config.lora import FAMILY_TARGETS, MEGATRON_KIND, path_matches, resolve, resolve_targets  # noqa: F401
from miles.utils.logging import get_logger

logger = get_logger("miles.trainer.lora")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]        # Megatron module leaf names, sorted
    experts_shared_outer: bool = False   # --experts-shared-outer-loras: fc1's A, fc2's B shared by a layer's experts
    paths: tuple[str, ...] = ()          # Megatron-Bridge module paths (wildcards), matched against the full name
    exclude_paths: tuple[str, ...] = ()  # --exclude-modules paths

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def names(self) -> tuple[str, ...]:
        """Every leaf name a target can have: the leaf targets and each path's last part."""
        return tuple(sorted(set(self.targets) | {p.rsplit(".", 1)[-1] for p in self.paths}))

    def selects(self, name: str, prefix: str = "") -> bool:
        """Whether the module ``name`` (ours) is a target: its leaf name is one, or a path matches one of its
        Megatron-Bridge names (``bridge_names``), and no excluded path does."""
        bridge = bridge_names(name, prefix)
        if any(path_matches(p, b) for p in self.exclude_paths for b in bridge):
            return False
        return _leaf(name) in self.targets or any(path_matches(p, b) for p in self.paths for b in bridge)

    @classmethod
    def from_config(cls, train) -> LoraSpec | None:
        """The LoRA of a ``TrainConfig`` (None when ``--lora-rank`` is 0); refuses what it cannot train."""
        rank = int(getattr(train, "lora_rank", 0) or 0)
        if rank <= 0:
            return None
        t = resolve(train.target_modules, getattr(train, "exclude_modules", None))
        return cls(rank=rank, alpha=float(train.lora_alpha), dropout=float(train.lora_dropout), targets=t.leaves,
                   experts_shared_outer=bool(getattr(train, "experts_shared_outer_loras", False)), paths=t.paths,
                   exclude_paths=t.exclude_paths)


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.\d+\.(linear_fc[12])$")


def bridge_names(name: str, prefix: str = "") -> list[str]:
    """The names Megatron-Bridge's model gives module ``name`` of ours, which ``--target-modules`` paths match:
    ``prefix`` + the name (``Family.lora_path_prefix``: e.g. ``language_model.`` where Megatron-Bridge holds a
    multimodal checkpoint's text model), and for a routed expert's linear (``...mlp.experts.local_experts.E.
    linear_fc1``, megatron-core's SequentialMLP) also the grouped experts' module (``...mlp.experts.linear_fc1``, what
    Miles's recipes, run with --moe-grouped-gemm, name)."""
    out = [prefix + name]
    m = _LOCAL_EXPERT.match(name)
    if m is not None:
        out.append(f"{prefix}{m.group(1)}.{m.group(2)}")
    return out


class LoraPair(nn.Module):
    """``A`` [r, in_local] and ``B`` [out_local, r] of one target (module docstring for the TP split). ``kind``:
    ``column`` / ``row`` (dense, TP-split as the base weight), ``expert`` (a routed expert: whole, EP-local).
    A factor passed as an ``nn.Parameter`` is shared (``--experts-shared-outer-loras``), not copied."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, kind: str, sequence_parallel: bool = False):
        super().__init__()
        self.lora_A = a if isinstance(a, nn.Parameter) else nn.Parameter(a)
        self.lora_B = b if isinstance(b, nn.Parameter) else nn.Parameter(b)
        self.kind = kind
        self.sequence_parallel = sequence_parallel     # the target's input / output is this TP rank's sequence slice
        # under TP the sharded one: B of a column-parallel target, A of a row-parallel one (None: replicated)
        self.sharded = {"column": self.lora_B, "row": self.lora_A}.get(kind)

    def whole(self) -> list[nn.Parameter]:
        """The factors every TP rank holds whole (a dense target's)."""
        return {"column": [self.lora_A], "row": [self.lora_B], "replicated": [self.lora_A, self.lora_B]}[self.kind]


class LoraAdapters(nn.Module):
    """Every target's ``LoraPair`` (keys: the module name with '.' as '/'), plus what the hooks need."""

    def __init__(self, spec: LoraSpec, tp_size: int, tp_group: dist.ProcessGroup | None, ep_size: int = 1,
                 ep_group: dist.ProcessGroup | None = None, ep_rank: int = 0, pp_size: int = 1,
                 pp_group: dist.ProcessGroup | None = None, timeout: float = 600.0):
        super().__init__()
        self.spec, self.tp_size, self.tp_group = spec, tp_size, tp_group
        self.ep_size, self.ep_group, self.ep_rank = ep_size, ep_group, ep_rank
        self.pp_size, self.pp_group, self.timeout = pp_size, pp_group, timeout
        self.device = torch.device("cpu")              # the base weights' (set by attach)
        self.stage_names: dict[str, str] = {}          # every target: local name -> its name with the global layer index
        self.all_targets: tuple[str, ...] = ()         # the targets of every pipeline stage (global layer names)
        self.pairs = nn.ModuleDict()
        self.shared = nn.ParameterDict()               # --experts-shared-outer-loras: one outer factor per layer
        self.targets: dict[str, nn.Module] = {}        # name -> the base module (not registered here)
        self.global_names: dict[str, str] = {}         # routed experts: local name -> EP-free (global) name
        self.num_local = 0                             # routed experts per MoE layer on this EP rank

    def named_pairs(self) -> Iterator[tuple[str, LoraPair]]:
        for key, pair in self.pairs.items():
            yield key.replace("/", "."), pair

    def delta(self, name: str) -> torch.Tensor:
        """(alpha / r) * B @ A of target ``name``, W's local shape."""
        pair = self.pairs[name.replace(".", "/")]
        return (pair.lora_B.float() @ pair.lora_A.float()) * self.spec.scale

    def sharded_params(self) -> list[nn.Parameter]:
        """The TP-sharded factors of the dense targets."""
        return [p.sharded for _, p in self.named_pairs() if p.sharded is not None and p.kind != "expert"]

    def replicated_params(self) -> list[nn.Parameter]:
        """The factors every TP rank holds whole: the dense targets' other factor (a replicated target's both), and
        the shared outer ones."""
        return [t for _, p in self.named_pairs() if p.kind != "expert" for t in p.whole()] + list(self.shared.values())

    def tp_partial_params(self) -> list[nn.Parameter]:
        """The whole factors of the targets under sequence parallelism: each TP rank's gradient is its part of the
        sequence's (summed over TP by ``finish_grads``)."""
        return [t for _, p in self.named_pairs() if p.kind != "expert" and p.sequence_parallel for t in p.whole()]

    def expert_params(self) -> list[nn.Parameter]:
        """The routed experts' own factors (EP-local; gradients reduced as the experts' weights)."""
        shared = {id(p) for p in self.shared.values()}
        return [t for _, p in self.named_pairs() if p.kind == "expert" for t in (p.lora_A, p.lora_B)
                if id(t) not in shared]


def _seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def _init_a(rank: int, in_full: int, seed: int, name: str) -> torch.Tensor:
    """Kaiming-uniform ``A`` [r, in] (a = sqrt(5), as torch's Linear) from a generator of (seed, name)."""
    g = torch.Generator().manual_seed(_seed(seed, name))
    bound = 1.0 / math.sqrt(in_full)
    return (torch.rand(rank, in_full, generator=g, dtype=torch.float32) * 2 - 1) * bound


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def attach(model: nn.Module, spec: LoraSpec, *, tp_rank: int = 0, tp_size: int = 1,
           tp_group: dist.ProcessGroup | None = None, seed: int = 0, ep_rank: int = 0, ep_size: int = 1,
           ep_group: dist.ProcessGroup | None = None, num_experts: int = 0,
           inputs_require_grad: bool = False, path_prefix: str = "",
           family_targets: tuple[str, ...] = (), pp_size: int = 1, pp_group: dist.ProcessGroup | None = None,
           timeout: float = 600.0) -> LoraAdapters:
    """Freeze every parameter of ``model`` and hook a LoRA pair onto each target linear (Megatron leaf names,
    modules holding ``weight``; routed experts included, ``num_experts`` of them over ``ep_size`` EP ranks);
    returns the adapters (on the base weights' device, fp32). ``inputs_require_grad`` (``--recompute-granularity
    full``): the embedding's output requires grad, as PEFT's ``enable_input_require_grads`` makes it; megatron-core's
    full recompute checkpoints each layer with a reentrant autograd function, which gives its output a gradient
    only when an input has one, and with the base frozen none has: the adapters inside would get no gradient.
    ``path_prefix``: what Megatron-Bridge's model puts before the module names that ``--target-modules`` paths match
    (``Family.lora_path_prefix``); ``family_targets``: the ``FAMILY_TARGETS`` leaf names the model's family builds as
    targets (``Family.lora_targets``; another module of such a name that a target selects is refused). The
    multi-token-prediction block (``mtp.*``) is never adapted: it is carried frozen (``--mtp-num-layers`` without
    ``--enable-mtp-training``), as Miles's recipes leave it. ``pp_size`` > 1: ``model`` is one pipeline stage (module
    docstring); collective on ``pp_group`` (the stages' target names gathered, bounded by ``timeout``)."""
    from miles.trainer.megatron.moe import global_name, is_expert
    from miles.trainer.megatron.pipeline import global_name as stage_global_name

    lora = LoraAdapters(spec, tp_size, tp_group, ep_size, ep_group, ep_rank, pp_size, pp_group, timeout)
    lora.num_local = num_local = num_experts // ep_size if num_experts else 0
    lora.device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for p in model.parameters():
        p.requires_grad_(False)
    matched: set[str] = set()
    paths_hit: set[str] = set()
    for local, module in model.named_modules():
        leaf = _leaf(local)
        name = stage_global_name(model, local) if pp_size > 1 else local    # the layer's model-wide index
        if name.startswith("mtp.") or leaf not in MEGATRON_KIND or not spec.selects(name, path_prefix):
            continue
        if leaf in FAMILY_TARGETS and leaf not in family_targets:
            raise ConfigError(f"--target-modules selects {name}, whose family builds no {leaf} LoRA target "
                              f"(Family.lora_targets); drop {leaf} from --target-modules.")
        matched.add(leaf)
        paths_hit.update(p for p in spec.paths if any(path_matches(p, b) for b in bridge_names(name, path_prefix)))
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            if hasattr(module, "num_gemms"):          # transformer-engine's grouped expert linear
                raise ConfigError(f"--target-modules {leaf} on MoE experts with --moe-grouped-gemm is not supported "
                                  "by the Megatron backend's LoRA; drop --moe-grouped-gemm (the experts then run as "
                                  "SequentialMLP, the same math) or the expert targets.")
            continue
        w = module.weight
        out_local, in_local = w.shape
        if is_expert(name + ".weight"):
            gname = global_name(name + ".weight", ep_rank, num_local).removesuffix(".weight")
            pair = _expert_pair(lora, spec, leaf, gname, local, name, out_local, in_local, seed, w.device)
            lora.global_names[local] = gname
        else:
            kind = MEGATRON_KIND[leaf]
            split = tp_size > 1
            in_full = in_local * tp_size if (split and kind == "row") else in_local
            a = _init_a(spec.rank, in_full, seed, name)
            if split and kind == "row":
                a = a.chunk(tp_size, dim=1)[tp_rank].clone()
            b = torch.zeros(out_local, spec.rank, dtype=torch.float32)
            sp = split and bool(getattr(module, "sequence_parallel", False) or getattr(w, "sequence_parallel", False))
            pair = LoraPair(a.to(w.device), b.to(w.device), kind, sequence_parallel=sp)
        lora.pairs[local.replace(".", "/")] = pair
        lora.targets[local] = module
        lora.stage_names[local] = name
        module.register_forward_hook(_hook(lora, pair))
    lora.all_targets = tuple(sorted(lora.stage_names.values()))
    if pp_size > 1:            # a stage may hold no target (--target-modules paths of some layers): the model must
        from miles.trainer.collectives import bounded_all_gather_object

        parts = bounded_all_gather_object(lora.all_targets, pp_group, timeout, lora.device,
                                          "gathering the pipeline stages' LoRA targets")
        lora.all_targets = tuple(sorted({n for part in parts for n in part}))
    if not lora.all_targets:
        raise ConfigError(f"--target-modules: no module of the model matches {list(spec.targets) + list(spec.paths)}"
                          + (f" (module paths are matched against Megatron-Bridge's names: {path_prefix}decoder.layers."
                             "N....)" if spec.paths else "") + ".")
    embedding = getattr(model, "embedding", None)
    if inputs_require_grad and embedding is not None:
        embedding.register_forward_hook(_require_grad)
    unmatched = sorted(set(spec.targets) - matched - ({"linear_qkv", "linear_q_proj"} if {"linear_qkv", "linear_q_proj"}
                                                       & matched else set()))
    if unmatched:        # e.g. q/k/v's fused linear_qkv on a multi-latent-attention model, which has none
        logger.info("--target-modules: this model has no module named %s: those names select nothing here (LoRA on "
                    "%s)", ", ".join(unmatched), ", ".join(sorted(matched)))
    if set(spec.paths) - paths_hit:
        logger.info("--target-modules: the module path(s) %s match no module of this model (its names as "
                    "Megatron-Bridge gives them: %sdecoder.layers.N....)", ", ".join(sorted(set(spec.paths) - paths_hit)),
                    path_prefix)
    return lora


def _require_grad(_module: nn.Module, _args, output):
    """A forward hook: the output (a tensor without a graph: the frozen embedding's) requires grad."""
    if isinstance(output, torch.Tensor) and not output.requires_grad and torch.is_grad_enabled():
        output.requires_grad_(True)
    return output


def _expert_pair(lora: LoraAdapters, spec: LoraSpec, leaf: str, gname: str, local: str, name: str, out_f: int,
                 in_f: int, seed: int, device: torch.device) -> LoraPair:
    """A routed expert's pair (whole: expert TP 1); with ``--experts-shared-outer-loras`` its outer factor is the
    layer's shared one (created by the layer's first expert; seeded by the layer's global name, so every EP rank,
    EP size and PP size draw the same). ``local``: the module's name in this stage, ``name``: with the global layer
    index."""
    a = _init_a(spec.rank, in_f, seed, gname).to(device)
    b = torch.zeros(out_f, spec.rank, dtype=torch.float32, device=device)
    if spec.experts_shared_outer:
        layer = name[:name.index(".local_experts.")] + "." + leaf          # ...mlp.experts.linear_fc1
        key = (local[:local.index(".local_experts.")] + "." + leaf).replace(".", "/")
        if key not in lora.shared:
            lora.shared[key] = nn.Parameter(_init_a(spec.rank, in_f, seed, layer).to(device) if leaf == "linear_fc1"
                                            else b.clone())
        if leaf == "linear_fc1":
            a = lora.shared[key]
        else:
            b = lora.shared[key]
    return LoraPair(a, b, "expert")


def _hook(lora: LoraAdapters, pair: LoraPair):
    spec = lora.spec
    if lora.tp_size > 1:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

    def hook(module: nn.Module, args, output):
        x = args[0]
        norm = getattr(module, "layer_norm_weight", None)     # transformer-engine: the norm is inside the linear
        if norm is not None:
            x = nn.functional.rms_norm(x, (x.shape[-1],), norm.to(x.dtype), eps=module.config.layernorm_epsilon)
        if spec.dropout > 0 and module.training:
            x = nn.functional.dropout(x, p=spec.dropout)
        a, b = pair.lora_A.to(x.dtype), pair.lora_B.to(x.dtype)
        h = nn.functional.linear(x, a)
        if lora.tp_size > 1 and pair.kind == "column":        # h: this rank's sequence slice under SP, else whole
            h = (gather_from_sequence_parallel_region(h, group=lora.tp_group) if pair.sequence_parallel
                 else copy_to_tensor_model_parallel_region(h, group=lora.tp_group))
        elif lora.tp_size > 1 and pair.kind == "row":         # h: a TP-partial sum over this rank's inputs
            h = (reduce_scatter_to_sequence_parallel_region(h, group=lora.tp_group) if pair.sequence_parallel
                 else reduce_from_tensor_model_parallel_region(h, group=lora.tp_group))
        d = nn.functional.linear(h, b) * spec.scale
        if isinstance(output, tuple):            # megatron-core linears: (output, bias)
            return (output[0] + d.to(output[0].dtype),) + tuple(output[1:])
        return output + d.to(output.dtype)

    return hook


@contextmanager
def merged(lora: LoraAdapters | None):
    """Inside: each target's weight is ``W + (alpha / r) * B @ A`` (a new tensor; W itself is untouched and
    back on exit). None: nothing to merge."""
    if lora is None:
        yield
        return
    saved = []
    with torch.no_grad():
        for name, module in lora.targets.items():
            w = module.weight
            saved.append((w, w.data))
            w.data = (w.data.float() + lora.delta(name).to(w.device)).to(w.dtype)
    try:
        yield
    finally:
        for w, data in saved:
            w.data = data


@torch.no_grad()
def finish_grads(lora: LoraAdapters, groups) -> None:
    """Reduce the adapters' gradients (``groups``: the Megatron backend's ``parallel.Groups``): the dense targets'
    averaged over DP (under context parallelism summed over DP x CP first, each CP rank's gradient being its
    sequence chunks', as ``parallel.finish_grads`` reduces the base weights; TP needs nothing without sequence parallelism: the hooks' regions already leave every rank with
    its complete gradient; under it the whole factors' TP-partial gradients are summed over TP first);
    the shared outer factors summed over EP first; then the routed experts' factors, shared ones included, as the
    experts' weights (``moe.reduce_expert_grads``: summed over the expert-DP group, divided by the DP size; plain
    DP averaging at EP 1 and TP 1). A missing gradient becomes zero first."""
    from miles.trainer.megatron.moe import edp_reduced, reduce_expert_grads

    for p in lora.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    partial = lora.tp_partial_params()
    if partial and lora.tp_size > 1:        # sequence parallelism: each TP rank's part of the sequence
        _all_reduce([p.grad for p in partial], lora.tp_group)
    shared = list(lora.shared.values())
    if shared and lora.ep_size > 1:
        _all_reduce([p.grad for p in shared], lora.ep_group)
    experts = [(f"x.mlp.experts.{i}", p) for i, p in enumerate(lora.expert_params() + shared)]
    reduced = {id(p) for n, p in experts if edp_reduced(n, groups)}
    reduce_expert_grads(experts, groups)
    dense = [p for p in lora.parameters() if id(p) not in reduced]
    cp_size = getattr(groups, "cp_size", 1)
    if cp_size > 1 and dense:       # CP ranks hold partial sums (their chunks): sum over DP x CP, average over DP
        _all_reduce([p.grad for p in dense], groups.dp_cp)
        if groups.dp_size > 1:
            torch._foreach_div_([p.grad for p in dense], float(groups.dp_size))
    elif groups.dp_size > 1 and dense:
        _all_reduce([p.grad for p in dense], groups.dp)
        torch._foreach_div_([p.grad for p in dense], float(groups.dp_size))


def _all_reduce(tensors: list[torch.Tensor], group) -> None:
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))


@torch.no_grad()
def clip_grad_norm(lora: LoraAdapters, max_norm: float) -> float:
    """The L2 norm of the full adapters' gradients (TP shards summed, routed experts' factors summed over EP,
    replicated ones counted once, every pipeline stage's summed); scaled to ``max_norm`` when positive."""
    def sq(ps: list[nn.Parameter]) -> torch.Tensor:
        gs = [p.grad.float() for p in ps if p.grad is not None]
        return sum((g.square().sum().to(lora.device) for g in gs),
                   torch.zeros((), dtype=torch.float32, device=lora.device))

    local = sq(lora.sharded_params())
    if lora.tp_size > 1:
        dist.all_reduce(local, group=lora.tp_group)
    experts = sq(lora.expert_params())
    if lora.ep_size > 1:
        dist.all_reduce(experts, group=lora.ep_group)
    total = local + experts + sq(lora.replicated_params())
    if lora.pp_size > 1:                  # the same over every rank of a stage: sum the stages'
        dist.all_reduce(total, group=lora.pp_group)
    norm = total.sqrt()
    params = [p for p in lora.parameters() if p.grad is not None]
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return float(norm)


def trainable_count(lora: LoraAdapters) -> int:
    """Adapter parameters of the whole model (TP shards summed, routed experts' summed over EP, replicated ones
    once, every pipeline stage's summed); collective on TP, EP and PP."""
    dev = lora.device
    sharded = torch.tensor([float(sum(p.numel() for p in lora.sharded_params()))], dtype=torch.float64, device=dev)
    if lora.tp_size > 1:
        dist.all_reduce(sharded, group=lora.tp_group)
    experts = torch.tensor([float(sum(p.numel() for p in lora.expert_params()))], dtype=torch.float64, device=dev)
    if lora.ep_size > 1:
        dist.all_reduce(experts, group=lora.ep_group)
    total = sharded + experts + float(sum(p.numel() for p in lora.replicated_params()))
    if lora.pp_size > 1:
        dist.all_reduce(total, group=lora.pp_group)
    return int(total.item())


def _spec_dict(lora: LoraAdapters) -> dict:
    """The LoRA's shape a checkpoint records: rank, alpha and the target leaf names the model has (those that
    selected nothing do not count: ``all-linear`` records the same targets however many names it resolves to)."""
    spec = lora.spec
    out = {"rank": spec.rank, "alpha": spec.alpha, "targets": sorted({_leaf(n) for n in lora.targets})}
    if spec.experts_shared_outer:
        out["experts_shared_outer"] = True
    return out


def state(lora: LoraAdapters, optimizer: torch.optim.Optimizer | None) -> dict:
    """This rank's adapter weights (and optimizer state) for a checkpoint."""
    out = {"spec": _spec_dict(lora), "tp_size": lora.tp_size, "ep_size": lora.ep_size, "pp_size": lora.pp_size,
           "adapters": {k: v.detach().cpu().clone() for k, v in lora.state_dict().items()}}
    if optimizer is not None:
        out["optimizer"] = optimizer.state_dict()
    return out


def load_state(lora: LoraAdapters, optimizer: torch.optim.Optimizer | None, saved: dict, where: str) -> None:
    """Restore ``state``'s output; a checkpoint of another LoRA shape, TP, EP or PP size is refused in one line."""
    want = _spec_dict(lora)
    if (saved.get("spec") != want or saved.get("tp_size") != lora.tp_size
            or saved.get("ep_size", 1) != lora.ep_size or saved.get("pp_size", 1) != lora.pp_size):
        raise ConfigError(f"{where}: the checkpoint's LoRA ({saved.get('spec')}, TP {saved.get('tp_size')}, EP "
                          f"{saved.get('ep_size', 1)}, PP {saved.get('pp_size', 1)}) differs from this run's ({want}, "
                          f"TP {lora.tp_size}, EP {lora.ep_size}, PP {lora.pp_size}); resume with the same "
                          "--lora-rank, --lora-alpha, --target-modules, --experts-shared-outer-loras, "
                          "--tensor-model-parallel-size, --expert-model-parallel-size and "
                          "--pipeline-model-parallel-size.")
    with torch.no_grad():
        for k, v in lora.state_dict().items():
            v.copy_(saved["adapters"][k].to(v.device))
    if optimizer is not None and "optimizer" in saved:
        optimizer.load_state_dict(saved["optimizer"])


def check_megatron(opts, shape, spec: LoraSpec) -> None:
    """Refuse the Megatron layouts LoRA is not built for (one line each)."""
    if spec.dropout > 0 and opts.tp > 1:
        raise ConfigError(f"--lora-dropout {spec.dropout} with --tensor-model-parallel-size > 1 is not supported with "
                          "--lora-rank; use --lora-dropout 0 at TP > 1, or train at --tensor-model-parallel-size 1.")
    family = shape.family
    foreign = sorted(set(spec.names) & set(FAMILY_TARGETS) - set(family.lora_targets))
    if foreign:
        from miles.trainer.megatron.families import ALL

        built = sorted({f.name for f in ALL if set(foreign) & set(f.lora_targets)})
        raise ConfigError(f"--target-modules {','.join(foreign)}: LoRA on {' / '.join(foreign)} is built for "
                          f"{', '.join(built) or 'no family'} only, not for {family.name} ({shape.model_type}); drop "
                          "them from --target-modules.")
    experts = bool(shape.num_experts) and selects_routed_experts(spec, shape)
    if experts and opts.moe.grouped_gemm:
        raise ConfigError("--moe-grouped-gemm with LoRA on the MoE experts (--target-modules gate_proj/up_proj/"
                          "down_proj) is not supported by the Megatron backend; drop --moe-grouped-gemm (the experts "
                          "run as SequentialMLP, the same math) or the expert targets.")
    if spec.experts_shared_outer and not experts:
        what = ("the model has no MoE experts" if not shape.num_experts
                else f"--target-modules selects no expert linear ({','.join(spec.targets + spec.paths)})")
        raise ConfigError(f"--experts-shared-outer-loras shares the experts' outer LoRA factors, but {what}; drop "
                          "the flag, or target gate_proj,up_proj,down_proj on a MoE model.")


def selects_routed_experts(spec: LoraSpec, shape) -> bool:
    """Whether a target selects a routed expert's linear of some MoE layer (its name as our model and as
    Megatron-Bridge's give it: ``bridge_names``)."""
    prefix = shape.family.lora_path_prefix(shape)
    layers = [i for i, moe in enumerate(shape.moe_layer_pattern or (1,) * shape.num_layers) if moe]
    return any(spec.selects(f"decoder.layers.{i}.mlp.experts.local_experts.0.{leaf}", prefix)
               for i in layers for leaf in ("linear_fc1", "linear_fc2"))


def _file(path, rank: int):
    from pathlib import Path

    return Path(path) / "lora" / f"rank_{rank:05d}.pt"


def save_files(lora: LoraAdapters, optimizer: torch.optim.Optimizer | None, path, rank: int,
               group: dist.ProcessGroup | None) -> None:
    """Each trainer rank's adapters (and AdamW state) as ``path/lora/rank_NNNNN.pt``; collective barrier."""
    f = _file(path, rank)
    f.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state(lora, optimizer), f)
    if group is not None and dist.get_world_size(group) > 1:
        # a tiny all-reduce, not barrier(): it honours the group's timeout on NCCL too
        dist.all_reduce(torch.zeros(1, device=next(iter(lora.parameters())).device), group=group)


def load_files(lora: LoraAdapters, optimizer: torch.optim.Optimizer | None, path, rank: int) -> None:
    """Restore ``save_files``'s file of this rank; a checkpoint without adapters is refused in one line."""
    f = _file(path, rank)
    if not f.is_file():
        raise ConfigError(f"{path}: no LoRA adapters ({f.name} missing under lora/): it was not saved with "
                          "--lora-rank; resume it without the LoRA flags, or start the LoRA run from "
                          "--hf-checkpoint with a fresh --save.")
    load_state(lora, optimizer, torch.load(f, map_location="cpu", weights_only=False), str(path))


@torch.no_grad()
def full_pairs(lora: LoraAdapters, shape=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Megatron module name (global layer index; routed experts: EP-free, global index) -> (A, B) of the whole model
    (TP shards, EP ranks' experts and pipeline stages gathered, a column target's B rows joined as its weight's are:
    ``shape``, the model's ``ModelShape``, for a family's sectioned weights such as the gated DeltaNet's
    ``in_proj``; CPU fp32); collective on TP, EP and PP."""
    from miles.trainer.megatron.convert import unshard
    from miles.trainer.megatron.moe import global_name

    out = {}
    for local, pair in lora.named_pairs():
        name = lora.stage_names.get(local, local)
        a, b = pair.lora_A.detach().float(), pair.lora_B.detach().float()
        if pair.kind == "expert":
            if lora.ep_size == 1:
                out[name] = (a.cpu(), b.cpu())
                continue
            both = torch.cat([a.reshape(-1), b.reshape(-1)]).contiguous()
            parts = [torch.empty_like(both) for _ in range(lora.ep_size)]
            dist.all_gather(parts, both, group=lora.ep_group)
            for r, t in enumerate(parts):
                gname = global_name(name + ".weight", r, lora.num_local).removesuffix(".weight")
                out[gname] = (t[:a.numel()].view_as(a).cpu(), t[a.numel():].view_as(b).cpu())
            continue
        if lora.tp_size > 1 and pair.sharded is not None:
            sh = pair.sharded.detach().float().contiguous()
            parts = [torch.empty_like(sh) for _ in range(lora.tp_size)]
            dist.all_gather(parts, sh, group=lora.tp_group)
            if pair.kind == "column":
                b = unshard(name + ".weight", parts, 0, shape)  # fc1's shards are [gate_r; up_r], in_proj's by section
            else:
                a = torch.cat(parts, dim=1)
        out[name] = (a.cpu(), b.cpu())
    if lora.pp_size > 1:
        from miles.trainer.collectives import bounded_all_gather_object

        parts = bounded_all_gather_object(out, lora.pp_group, lora.timeout, lora.device,
                                          "gathering the pipeline stages' LoRA adapters")
        out = {k: v for part in parts for k, v in part.items()}
    return out


def peft_tensors(lora: LoraAdapters, shape) -> list[tuple[str, torch.Tensor]]:
    """The adapters in HF PEFT names (``base_model.model.<HF module>.lora_A.weight`` / ``lora_B``): the fused
    linear_qkv / linear_fc1 become q/k/v and gate/up modules sharing ``A``, each with its rows of ``B``;
    collective on TP. A routed expert whose HF checkpoint keeps the experts fused (gpt-oss's ``mlp.experts.
    gate_up_proj``: the converter names its slice ``<fused>#<e>``) is named per expert as PEFT and the engines name
    it, ``mlp.experts.<e>.gate_proj`` / ``up_proj`` (Megatron's ``B`` rows [gate; up]) / ``down_proj``."""
    return peft_named(full_pairs(lora, shape), shape)


def peft_named(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], shape) -> list[tuple[str, torch.Tensor]]:
    """``peft_tensors`` of the whole model's pairs (``full_pairs``: Megatron module name -> (A, B))."""
    from miles.trainer.megatron.convert import megatron_to_hf

    out = []
    for name, (a, b) in pairs.items():
        hf_names = megatron_to_hf(name + ".weight", b, shape)
        if any("#" in hf for hf, _ in hf_names):          # a fused experts tensor's slice: per-expert PEFT names
            fused, _, e = hf_names[0][0].partition("#")
            prefix = f"base_model.model.{fused.rsplit('.', 1)[0]}.{e}"
            parts = (list(zip(("gate_proj", "up_proj"), b.chunk(2, dim=0))) if name.endswith("linear_fc1")
                     else [("down_proj", b)])
            for proj, rows in parts:
                out += [(f"{prefix}.{proj}.lora_A.weight", a.clone()), (f"{prefix}.{proj}.lora_B.weight",
                                                                        rows.contiguous())]
            continue
        for hf, rows in hf_names:
            module = "base_model.model." + hf.removesuffix(".weight")
            out += [(module + ".lora_A.weight", a.clone()), (module + ".lora_B.weight", rows.contiguous())]
    return out


def write_peft_adapter(path, tensors: list[tuple[str, torch.Tensor]], spec: LoraSpec, base: str | None) -> None:
    """``path/adapter_model.safetensors`` + ``adapter_config.json`` (what ``peft.PeftModel.from_pretrained`` reads)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(tensors, spec, base), indent=2) + "\n")


def peft_config(tensors: list[tuple[str, torch.Tensor]], spec: LoraSpec, base: str | None) -> dict:
    """adapter_config.json of ``tensors`` (PEFT names), also the ``config_dict`` of an adapter sent to the engines."""
    modules = sorted({k.rsplit(".", 3)[1] for k, _ in tensors})      # <prefix>.<module>.lora_X.weight
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": modules, "bias": "none",
            "base_model_name_or_path": base, "fan_in_fan_out": False, "inference_mode": True}
