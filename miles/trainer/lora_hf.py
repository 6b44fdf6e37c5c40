"""LoRA on the FSDP backend (``--train-backend fsdp --lora-rank R``): the Megatron backend's adapters
(``miles.trainer.lora``) on the HF model's linears, with the same flags and the same math.

    spec = LoraSpec.from_config(cfg.train)
    check_fsdp(cfg, hf_config)                      # preflight: what the FSDP LoRA cannot train, one line each
    lora = attach_hf_model(hf_model, spec, seed=seed)   # base frozen, hooks on q/k/v/o (MLA's), gate/up/down
    optimizer = build_adamw(lora, ...)              # the adapters are the only trained parameters
    finish_grads(lora, group); clip_grad_norm(lora, max_norm)
    merge_buckets(lora, buckets, dtype)             # the weight export: W + (alpha / r) * B @ A under HF names

Same adapters as Megatron's fused targets: ``linear_qkv`` is one ``A`` [r, hidden] shared by ``q_proj``, ``k_proj``
and ``v_proj`` with one ``B`` per projection (Megatron's ``B`` rows, split as the converter splits them), and
``linear_fc1`` one ``A`` shared by ``gate_proj`` and ``up_proj``; ``o_proj`` / ``down_proj`` have their own pair.
``A`` is drawn exactly as on Megatron (Kaiming-uniform from the trainer seed and the *Megatron* module name,
``decoder.layers.L.self_attention.linear_qkv`` ...), ``B`` starts at zero; so both backends start from the same
adapters. The shared ``A x`` (and its dropout mask) is computed once per forward of the group and reused by its
members. The adapters are replicated on every rank (not FSDP-sharded: they are small); their gradients are
averaged over the trainer group after the backward.

Multi-latent attention (``MLA_MODEL_TYPES``: DeepSeek-V3, Kimi-K2, JoyAI-LLM-Flash, GLM-4.7-Flash): each of
megatron-core's MLA projections is one HF linear holding the same rows (``MLA_GROUPS``: ``linear_q_down_proj`` =
``q_a_proj``, ``linear_q_up_proj`` = ``q_b_proj``, ``linear_kv_down_proj`` = ``kv_a_proj_with_mqa``,
``linear_kv_up_proj`` = ``kv_b_proj``, ``linear_q_proj`` = ``q_proj`` without q LoRA, ``linear_proj`` = ``o_proj``),
so each gets its own pair, ``A`` drawn from the Megatron name (``decoder.layers.L.self_attention.linear_kv_up_proj``)
as on the Megatron backend. The up projections' inputs are the latent norms' outputs on both backends (megatron-core's
``q_layernorm`` / ``kv_layernorm``, HF's ``q_a_layernorm`` / ``kv_a_layernorm``). q/k/v's fused ``linear_qkv``
selects nothing there (no ``k_proj``), as on Megatron. The DeepSeek-style MoE's experts, shared experts and dense
first layers are adapted as below.

DeepSeek sparse attention (``DSA_MODEL_TYPES``: DeepSeek-V3.2, GLM-5 / 5.1 / 5.2, part of ``MLA_MODEL_TYPES``): the same
MLA projections and experts; the lightning indexer (``self_attn.indexer``) is no target (frozen on both backends, left
out by Miles's GLM-5.x recipes) and its top-k reads the adapted q latent (``q_a_layernorm(q_a_proj(x))``), as megatron-
core's ``DSAIndexer`` reads the adapted ``linear_q_down_proj`` output. DeepSeek-V4 (``deepseek_v4``): its routed experts
(V4's clamped ``_apply_gate``) and shared experts, as the Megatron backend adapts them; its attention is no target on
either backend (``check_dsv4``). A vision-language checkpoint (``VLM_MODEL_TYPES``: the published Qwen3.5-MoE):
``attach_hf_model`` adapts its text model's layers (``model.language_model.layers.L``, the names the export and PEFT
use), the vision tower frozen.

The gated DeltaNet (``GDN_MODEL_TYPES``: Qwen3-Next, text-only Qwen3.5 / Qwen3.5-MoE): megatron-core's ``in_proj``
is a group like ``linear_qkv`` (``GDN_GROUPS``): one ``A`` drawn from ``decoder.layers.L.self_attention.in_proj``, one
``B`` per HF linear (Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a``), which hold Megatron's rows permuted (the converter's regrouping): the same adapted
function, ``B`` starting at zero on both; ``out_proj`` its own pair.

MoE experts (``qwen3_moe``, ``glm4_moe``, ``gpt_oss``, Qwen3-Next / Qwen3.5-MoE, the MLA models:
``EXPERT_MODEL_TYPES``): transformers keeps a layer's routed experts fused, ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows: Megatron's ``linear_fc1`` layout) and
``down_proj`` [E, H, I] (gpt-oss: [E, H, 2I] with gate and up interleaved column by column, [E, I, H], biases; the
adapters keep Megatron's layout, ``FusedExperts`` maps them), so no per-expert linear exists to hook. Each expert
gets the Megatron backend's ``LoraPair`` (``pairs``, keyed by its Megatron name
``decoder.layers.L.mlp.experts.local_experts.E.linear_fc1``), drawn by the same ``lora._expert_pair`` (with
``--experts-shared-outer-loras`` fc1's ``A`` and fc2's ``B`` are one per layer, in ``shared``), and the experts
module's forward is replaced by ``_experts_forward``: transformers' eager loop over the hit experts with each
expert's adapter added to its linear's output, as the Megatron backend's hook on each SequentialMLP expert's linear
(whatever ``config._experts_implementation`` says: the grouped kernels have no place for an adapter). The export adds
``(alpha / r) B_E @ A_E`` to each expert's slice of the fused tensor (``fused``) before the checkpoint layout splits
it per expert. The shared experts (GLM-4.5's and DeepSeek-V3's ``mlp.shared_experts``, Qwen3-Next's
``mlp.shared_expert``: Megatron's ``mlp.shared_experts``) and dense first layers are dense targets.

Weights out: merged, as on Megatron: the export gathers the base weights in fp32 and adds ``(alpha / r) B @ A``
before the cast to the sync dtype, so the engines need no LoRA. Not here (refused in one line by ``check_fsdp``):
LoRA on the experts of the model types not in ``EXPERT_MODEL_TYPES``, multi-latent attention of the model types not
in ``MLA_MODEL_TYPES``, ``in_proj`` / ``out_proj`` on a model type not in ``GDN_MODEL_TYPES``, DeepSeek-V4 targets
without an MLP and vision-language models not in ``VLM_MODEL_TYPES`` (Kimi-K2.5: the FSDP backend does not load it
without torchvision, its image processor's only backend).

Checkpoints (``--save`` / ``--load``): the adapters and their AdamW state as the Megatron backend writes them
(``lora.save_files``: ``<step>/lora/rank_NNNNN.pt``, the LoRA's shape recorded and checked on load), instead of the
frozen model's DCP shards (``checkpoint.fsdp_format``); the base comes from --hf-checkpoint again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miles.config.base import ConfigError
from miles.trainer.lora import LoraPair, LoraSpec, _expert_pair, _init_a
from miles.trainer.lora_peft import expert_peft_tensors

# Megatron target -> (HF parent attribute of the decoder layer, its HF linears, the Megatron module name's middle)
GROUPS = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "self_attention"),
          "linear_proj": ("self_attn", ("o_proj",), "self_attention"),
          "linear_fc1": ("mlp", ("gate_proj", "up_proj"), "mlp"),
          "linear_fc2": ("mlp", ("down_proj",), "mlp")}
# multi-latent attention (DeepSeek-V3 / Kimi-K2 / JoyAI / GLM-4.7-Flash): each Megatron projection is one HF linear
# with the same rows (the converter maps them one to one: miles/trainer/megatron/families/mla.py); ``linear_q_proj``
# (MLA without q LoRA) only where the attention is MLA (a standard model's ``q_proj`` is part of ``linear_qkv``)
MLA_GROUPS = {"linear_q_proj": ("self_attn", ("q_proj",), "self_attention"),
              "linear_q_down_proj": ("self_attn", ("q_a_proj",), "self_attention"),
              "linear_q_up_proj": ("self_attn", ("q_b_proj",), "self_attention"),
              "linear_kv_down_proj": ("self_attn", ("kv_a_proj_with_mqa",), "self_attention"),
              "linear_kv_up_proj": ("self_attn", ("kv_b_proj",), "self_attention")}
# the gated DeltaNet (Qwen3-Next / Qwen3.5, ``layer.linear_attn``): megatron-core's column-parallel ``in_proj``
# ([q; k; v; z; beta; alpha] rows) is Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` or Qwen3.5's ``in_proj_qkv`` /
# ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` (the converter permutes the rows among them): one shared ``A``, a ``B``
# per HF linear (the same rows as Megatron's ``B``, permuted as the weight's); ``out_proj`` one to one
GDN_GROUPS = {"in_proj": [("linear_attn", ("in_proj_qkvz", "in_proj_ba"), "self_attention"),
                          ("linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "self_attention")],
              "out_proj": [("linear_attn", ("out_proj",), "self_attention")]}
GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# DeepSeek sparse attention (DeepSeek-V3.2, GLM-5 / 5.1 / 5.2): DeepSeek-V3's MLA projections and MoE under the same
# transformers names, plus the lightning indexer (``self_attn.indexer``: ``wq_b``, ``wk``, ``weights_proj``), which is
# no target (frozen on both backends; Miles's GLM-5.x LoRA recipes leave it out) but reads the adapted q latent
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# the multi-latent-attention model types whose transformers modules carry those names
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "joyai_llm_flash", "glm4_moe_lite", *DSA_MODEL_TYPES)
# vision-language checkpoints whose text model the FSDP LoRA adapts (the vision tower frozen, no target): Qwen3.5 /
# 3.6-MoE (``qwen3_5_moe``: its text model ``qwen3_5_moe_text`` under ``model.language_model.``)
VLM_MODEL_TYPES = ("qwen3_5_moe",)
# a MoE layer's shared experts (GLM-4.5's / DeepSeek-V3's ``mlp.shared_experts``, Qwen3-Next's / Qwen3.5's
# ``mlp.shared_expert``; Megatron's ``mlp.shared_experts``): the dense MLP's linears one level down
SHARED_EXPERTS = {t: [(parent, members, "mlp.shared_experts") for parent in ("mlp.shared_experts", "mlp.shared_expert")]
                  for t, members in (("linear_fc1", ("gate_proj", "up_proj")), ("linear_fc2", ("down_proj",)))}
# Megatron's routed-expert target -> transformers' fused 3-D expert tensor ([E, out, in]) it adapts
FUSED = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
# the model types whose routed experts the FSDP LoRA adapts: transformers' fused experts, each expert
# ``down(gate_fn(gate, up))``, either concatenated ([gate; up] rows), untransposed ([E, out, in]) and bias-free, or
# gpt-oss's interleaved, transposed ([E, in, out]) and biased layout
EXPERT_MODEL_TYPES = ("qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text", *MLA_MODEL_TYPES,
                      "deepseek_v4")


class HFLoraGroup(nn.Module):
    """One Megatron target on the HF model: ``A`` [r, in] shared by its HF linears, ``B`` [out_m, r] per linear."""

    def __init__(self, a: torch.Tensor, outs: dict[str, int], rank: int):
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.ParameterDict({m: nn.Parameter(torch.zeros(o, rank, device=a.device)) for m, o in
                                        outs.items()})
        self._cache: tuple | None = None          # (x, h, members left) of the current forward


class HFLoraAdapters(nn.Module):
    """Every dense target's ``HFLoraGroup`` (keys: the Megatron module name with '.' as '/') and the HF weight name
    of each adapted linear -> (group, member); every routed expert's ``lora.LoraPair`` (``pairs``, keys as the
    Megatron backend's: ``decoder/layers/L/mlp/experts/local_experts/E/linear_fc1``), the layers' shared outer
    factors (``shared``, ``--experts-shared-outer-loras``) and each fused expert tensor's HF name -> its experts'
    pairs in expert order (``fused``)."""

    tp_size = ep_size = pp_size = 1        # replicated on every rank: what an adapter checkpoint records (lora.state)

    def __init__(self, spec: LoraSpec):
        super().__init__()
        self.spec = spec
        self.groups = nn.ModuleDict()
        self.pairs = nn.ModuleDict()
        self.shared = nn.ParameterDict()
        self.hf: dict[str, tuple[HFLoraGroup, str]] = {}
        self.fused: dict[str, FusedExperts] = {}

    def hf_targets(self) -> set[str]:
        """The HF names of the adapted weights (the fused expert tensors included)."""
        return set(self.hf) | set(self.fused)

    @property
    def targets(self) -> list[str]:
        """The Megatron module names of the targets (``lora._spec_dict`` records their leaf names)."""
        return [k.replace("/", ".") for k in [*self.groups, *self.pairs]]

    def delta(self, hf_weight: str) -> torch.Tensor:
        """(alpha / r) B @ A of an adapted weight, its shape (a fused expert tensor: one [out, in] per expert)."""
        if hf_weight in self.fused:
            return self.fused[hf_weight].delta(self.spec.scale)
        group, member = self.hf[hf_weight]
        return (group.lora_B[member].float() @ group.lora_A.float()) * self.spec.scale

    def expert_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Megatron module name -> (A, B) of every routed expert (as ``lora.full_pairs`` gives them at EP 1)."""
        return {k.replace("/", "."): (p.lora_A.detach().float().cpu(), p.lora_B.detach().float().cpu())
                for k, p in self.pairs.items()}


