"""Mixture-of-experts models (the Qwen3-MoE family) on megatron-core, and expert parallelism.

    fields = hf_moe_fields(hf_config)       # ModelShape's MoE fields from config.json (empty for dense)
    opts = resolve_moe(cfg.megatron)        # Megatron's --moe-* flags, defaults filled in
    check_moe_shape(cfg.megatron, shape)    # --num-experts 8 vs config.json's num_experts 4 -> ConfigError
    kw = config_kwargs(shape, opts, ep=2, etp=1, device=dev)   # TransformerConfig's MoE arguments

Model: megatron-core's ``MoELayer`` (``TopKRouter`` + token dispatcher + experts) on the layers config.json
makes sparse (HF's rule: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``), its dense
MLP on the others (``get_gpt_decoder_block_spec`` with ``moe_layer_freq``). Experts are megatron-core's
``SequentialMLP`` on the local spec (its ``GroupedMLP`` needs the CUDA-only ``grouped_gemm`` package; the
math is the same), ``TEGroupedMLP`` with transformer-engine and ``--moe-grouped-gemm``. Routing: softmax
over the experts' logits, top-k, renormalised over the k chosen (HF ``norm_topk_prob``; megatron-core's
softmax after top-k) or not (``moe_router_pre_softmax``); no capacity, no token dropping, no expert bias.

Auxiliary load-balancing loss: neither backend counts it. The FSDP backend computes log-probs from the
hidden states without ``output_router_logits`` (so transformers adds no aux loss), and here
``--moe-aux-loss-coeff`` must be 0 (Megatron-LM's default, and what Miles's Qwen3-MoE script passes); the RL
loss, its gradients and the metrics are then the same function of the weights in both backends.

Weights (HF checkpoint names, as the safetensors files and SGLang have them):
``model.layers.L.mlp.gate.weight`` = ``decoder.layers.L.mlp.router.weight``;
``model.layers.L.mlp.experts.E.{gate,up}_proj.weight`` = ``...mlp.experts.local_experts.e.linear_fc1.weight``
as ``[gate; up]``, ``down_proj`` = ``linear_fc2`` (TE grouped: ``experts.linear_fc1.weight<e>``), where the
global expert ``E = ep_rank * num_local_experts + e``. Megatron names with the *global* index are the EP-free
names (``global_name``); the converter and the export use them.

Expert parallelism (megatron-core's ``tp-cp-ep-dp-pp`` layout over the trainer ranks; the expert groups are laid
over TP x CP x DP within a pipeline stage): EP rank r holds experts ``[r E/ep, (r + 1) E/ep)``; tokens reach them
through megatron-core's dispatcher (all-to-all or all-gather over the EP group). Expert gradients are summed over
the expert-data-parallel group and divided by the DP size (each expert saw the tokens of all EP ranks; Megatron's
``expert_gradient_scaling_factor``); the others are averaged over DP (summed over DP x CP under context
parallelism) as before. The gradient norm adds the experts' squares summed over EP. A pipeline stage's experts
are gathered over its EP group for the export (``export_units``, ``start_units``, ``finish_units``, and
``unit_layout`` for the layout of another stage's), then broadcast over the pipeline group (``export.py``).
``--use-distributed-optimizer`` shards the experts' AdamW state over the expert-DP group
(``parallel.ExpertShardedAdamW``). ``--expert-tensor-parallel-size`` other than 1 is refused (whole experts on
every TP rank here).

Tensor parallelism (``--tensor-model-parallel-size`` > 1, ``--expert-tensor-parallel-size 1``, megatron-core's
meaning): attention and the dense MLPs are split over TP, the experts are not; megatron-core needs
``--sequence-parallel`` there (each TP rank routes its own part of the sequence through whole experts, the
dispatcher moving tokens over the EP group only). The router's gradient is summed over TP (it is marked
``sequence_parallel``); the experts' are summed over the expert-DP group, which then spans the TP ranks too, and
divided by the DP size; the export gathers the other parameters' TP shards as ``export`` does.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import torch

from miles.config.base import ConfigError
from miles.utils.logging import get_logger, warn_once
from miles.utils.process_groups import wait_timeout_message

logger = get_logger(__name__)

MOE_FAMILIES = {"qwen3_moe": "Qwen3-MoE"}
_MOE_LAYER = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)"     # an MTP layer's too (mtp.py)
_LOCAL_EXPERT = re.compile(rf"^({_MOE_LAYER}\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")   # biases: gpt-oss
_GROUPED_EXPERT = re.compile(rf"^({_MOE_LAYER}\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")
# every expert of a layer in one [E, ...] tensor (Inkling's own MoE, families/inkling_model.py): under EP each rank holds
# rows [ep_rank * E / ep, ...) of it under the one name
_STACKED_EXPERT = re.compile(rf"^({_MOE_LAYER}\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_HF_EXPERT = {"linear_fc1.weight": ("gate_proj", "up_proj"), "linear_fc2.weight": ("down_proj",)}


# ------------------------------------------------------------------------------------------- shape
def hf_moe_fields(c) -> dict:
    """``ModelShape``'s MoE fields from a HF config (empty for a dense model)."""
    if getattr(c, "model_type", None) not in MOE_FAMILIES:
        return {}
    num_layers = int(c.num_hidden_layers)
    experts = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0) or 0)
    step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    pattern = tuple(int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(num_layers))
    if not any(pattern):
        return {}
    shared = int(getattr(c, "shared_expert_intermediate_size", 0) or 0)
    if shared:
        raise ConfigError("--hf-checkpoint: shared experts are not supported by --train-backend megatron (Qwen3-MoE has "
                          "none); train this model with --train-backend fsdp.")
    return {"num_experts": experts, "moe_ffn_hidden_size": int(c.moe_intermediate_size),
            "moe_router_topk": int(c.num_experts_per_tok), "moe_norm_topk_prob": bool(getattr(c, "norm_topk_prob", False)),
            "moe_layer_pattern": pattern}


