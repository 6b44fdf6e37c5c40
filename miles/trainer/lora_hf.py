"""LoRA on the FSDP backend (``--train-backend fsdp --lora-rank R``): the Megatron backend's adapters
(``miles.trainer.lora``) on the HF model's linears, with the same flags and the same math.

    spec = LoraSpec.from_config(cfg.train)
    check_fsdp(cfg, hf_config)                      # preflight: what the FSDP LoRA cannot train, one line each
    lora = attach_hf(hf_model, spec, seed=seed)     # base frozen, hooks on q/k/v/o and gate/up/down
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

Weights out: merged, as on Megatron: the export gathers the base weights in fp32 and adds ``(alpha / r) B @ A``
before the cast to the sync dtype, so the engines need no LoRA. Not here (refused in one line by ``check_fsdp``):
LoRA on MoE experts (transformers' fused 3-D expert tensors), ``--experts-shared-outer-loras``, checkpoints
(``--save`` / ``--load``) and vision-language models.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from miles.config.base import ConfigError
from miles.trainer.lora import LoraSpec, _init_a

# Megatron target -> (HF parent attribute of the decoder layer, its HF linears, the Megatron module name's middle)
GROUPS = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "self_attention"),
          "linear_proj": ("self_attn", ("o_proj",), "self_attention"),
          "linear_fc1": ("mlp", ("gate_proj", "up_proj"), "mlp"),
          "linear_fc2": ("mlp", ("down_proj",), "mlp")}


class HFLoraGroup(nn.Module):
    """One Megatron target on the HF model: ``A`` [r, in] shared by its HF linears, ``B`` [out_m, r] per linear."""

    def __init__(self, a: torch.Tensor, outs: dict[str, int], rank: int):
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.ParameterDict({m: nn.Parameter(torch.zeros(o, rank, device=a.device)) for m, o in
                                        outs.items()})
        self._cache: tuple | None = None          # (x, h, members left) of the current forward


class HFLoraAdapters(nn.Module):
    """Every target's ``HFLoraGroup`` (keys: the Megatron module name with '.' as '/'), and the HF weight name of
    each adapted linear -> (group, member)."""

    def __init__(self, spec: LoraSpec):
        super().__init__()
        self.spec = spec
        self.groups = nn.ModuleDict()
        self.hf: dict[str, tuple[HFLoraGroup, str]] = {}

    def delta(self, hf_weight: str) -> torch.Tensor:
        group, member = self.hf[hf_weight]
        return (group.lora_B[member].float() @ group.lora_A.float()) * self.spec.scale


def check_fsdp(cfg, hf_config: dict | None) -> None:
    """Preflight of ``--train-backend fsdp`` with ``--lora-rank``: refuse what the FSDP LoRA does not train."""
    spec = LoraSpec.from_config(cfg.train)
    if spec is None:
        return
    check_model(spec, hf_config)
    if cfg.weights.update_weight_transfer_mode == "p2p":
        raise ConfigError("--update-weight-transfer-mode p2p with --lora-rank is not supported by the FSDP backend "
                          "(it sends unmerged local shards); use the default transfer mode.")
    for flag, value in (("--save", cfg.checkpoint.save), ("--load", cfg.checkpoint.load)):
        if value:
            raise ConfigError(f"{flag} {value} with --lora-rank is not supported by the FSDP backend yet (its "
                              "checkpoint format holds the model's optimizer, not the adapters'); drop it, or use "
                              "--train-backend megatron (adapter checkpoints).")


def check_model(spec: LoraSpec, hf_config: dict | None) -> None:
    """The models the FSDP LoRA does not adapt (config.json as a dict), one line each."""
    c = hf_config or {}
    text = c.get("text_config") or c
    if spec.paths or spec.exclude_paths:
        raise ConfigError(f"--target-modules / --exclude-modules module paths ({','.join(spec.paths + spec.exclude_paths)}) "
                          "name Megatron-Bridge's modules: they select LoRA targets on the Megatron backend only; add "
                          "--train-backend megatron, or give names such as q_proj,k_proj,v_proj,o_proj.")
    if set(spec.targets) & {"in_proj", "out_proj"}:
        raise ConfigError("--target-modules in_proj/out_proj (the gated DeltaNet's projections) with --train-backend "
                          "fsdp: LoRA on them runs on the Megatron backend only; add --train-backend megatron.")
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0
    if experts and {"linear_fc1", "linear_fc2"} & set(spec.targets):
        raise ConfigError(f"--target-modules {','.join(spec.targets)} with --train-backend fsdp: LoRA on the MoE "
                          f"experts of this model ({experts} experts) runs on the Megatron backend only; add "
                          "--train-backend megatron, or target q_proj,k_proj,v_proj,o_proj.")
    if spec.experts_shared_outer:
        raise ConfigError("--experts-shared-outer-loras with --train-backend fsdp: LoRA on MoE experts runs on the "
                          "Megatron backend only; add --train-backend megatron or drop the flag.")
    if "text_config" in c or "vision_config" in c:
        raise ConfigError("--lora-rank with a vision-language --hf-checkpoint is not supported by the FSDP backend; "
                          "drop --lora-rank.")
    if text.get("kv_lora_rank"):
        raise ConfigError("--lora-rank on a multi-latent-attention model is not supported by the FSDP backend; use "
                          "--train-backend megatron.")


def attach_hf(hf: nn.Module, layers, spec: LoraSpec, *, seed: int) -> HFLoraAdapters:
    """Freeze ``hf`` and hook the adapters onto the target linears of each decoder layer in ``layers``; fp32
    adapters on the layers' device."""
    lora = HFLoraAdapters(spec)
    for p in hf.parameters():
        p.requires_grad_(False)
    for i, layer in enumerate(layers):
        for target in spec.targets:
            if target not in GROUPS:          # multi-latent attention's projections: no such linear here (an MLA
                continue                      # model is refused by check_model)
            parent_name, members, middle = GROUPS[target]
            parent = getattr(layer, parent_name, None)
            mods = {m: getattr(parent, m, None) for m in members}
            if parent is None or any(not isinstance(m, nn.Linear) for m in mods.values()):
                continue
            w = next(iter(mods.values())).weight
            mname = f"decoder.layers.{i}.{middle}.{target}"
            group = HFLoraGroup(_init_a(spec.rank, w.shape[1], seed, mname).to(w.device),
                                {m: mod.weight.shape[0] for m, mod in mods.items()}, spec.rank)
            lora.groups[mname.replace(".", "/")] = group
            for m, mod in mods.items():
                lora.hf[f"model.layers.{i}.{parent_name}.{m}.weight"] = (group, m)
                mod.register_forward_hook(_hook(spec, group, m, len(mods)))
    if not lora.groups:
        raise ConfigError(f"--target-modules: no linear of the model matches {list(spec.targets)}.")
    return lora


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
            if name in lora.hf:
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
    return out