def check_fsdp(cfg, hf_config: dict | None) -> None:
    """Preflight of ``--train-backend fsdp`` with ``--lora-rank``: refuse what the FSDP LoRA does not train."""
    spec = LoraSpec.from_config(cfg.train)
    if spec is None:
        return
    check_model(spec, hf_config)
    if cfg.weights.update_weight_transfer_mode == "p2p":
        raise ConfigError("--update-weight-transfer-mode p2p with --lora-rank is not supported by the FSDP backend "
                          "(it sends unmerged local shards); use the default transfer mode.")


def check_model(spec: LoraSpec, hf_config: dict | None) -> None:
    """The models the FSDP LoRA does not adapt (config.json as a dict), one line each."""
    c = hf_config or {}
    text = c.get("text_config") or c
    if spec.paths or spec.exclude_paths:
        raise ConfigError(f"--target-modules / --exclude-modules module paths ({','.join(spec.paths + spec.exclude_paths)}) "
                          "name Megatron-Bridge's modules: they select LoRA targets on the Megatron backend only; add "
                          "--train-backend megatron, or give names such as q_proj,k_proj,v_proj,o_proj.")
    model_type = text.get("model_type") or c.get("model_type")
    gdn = sorted(set(spec.targets) & set(GDN_GROUPS))
    if gdn and model_type not in GDN_MODEL_TYPES:
        raise ConfigError(f"--target-modules {','.join(gdn)}: LoRA on {' / '.join(gdn)} is built for the gated "
                          f"DeltaNet ({', '.join(GDN_MODEL_TYPES)}) only, not for {model_type}; drop them from "
                          "--target-modules.")
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0
    on_experts = bool(experts) and bool({"linear_fc1", "linear_fc2"} & set(spec.targets))
    if on_experts and model_type not in EXPERT_MODEL_TYPES:
        raise ConfigError(f"--target-modules {','.join(spec.targets)} with --train-backend fsdp: LoRA on the MoE "
                          f"experts of {model_type} ({experts} experts) runs on the Megatron backend only (the FSDP "
                          f"LoRA adapts the experts of {', '.join(EXPERT_MODEL_TYPES)}); add --train-backend megatron, "
                          "or target q_proj,k_proj,v_proj,o_proj.")
    if spec.experts_shared_outer and not on_experts:
        what = ("the model has no MoE experts" if not experts
                else f"--target-modules selects no expert linear ({','.join(spec.targets)})")
        raise ConfigError(f"--experts-shared-outer-loras shares the experts' outer LoRA factors, but {what}; drop "
                          "the flag, or target gate_proj,up_proj,down_proj on a MoE model.")
    if ("text_config" in c or "vision_config" in c) and c.get("model_type") not in VLM_MODEL_TYPES:
        raise ConfigError(f"--lora-rank with the vision-language --hf-checkpoint {c.get('model_type')} is not "
                          f"supported by the FSDP backend (its LoRA adapts the text model of {', '.join(VLM_MODEL_TYPES)}"
                          "); drop --lora-rank.")
    check_dsv4(spec, model_type)
    if text.get("kv_lora_rank") and model_type not in MLA_MODEL_TYPES:
        raise ConfigError(f"--lora-rank on the multi-latent-attention model {model_type} is not supported by the FSDP "
                          f"backend (its LoRA adapts the MLA of {', '.join(MLA_MODEL_TYPES)}); add --train-backend "
                          "megatron.")


