"""The Megatron backend's LoRA adapters (``miles.trainer.lora`` documents the design): ``LoraSpec`` (the flags),
``LoraPair`` / ``LoraAdapters`` (the factors, outside the model), ``attach`` (targets selected by leaf name or
module path, ``A`` drawn from the trainer seed and the module's global name, forward hooks adding the delta; the
routed experts' per-expert or shared-outer pairs), ``merged`` (the export's ``W + (alpha / r) B @ A``), and the
Megatron preflight of LoRA layouts (``check_megatron``)."""

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
from miles.config.lora import FAMILY_TARGETS, MEGATRON_KIND, path_matches, resolve
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