# ------------------------------------------------------------------------------------------- flags
@dataclass(frozen=True)
class MoeOptions:
    dispatcher: str | None = None        # --moe-token-dispatcher-type; None: allgather (Megatron-LM's default)
    #                                      at EP 1, alltoall with EP > 1 (filled in by config_kwargs)
    router_dtype: str | None = None      # --moe-router-dtype
    grouped_gemm: bool = False           # --moe-grouped-gemm
    permute_fusion: bool = False         # --moe-permute-fusion
    load_balancing: tuple[str, ...] = ("aux_loss",)
    flags: tuple[str, ...] = ()          # every --moe-*/--num-experts flag given (refused on a dense model)


_SHAPE_FLAGS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                "moe_router_score_function", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_grouped_gemm",
                "moe_token_dispatcher_type", "moe_router_dtype", "moe_permute_fusion", "moe_router_bias_update_rate",
                "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_layer_freq",
                "moe_router_pre_softmax", "moe_token_drop_policy", "moe_router_freeze_gate")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def resolve_moe(m) -> MoeOptions:
    if m is None:
        return MoeOptions()
    given = tuple(_flag(d) for d in _SHAPE_FLAGS if getattr(m, d, None) not in (None, False))
    lb = getattr(m, "moe_router_load_balancing_type", None)
    return MoeOptions(dispatcher=getattr(m, "moe_token_dispatcher_type", None),
                      router_dtype=getattr(m, "moe_router_dtype", None), grouped_gemm=bool(getattr(m, "moe_grouped_gemm",
                                                                                               False)),
                      permute_fusion=bool(getattr(m, "moe_permute_fusion", False)),
                      load_balancing=tuple(lb) if lb else ("aux_loss",), flags=given)