def check_dsv4(spec: LoraSpec, model_type: str | None) -> None:
    """DeepSeek-V4: LoRA adapts its MoE layers' routed and shared experts (``gate_proj`` / ``up_proj`` /
    ``down_proj``) on both backends; its attention (``q_a_proj``, ``q_b_proj``, ``kv_proj``, the grouped
    ``o_a_proj``, ``o_b_proj``) is no target on either, so targets without an MLP are refused in one line."""
    if model_type == "deepseek_v4" and not {"linear_fc1", "linear_fc2"} & set(spec.targets):
        raise ConfigError(f"--target-modules {','.join(spec.targets)} selects nothing on DeepSeek-V4: its attention "
                          "(q_a_proj, q_b_proj, kv_proj, o_a_proj, o_b_proj) is no LoRA target on either backend; "
                          "target gate_proj,up_proj,down_proj (the routed and shared experts) or all-linear.")


def attach_hf(hf: nn.Module, layers, spec: LoraSpec, *, seed: int) -> HFLoraAdapters:
    """Freeze ``hf`` and hook the adapters onto the target linears of each decoder layer in ``layers``; fp32
    adapters on the layers' device."""
    lora = HFLoraAdapters(spec)
    for p in hf.parameters():
        p.requires_grad_(False)
    for i, layer in enumerate(layers):
        mla = isinstance(getattr(getattr(layer, "self_attn", None), "kv_a_proj_with_mqa", None), nn.Linear)
        for target in spec.targets:
            for parent_name, members, middle in GDN_GROUPS.get(target, ()):    # the one layout the layer has
                _attach_group(lora, layer, i, target, parent_name, members, middle, seed)
            group = GROUPS.get(target) or (MLA_GROUPS.get(target) if mla else None)
            if group is None:                 # e.g. MLA's names on standard attention: no such linear
                continue
            for parent_name, members, middle in (group, *SHARED_EXPERTS.get(target, ())):
                _attach_group(lora, layer, i, target, parent_name, members, middle, seed)
        _attach_experts(lora, layer, i, seed)
    if not lora.groups and not lora.pairs:
        raise ConfigError(f"--target-modules: no linear of the model matches {list(spec.targets)}.")
    return lora


def decoder_layers(lm: nn.Module) -> tuple[nn.ModuleList, str]:
    """The decoder layers of a causal LM (``model.layers``) or of a vision-language model's text model
    (``model.language_model.layers``) and their parameters' name prefix."""
    inner = lm.model
    if getattr(inner, "language_model", None) is not None and not hasattr(inner, "layers"):
        return inner.language_model.layers, "model.language_model.layers."
    return inner.layers, "model.layers."


def attach_hf_model(lm: nn.Module, spec: LoraSpec, *, seed: int) -> HFLoraAdapters:
    """``attach_hf`` on ``lm``'s decoder layers (``decoder_layers``), the adapted weights' HF names under their
    prefix (a vision-language model's ``model.language_model.layers.L...``: what the export and ``peft_tensors``
    name); the adapters' Megatron names as the text model's (``decoder.layers.L...``), as the Megatron backend's."""
    layers, prefix = decoder_layers(lm)
    lora = attach_hf(lm, layers, spec, seed=seed)
    if prefix != "model.layers.":
        lora.hf = {prefix + k.removeprefix("model.layers."): v for k, v in lora.hf.items()}
        lora.fused = {prefix + k.removeprefix("model.layers."): v for k, v in lora.fused.items()}
    return lora


def _attach_group(lora: HFLoraAdapters, layer: nn.Module, i: int, target: str, parent_name: str,
                  members: tuple[str, ...], middle: str, seed: int) -> None:
    """One dense target of decoder layer ``i`` (its HF linears under ``layer.<parent_name>``), when it has them."""
    spec = lora.spec
    parent = layer
    for part in parent_name.split("."):
        parent = getattr(parent, part, None)
    mods = {m: getattr(parent, m, None) for m in members}
    if parent is None or any(not isinstance(m, nn.Linear) for m in mods.values()):
        return
    w = next(iter(mods.values())).weight
    mname = f"decoder.layers.{i}.{middle}.{target}"
    group = HFLoraGroup(_init_a(spec.rank, w.shape[1], seed, mname).to(w.device),
                        {m: mod.weight.shape[0] for m, mod in mods.items()}, spec.rank)
    lora.groups[mname.replace(".", "/")] = group
    for m, mod in mods.items():
        lora.hf[f"model.layers.{i}.{parent_name}.{m}.weight"] = (group, m)
        mod.register_forward_hook(_hook(spec, group, m, len(mods)))