def parse_layer_freq(value: str | int, flag: str = "--moe-layer-freq") -> int | list[int]:
    """Megatron-LM's ``--moe-layer-freq``: an int N (every N-th layer, from the first) or a Python list
    expression of 0/1 per layer such as ``[1,1,0]`` or ``([0]*1+[1]*46)``, read without ``eval``."""
    if isinstance(value, int):
        return value
    text = str(value).strip()

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Add):
            a, b = ev(node.left), ev(node.right)
            return a * b if isinstance(node.op, ast.Mult) else a + b
        raise ValueError
    try:
        out = ev(ast.parse(text, mode="eval").body)
    except (ValueError, SyntaxError, TypeError):
        out = None
    if isinstance(out, int) and out > 0:
        return out
    if not isinstance(out, list) or not out or any(v not in (0, 1) for v in out):
        raise ConfigError(f"{flag} {value!r} is neither a positive int nor a list of 0/1 per layer such as "
                          "'[1,1,0]' or '([0]*1+[1]*46)'.")
    return out


def layer_pattern(freq: int | list[int], num_layers: int) -> tuple[int, ...]:
    """0/1 per layer as megatron-core reads ``moe_layer_freq``."""
    if isinstance(freq, int):
        return tuple(int(i % freq == 0) for i in range(num_layers))
    return tuple(freq)


def _mismatch(name: str, value, key: str, config_value) -> ConfigError:
    return ConfigError(f"{name} {value} does not match --hf-checkpoint's config.json ({key} {config_value}): fix "
                       f"the flag or drop it (the model shape is read from config.json).")


def check_moe_shape(m, shape) -> None:
    """Each given MoE flag agrees with config.json (one line naming flag, value and the config's)."""
    if m is None:
        return
    check_aux_loss(m)
    given = resolve_moe(m).flags
    if not shape.num_experts:
        if given:
            raise ConfigError(f"{given[0]} is given but --hf-checkpoint's config.json describes a dense model (no "
                              "experts): drop the MoE flags or use an MoE checkpoint (Qwen3-MoE).")
        return
    for flag, v, key, cv in (("--num-experts", m.num_experts, "num_experts", shape.num_experts),
                             ("--moe-router-topk", m.moe_router_topk, "num_experts_per_tok", shape.moe_router_topk),
                             ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size, "moe_intermediate_size",
                              shape.moe_ffn_hidden_size)):
        if v is not None and int(v) != int(cv):
            raise _mismatch(flag, v, key, cv)
    from miles.trainer.megatron.router import check_router_shape

    check_router_shape(m, shape)       # shared experts, sigmoid router, expert bias, scaling, groups (router.py)
    if m.moe_router_pre_softmax and shape.moe_norm_topk_prob and shape.moe_score_function == "softmax":
        raise _mismatch("--moe-router-pre-softmax", "(given)", "norm_topk_prob", True)
    if m.num_layers is not None and not m.moe_router_pre_softmax and not shape.moe_norm_topk_prob and \
            shape.moe_score_function == "softmax":
        raise ConfigError("--moe-router-pre-softmax is missing but --hf-checkpoint's config.json has norm_topk_prob "
                          "false (top-k weights not renormalised): add --moe-router-pre-softmax, or drop the shape "
                          "flags.")
    if m.moe_layer_freq is not None:
        pattern = layer_pattern(parse_layer_freq(m.moe_layer_freq), shape.num_layers)
        if pattern != shape.moe_layer_pattern:
            raise _mismatch("--moe-layer-freq", m.moe_layer_freq, "MoE layers (mlp_only_layers, decoder_sparse_step)",
                            list(shape.moe_layer_pattern))