@dataclass
class FusedExperts:
    """One fused expert tensor's adapters: its experts' pairs in expert order; ``rows``: the permutation of fc1's
    Megatron ``B`` rows ([gate; up]) into the tensor's (gpt-oss interleaves gate and up), None when they agree;
    ``transposed``: the tensor holds each expert as [in, out] (gpt-oss)."""
    pairs: list[LoraPair]
    rows: torch.Tensor | None
    transposed: bool

    def b(self, e: int) -> torch.Tensor:
        """Expert ``e``'s ``B`` with its rows in the fused tensor's output order."""
        b = self.pairs[e].lora_B
        return b if self.rows is None else b[self.rows]

    def delta(self, scale: float) -> torch.Tensor:
        """(alpha / r) B_e @ A_e of every expert, stacked in the fused tensor's layout."""
        d = torch.stack([self.b(e).float() @ p.lora_A.float() for e, p in enumerate(self.pairs)]) * scale
        return d.transpose(1, 2) if self.transposed else d


def _attach_experts(lora: HFLoraAdapters, layer: nn.Module, i: int, seed: int) -> None:
    """The routed experts of decoder layer ``i`` in transformers' fused layout (``mlp.experts.gate_up_proj`` [E, 2I,
    H] and ``down_proj`` [E, H, I]; gpt-oss: [E, H, 2I] with gate and up interleaved column by column, [E, I, H], and
    biases): one ``LoraPair`` per expert and target, drawn as the Megatron backend draws them (``lora._expert_pair``:
    the seed and the expert's Megatron name, the shared outer factors per layer; fc1's ``B`` rows [gate; up] as
    Megatron's ``linear_fc1``); the module's forward becomes ``_experts_forward`` (the same loop over the hit
    experts, each linear plus its adapter)."""
    spec = lora.spec
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    chosen = [t for t in ("linear_fc1", "linear_fc2") if t in spec.targets]
    if experts is None or not chosen or not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return
    concatenated, transposed = getattr(experts, "is_concatenated", True), getattr(experts, "is_transposed", False)
    layout = (concatenated, transposed, getattr(experts, "has_bias", False), getattr(experts, "has_gate", True),
              getattr(experts, "has_post_expert_norm", False))
    if layout not in ((True, False, False, True, False), (False, True, True, True, False)):
        raise ConfigError(f"--target-modules {','.join(chosen)} on the MoE experts of {type(experts).__name__} "
                          f"(expert layout {layout}: concatenated, transposed, bias, gate, post-norm) is not supported "
                          "by the FSDP LoRA; add --train-backend megatron, or target q_proj,k_proj,v_proj,o_proj.")
    per_target: dict[str, FusedExperts] = {}
    for target in chosen:
        w = getattr(experts, FUSED[target])
        out_f, in_f = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
        rows = None
        if target == "linear_fc1" and not concatenated:          # HF column 2j: gate j, 2j + 1: up j
            half = out_f // 2
            rows = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1).to(w.device)
        pairs = []
        for e in range(w.shape[0]):
            gname = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{target}"
            pair = _expert_pair(lora, spec, target, gname, gname, gname, out_f, in_f, seed, w.device)
            lora.pairs[gname.replace(".", "/")] = pair
            pairs.append(pair)
        lora.fused[f"model.layers.{i}.mlp.experts.{FUSED[target]}"] = per_target[target] = FusedExperts(
            pairs, rows, transposed)
    experts.forward = _experts_forward(experts, spec, per_target.get("linear_fc1"), per_target.get("linear_fc2"))