def check_moe_static(o, shape) -> None:
    """The MoE and EP values this build does not run (``o``: ``options.Options``)."""
    m = o.moe
    if o.ep > 1 and not shape.num_experts:
        raise ConfigError(f"--expert-model-parallel-size {o.ep} needs an MoE model; --hf-checkpoint's config.json "
                          "has no experts: drop the flag.")
    if o.etp != 1:
        raise ConfigError(f"--expert-tensor-parallel-size {o.etp} is not supported by the Megatron backend (the "
                          "converter, the weight export and the gradient reduction hold whole experts on every TP "
                          "rank): use 1, which Miles's recorded commands use (TP still splits attention and the dense "
                          "MLPs), and expert parallelism to split the experts.")
    if not shape.num_experts:
        return
    if shape.num_experts % o.ep:
        raise ConfigError(f"--expert-model-parallel-size {o.ep} does not divide config.json's num_experts "
                          f"{shape.num_experts}; choose a divisor.")
    if o.tp > 1 and not o.sequence_parallel:
        raise ConfigError(f"--tensor-model-parallel-size {o.tp} with MoE layers needs --sequence-parallel "
                          "(megatron-core trains MoE layers under TP only with sequence parallelism): add it.")
    if o.ep > 1 and m.dispatcher == "allgather" and not shape.family.own_moe_dispatch:
        raise ConfigError(f"--moe-token-dispatcher-type allgather with --expert-model-parallel-size {o.ep} needs the "
                          "same number of tokens on every EP rank, and RL micro-batches differ in length: use "
                          "alltoall (the default with EP > 1).")
    if m.dispatcher == "flex" and not shape.family.own_moe_dispatch:     # (that family's check_static refuses it)
        raise ConfigError("--moe-token-dispatcher-type flex needs DeepEP/HybridEP, which this backend does not run: "
                          "use alltoall or allgather.")
    bad = [t for t in m.load_balancing if t not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")]
    if bad:
        raise ConfigError(f"--moe-router-load-balancing-type {bad[0]} is not supported (it changes the routing HF "
                          "Qwen3-MoE does): use aux_loss, seq_aux_loss, global_aux_loss or none, with "
                          "--moe-aux-loss-coeff 0.")


def check_aux_loss(m) -> None:
    coeffs = getattr(m, "moe_aux_loss_coeff", None) if m is not None else None
    for c in coeffs or []:
        if c != 0:
            raise ConfigError(f"--moe-aux-loss-coeff {c:g} is not supported: neither training backend adds the "
                              "router's load-balancing loss to the RL loss (the FSDP backend never computes it); use "
                              "0 (Megatron-LM's default, as Miles's Qwen3-MoE script passes).")


# ------------------------------------------------------------------------------------------- model
def config_kwargs(shape, o: MoeOptions, *, ep: int, etp: int, te: bool) -> dict:
    """megatron-core ``TransformerConfig`` arguments for the MoE layers (empty for a dense model)."""
    if not shape.num_experts:
        return {}
    if o.grouped_gemm and not te:
        warn_once(logger, "--moe-grouped-gemm: megatron-core's local GroupedMLP needs the CUDA-only grouped_gemm "
                          "package; experts run as SequentialMLP (the same math).")
    if o.permute_fusion and not te:
        warn_once(logger, "--moe-permute-fusion needs transformer-engine; tokens are permuted unfused (same result).")
    return dict(num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                moe_router_topk=shape.moe_router_topk, moe_router_pre_softmax=not shape.moe_norm_topk_prob,
                moe_layer_freq=list(shape.moe_layer_pattern), moe_router_score_function="softmax",
                moe_router_load_balancing_type=list(o.load_balancing) if len(o.load_balancing) > 1
                else o.load_balancing[0], moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type=o.dispatcher or ("alltoall" if ep > 1 else "allgather"),
                moe_router_dtype=o.router_dtype, moe_grouped_gemm=o.grouped_gemm and te,
                moe_permute_fusion=o.permute_fusion and te, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp)


def decoder_block_spec(config, shape, *, te: bool, core_attention=None):
    """The per-layer spec (MoE or dense MLP per ``shape.moe_layer_pattern``); ``core_attention`` replaces
    the local spec's core attention on every layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if core_attention is not None and not te:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core_attention
    return spec


# ------------------------------------------------------------------------------------------- names
def is_expert(name: str) -> bool:
    """An expert weight (sharded over EP), as opposed to the router and dense parameters."""
    return ".mlp.experts." in name


def global_name(name: str, ep_rank: int, num_local: int) -> str:
    """The EP-free megatron name of a local expert parameter (global expert index); others unchanged."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return f"{m.group(1)}local_experts.{ep_rank * num_local + int(m.group(2))}.{m.group(3)}"
    m = _GROUPED_EXPERT.match(name)
    if m:
        return f"{m.group(1)}{m.group(2)}.weight{ep_rank * num_local + int(m.group(3))}"
    return name


def _expert_parts(name: str) -> tuple[str, int, str] | None:
    """(layer prefix 'model.layers.L.', global expert, 'linear_fcN.weight') of an EP-free expert name."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return m.group(1)[len("decoder."):-len("mlp.experts.")], int(m.group(2)), m.group(3)
    m = _GROUPED_EXPERT.match(name)
    if m:
        return m.group(1)[len("decoder."):-len("mlp.experts.")], int(m.group(3)), m.group(2) + ".weight"
    return None


def hf_to_megatron(name: str, hf: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The full megatron tensor of an EP-free router/expert name from a HF state dict (None: not MoE)."""
    if name.endswith(".mlp.router.weight"):
        return hf["model." + name[len("decoder."):-len("router.weight")] + "gate.weight"]
    parts = _expert_parts(name)
    if parts is None:
        return None
    layer, e, kind = parts
    return torch.cat([hf[f"model.{layer}mlp.experts.{e}.{p}.weight"] for p in _HF_EXPERT[kind]], dim=0)


def megatron_to_hf(name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors of an EP-free router/expert name (None: not MoE)."""
    if name.endswith(".mlp.router.weight"):
        return [("model." + name[len("decoder."):-len("router.weight")] + "gate.weight", full)]
    parts = _expert_parts(name)
    if parts is None:
        return None
    layer, e, kind = parts
    projs = _HF_EXPERT[kind]
    pieces = full.chunk(2, dim=0) if len(projs) == 2 else (full,)
    return [(f"model.{layer}mlp.experts.{e}.{p}.weight", t) for p, t in zip(projs, pieces)]


def expert_layer(name: str) -> str | None:
    """The MoE layer ('decoder.layers.L.mlp.experts.') of an expert parameter, else None."""
    m = _LOCAL_EXPERT.match(name) or _GROUPED_EXPERT.match(name) or _STACKED_EXPERT.match(name)
    return m.group(1) if m else None


def is_stacked_expert(name: str) -> bool:
    """Every expert of a layer in one [E, ...] tensor (EP splits its dim 0)."""
    return _STACKED_EXPERT.match(name) is not None


def ep_rows(name: str, full: torch.Tensor, ep_rank: int, num_local: int) -> torch.Tensor:
    """This EP rank's part of a stacked expert tensor (``is_stacked_expert``); another tensor unchanged."""
    return full.narrow(0, ep_rank * num_local, num_local) if is_stacked_expert(name) else full


# ------------------------------------------------------------------------------------------- gradients
def ep_sharded(name: str, groups) -> bool:
    """An expert parameter split over EP (each EP rank holds other experts)."""
    return groups.ep_size > 1 and is_expert(name)


def edp_reduced(name: str, groups) -> bool:
    """A parameter whose gradient is reduced over the expert-data-parallel group instead of DP: the experts
    under EP > 1 or TP > 1 (with ETP 1 each TP rank runs the whole experts on its part of the sequence)."""
    return (groups.ep_size > 1 or groups.tp_size > 1) and is_expert(name)


@torch.no_grad()
def reduce_expert_grads(named: list[tuple[str, torch.Tensor]], groups) -> None:
    """Expert gradients (EP > 1 or TP > 1): summed over the expert-DP group (DP x TP / EP ranks), divided by the
    DP size (collective)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for n, p in named if edp_reduced(n, groups)]
    if not grads:
        return
    if groups.edp_size > 1:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=groups.edp)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
    if groups.dp_size > 1:
        torch._foreach_div_(grads, float(groups.dp_size))


@torch.no_grad()
def expert_sq_norm(named: list[tuple[str, torch.Tensor]], groups, sq) -> torch.Tensor | float:
    """Squared L2 norm of the EP-sharded expert gradients over the whole model (summed over EP)."""
    import torch.distributed as dist

    if groups.ep_size == 1:
        return 0.0
    total = sq([p.grad for n, p in named if ep_sharded(n, groups)])
    dist.all_reduce(total, group=groups.ep)
    return total


# ------------------------------------------------------------------------------------------- export (EP > 1)
def _order_key(name: str) -> tuple:
    """Position of an EP-free expert name in the EP = 1 model's ``named_parameters()`` order within its layer."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return (int(m.group(2)), m.group(3))
    m = _GROUPED_EXPERT.match(name)
    return (m.group(2), int(m.group(3))) if m else (name,)


def export_units(named: list[tuple[str, torch.Tensor]], groups) -> list[list[tuple[str, torch.Tensor]]]:
    """One unit per parameter, except that the EP-sharded local experts of one MoE layer form one unit (bucketed
    together, so they come out in the global expert order)."""
    units: list[list[tuple[str, torch.Tensor]]] = []
    last = None
    for name, p in named:
        layer = expert_layer(name) if ep_sharded(name, groups) else None
        if layer is not None and layer == last:
            units[-1].append((name, p))
        else:
            units.append([(name, p)])
        last = layer
    return units


def unit_nbytes(unit: list[tuple[str, torch.Tensor]], groups, dtype: torch.dtype | None) -> int:
    """Bytes of a unit's full tensors (experts of every EP rank, TP shards joined), cast to ``dtype``."""
    from miles.trainer.megatron.convert import partition_dim

    return sum(p.numel() * (groups.ep_size if ep_sharded(n, groups) else groups.tp_size if partition_dim(n)
                            is not None else 1) * (dtype or p.dtype).itemsize for n, p in unit)


def unit_layout(unit: list[tuple[str, torch.Tensor]], groups, shape,
                dtype: torch.dtype | None) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(HF name, shape, dtype) of what ``finish_units`` gives for ``unit``, from its local (meta) tensors: the
    layout of another pipeline stage's part of a bucket (``export._iter_pipeline``)."""
    from miles.trainer.megatron.convert import megatron_to_hf, partition_dim

    full: dict[str, torch.Tensor] = {}
    for name, p in unit:
        dims = list(p.shape)
        if not ep_sharded(name, groups) and (dim := partition_dim(name)) is not None:
            dims[dim] *= groups.tp_size
        meta = torch.empty(dims, dtype=dtype or p.dtype, device="meta")
        if ep_sharded(name, groups) and is_stacked_expert(name):
            full[name] = torch.empty([dims[0] * groups.ep_size, *dims[1:]], dtype=meta.dtype, device="meta")
        elif ep_sharded(name, groups):
            num_local = shape.num_experts // groups.ep_size
            full.update({global_name(name, r, num_local): meta for r in range(groups.ep_size)})
        else:
            full[name] = meta
    names = sorted(full, key=_order_key) if ep_sharded(unit[0][0], groups) and not is_stacked_expert(unit[0][0]) \
        else list(full)
    return [(hf, t.shape, t.dtype) for name in names for hf, t in megatron_to_hf(name, full[name], shape)]


class _EPPending:
    def __init__(self, units, out, work, sizes, tp=None):
        self.units, self.out, self.work, self.sizes = units, out, work, sizes
        self.tp = tp        # export._Pending of the other parameters (their TP shards gathered under TP > 1)


def start_units(units, groups, device, dtype) -> _EPPending:
    """Issue the gathers of ``units`` (``export_units``): the experts of every EP rank over the EP group in one
    ``all_gather_into_tensor``, the other parameters' TP shards over the TP group (``export._start``)."""
    import torch.distributed as dist

    from miles.trainer.megatron.export import _start

    tp = _start([unit[0] for unit in units if not ep_sharded(unit[0][0], groups)], groups, device, dtype)
    experts = [p.detach().to(device=device, dtype=dtype or p.dtype).reshape(-1) for unit in units for n, p in unit
               if ep_sharded(n, groups)]
    if not experts:
        return _EPPending(units, None, None, 0, tp)
    if len({t.dtype for t in experts}) > 1:
        experts = [t.float() for t in experts]
    send = torch.cat(experts)
    out = torch.empty(groups.ep_size * send.numel(), dtype=send.dtype, device=device)
    work = dist.all_gather_into_tensor(out, send, group=groups.ep, async_op=True)
    return _EPPending(units, out, work, send.numel(), tp)


def finish_units(pend: _EPPending, shape, groups, device, dtype, timeout: float) -> list[tuple[str, torch.Tensor]]:
    """The (HF name, full tensor) pairs of ``start_units``'s units, in order; the experts of a layer in the global
    expert order."""
    from datetime import timedelta

    from miles.trainer.megatron.convert import megatron_to_hf
    from miles.trainer.megatron.export import _finish_each

    others = iter(_finish_each(pend.tp, groups, shape, device, dtype, timeout))
    if pend.work is not None and pend.work.wait(timeout=timedelta(seconds=timeout)) is False:
        raise TimeoutError(wait_timeout_message("gathering the experts", groups.ep, timeout, size=groups.ep_size))
    gathered = pend.out.view(groups.ep_size, -1) if pend.out is not None else None
    num_local = shape.num_experts // groups.ep_size if shape.num_experts else 0
    result: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for unit in pend.units:
        if not ep_sharded(unit[0][0], groups):
            result.extend(next(others))
            continue
        full_experts = {}
        for name, p in unit:
            n = p.numel()
            pieces = [gathered[r, offset:offset + n].view(p.shape).to(dtype or p.dtype) for r in range(groups.ep_size)]
            if is_stacked_expert(name):              # one tensor: the ranks' rows in EP order
                full_experts[name] = torch.cat(pieces)
            else:
                full_experts.update({global_name(name, r, num_local): t for r, t in enumerate(pieces)})
            offset += n
        stacked = is_stacked_expert(unit[0][0])
        for name in (list(full_experts) if stacked else sorted(full_experts, key=_order_key)):
            result.extend((hf, t.contiguous()) for hf, t in megatron_to_hf(name, full_experts[name], shape))
    return result


@torch.no_grad()  # per resumption (torch wraps generators)
def iter_ep_buckets(model, shape, groups, *, device: torch.device, bucket_bytes: int, dtype: torch.dtype | None,
                    timeout: float, prefetch: bool = True, named: list | None = None):
    """``export.iter_hf_buckets`` under expert parallelism: buckets of (HF name, full tensor), the local experts of
    every EP rank gathered with one ``all_gather_into_tensor`` over the EP group per bucket (cast first, so the
    tensors equal the EP = 1 export bit for bit, in the same order), the other parameters' TP shards over the TP
    group as ``export`` does; the gathers of bucket k+1 are issued before bucket k is yielded. Collective on the
    EP and TP groups; every trainer rank iterates to the end. ``named``: the (megatron name, tensor) pairs to export
    (default: every parameter and the family's exported buffers)."""
    from miles.trainer.megatron.export import pack
    from miles.trainer.weights import iter_prefetched

    if named is None:
        named = list(model.named_parameters()) + shape.family.exported_buffers(model)
    buckets = pack(export_units(named, groups),
                   lambda unit: unit_nbytes(unit, groups, dtype), bucket_bytes)
    yield from iter_prefetched(buckets, lambda b: start_units(b, groups, device, dtype),
                               lambda pend: finish_units(pend, shape, groups, device, dtype, timeout), prefetch)