def _experts_forward(experts: nn.Module, spec: LoraSpec, fc1: FusedExperts | None, fc2: FusedExperts | None):
    """transformers' eager fused-experts forward (each hit expert's tokens through ``down(gate_fn(gate, up))``, with
    the module's own ``_apply_gate``, weighted and summed in expert order) with each expert's adapter added to its
    linear's output: ``W_e x (+ b_e) + (alpha / r) B_e (A_e dropout(x))``, as the Megatron backend's hook on each
    SequentialMLP expert's linear."""
    transposed = getattr(experts, "is_transposed", False)
    bias = getattr(experts, "has_bias", False)

    def adapted(x: torch.Tensor, name: str, e: int, fused: FusedExperts | None) -> torch.Tensor:
        w = getattr(experts, name)[e]
        y = x @ w if transposed else nn.functional.linear(x, w)
        if bias:
            y = y + getattr(experts, name + "_bias")[e]
        if fused is None:
            return y
        xd = nn.functional.dropout(x, p=spec.dropout) if spec.dropout > 0 and experts.training else x
        h = nn.functional.linear(xd, fused.pairs[e].lora_A.to(x.dtype))
        return y + (nn.functional.linear(h, fused.b(e).to(x.dtype)) * spec.scale).to(y.dtype)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, *, router_indices: torch.Tensor | None = None,
                routing_weights: torch.Tensor | None = None) -> torch.Tensor:       # gpt-oss: router_indices=...
        index = top_k_index if top_k_index is not None else router_indices
        weights = top_k_weights if top_k_weights is not None else routing_weights
        num = experts.gate_up_proj.shape[0]
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(index, num_classes=num + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == num:
                continue
            pos, tok = torch.where(mask[e])
            gate_up = adapted(hidden_states[tok], "gate_up_proj", e, fc1)
            y = adapted(experts._apply_gate(gate_up), "down_proj", e, fc2)
            out.index_add_(0, tok, (y * weights[tok, pos, None]).to(out.dtype))
        return out

    return forward


def _hook(spec: LoraSpec, group: HFLoraGroup, member: str, n: int):
    def hook(module: nn.Module, args, output):
        x = args[0]
        cached = group._cache
        if cached is not None and cached[0] is x:
            h = cached[1]
        else:
            xd = nn.functional.dropout(x, p=spec.dropout) if spec.dropout > 0 and module.training else x
            h = nn.functional.linear(xd, group.lora_A.to(x.dtype))
            cached = (x, h, n)
        left = cached[2] - 1
        group._cache = (x, h, left) if left > 0 else None
        d = nn.functional.linear(h, group.lora_B[member].to(x.dtype)) * spec.scale
        return output + d.to(output.dtype)

    return hook


@torch.no_grad()
def finish_grads(lora: HFLoraAdapters, group: dist.ProcessGroup | None, world: int) -> None:
    """Average the adapters' gradients over the trainer group (a missing gradient becomes zero first)."""
    params = list(lora.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if world > 1:
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        dist.all_reduce(flat, group=group)
        flat /= world
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(piece.view_as(p.grad))


def merge_buckets(lora: HFLoraAdapters, buckets: Iterator[list[tuple[str, torch.Tensor]]],
                  dtype: torch.dtype | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets gathered in the parameters' own dtype, the targets merged (``(W.float() + delta).to(W.dtype)``, as
    the Megatron backend's ``lora.merged``), then cast to ``dtype``."""
    for bucket in buckets:
        out = []
        for name, t in bucket:
            if name in lora.hf or name in lora.fused:
                t = (t.float() + lora.delta(name).to(t.device)).to(t.dtype)
            out.append((name, t.to(dtype) if dtype is not None else t))
        yield out


def peft_tensors(lora: HFLoraAdapters) -> list[tuple[str, torch.Tensor]]:
    """The adapters in HF PEFT names, as the Megatron backend writes them (each HF linear with the shared ``A``)."""
    out = []
    for hf, (group, member) in lora.hf.items():
        module = "base_model.model." + hf.removesuffix(".weight")
        out += [(module + ".lora_A.weight", group.lora_A.detach().float().cpu().clone()),
                (module + ".lora_B.weight", group.lora_B[member].detach().float().cpu().clone())]
    for fused, experts in lora.fused.items():        # per-expert linears (fc1: gate rows, up rows), as Megatron's
        for e, pair in enumerate(experts.pairs):
            out += expert_peft_tensors(fused, e, pair.lora_A.detach().float().cpu(), pair.lora_B.detach().float().cpu(),
                                       gate_up=fused.endswith("gate_up_proj"))
    return out
