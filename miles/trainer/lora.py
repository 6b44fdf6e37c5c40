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

So ``B @ A`` has W's local shape on every rank and ``merged`` adds it to the local shard: the export
gathers and converts merged weights exactly as it does base weights (HF names; the engines need no LoRA).

Target names (``--target-modules``, Miles's): ``all-linear`` or a comma list of HF names (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) or Megatron names
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``). Megatron fuses q/k/v and gate/up, so,
as in Miles's standard ``--lora-type lora``, any of q/k/v selects the fused ``linear_qkv`` (one ``A``, a
``B`` whose rows are q, k and v) and gate/up select ``linear_fc1``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miles.config.base import ConfigError
from miles.config.lora import MEGATRON_KIND, resolve_targets


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]        # Megatron module leaf names, sorted

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, train) -> LoraSpec | None:
        """The LoRA of a ``TrainConfig`` (None when ``--lora-rank`` is 0); refuses what it cannot train."""
        rank = int(getattr(train, "lora_rank", 0) or 0)
        if rank <= 0:
            return None
        return cls(rank=rank, alpha=float(train.lora_alpha), dropout=float(train.lora_dropout),
                   targets=resolve_targets(train.target_modules, getattr(train, "exclude_modules", None)))


class LoraPair(nn.Module):
    """``A`` [r, in_local] and ``B`` [out_local, r] of one target (module docstring for the TP split)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, kind: str):
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        self.kind = kind
        # under TP the sharded one: B of a column-parallel target, A of a row-parallel one
        self.sharded = self.lora_B if kind == "column" else self.lora_A


class LoraAdapters(nn.Module):
    """Every target's ``LoraPair`` (keys: the module name with '.' as '/'), plus what the hooks need."""

    def __init__(self, spec: LoraSpec, tp_size: int, tp_group: dist.ProcessGroup | None):
        super().__init__()
        self.spec, self.tp_size, self.tp_group = spec, tp_size, tp_group
        self.pairs = nn.ModuleDict()
        self.targets: dict[str, nn.Module] = {}        # name -> the base module (not registered here)

    def named_pairs(self) -> Iterator[tuple[str, LoraPair]]:
        for key, pair in self.pairs.items():
            yield key.replace("/", "."), pair

    def delta(self, name: str) -> torch.Tensor:
        """(alpha / r) * B @ A of target ``name``, W's local shape."""
        pair = self.pairs[name.replace(".", "/")]
        return (pair.lora_B.float() @ pair.lora_A.float()) * self.spec.scale

    def sharded_params(self) -> list[nn.Parameter]:
        return [p.sharded for _, p in self.named_pairs()]

    def replicated_params(self) -> list[nn.Parameter]:
        return [p.lora_A if p.kind == "column" else p.lora_B for _, p in self.named_pairs()]


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
           tp_group: dist.ProcessGroup | None = None, seed: int = 0) -> LoraAdapters:
    """Freeze every parameter of ``model`` and hook a LoRA pair onto each target linear (Megatron leaf names,
    modules holding ``weight``); returns the adapters (on the base weights' device, fp32)."""
    lora = LoraAdapters(spec, tp_size, tp_group)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in model.named_modules():
        leaf = _leaf(name)
        if leaf not in spec.targets or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        kind = MEGATRON_KIND[leaf]
        w = module.weight
        out_local, in_local = w.shape
        split = tp_size > 1
        in_full = in_local * tp_size if (split and kind == "row") else in_local
        a = _init_a(spec.rank, in_full, seed, name)
        if split and kind == "row":
            a = a.chunk(tp_size, dim=1)[tp_rank].clone()
        b = torch.zeros(out_local, spec.rank, dtype=torch.float32)
        pair = LoraPair(a.to(w.device), b.to(w.device), kind)
        lora.pairs[name.replace(".", "/")] = pair
        lora.targets[name] = module
        module.register_forward_hook(_hook(lora, pair))
    if not lora.targets:
        raise ConfigError(f"--target-modules: no module of the model matches {list(spec.targets)}.")
    return lora


def _hook(lora: LoraAdapters, pair: LoraPair):
    spec = lora.spec
    if lora.tp_size > 1:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
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
        if lora.tp_size > 1:
            h = (copy_to_tensor_model_parallel_region(h, group=lora.tp_group) if pair.kind == "column"
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
def finish_grads(lora: LoraAdapters, dp_group: dist.ProcessGroup | None, dp_size: int) -> None:
    """Average the adapters' gradients over data parallelism (TP needs nothing: the hooks' regions already
    leave every rank with its complete gradient); a missing gradient becomes zero first."""
    params = list(lora.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if dp_size > 1:
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
        flat /= dp_size
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(piece.view_as(p.grad))


@torch.no_grad()
def clip_grad_norm(lora: LoraAdapters, max_norm: float) -> float:
    """The L2 norm of the full adapters' gradients (TP shards summed, replicated ones counted once); scaled to
    ``max_norm`` when positive."""
    def sq(ps: list[nn.Parameter]) -> torch.Tensor:
        gs = [p.grad.float() for p in ps if p.grad is not None]
        return sum((g.square().sum() for g in gs), torch.zeros((), dtype=torch.float32, device=gs[0].device)
                   if gs else torch.zeros(()))

    local = sq(lora.sharded_params())
    if lora.tp_size > 1:
        dist.all_reduce(local, group=lora.tp_group)
    norm = (local + sq(lora.replicated_params()).to(local.device)).sqrt()
    params = [p for p in lora.parameters() if p.grad is not None]
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return float(norm)


def trainable_count(lora: LoraAdapters) -> int:
    """Adapter parameters of the whole model (TP shards summed, replicated ones once); collective on TP."""
    sharded = torch.tensor([float(sum(p.numel() for p in lora.sharded_params()))], dtype=torch.float64)
    if lora.tp_size > 1:
        dist.all_reduce(sharded, group=lora.tp_group)
    return int(sharded.item()) + sum(p.numel() for p in lora.replicated_params())


def state(lora: LoraAdapters, optimizer: torch.optim.Optimizer | None) -> dict:
    """This rank's adapter weights (and optimizer state) for a checkpoint."""
    out = {"spec": {"rank": lora.spec.rank, "alpha": lora.spec.alpha, "targets": list(lora.spec.targets)},
           "tp_size": lora.tp_size, "adapters": {k: v.detach().cpu().clone() for k, v in lora.state_dict().items()}}
    if optimizer is not None:
        out["optimizer"] = optimizer.state_dict()
    return out


def load_state(lora: LoraAdapters, optimizer: torch.optim.Optimizer | None, saved: dict, where: str) -> None:
    """Restore ``state``'s output; a checkpoint of another LoRA shape or TP size is refused in one line."""
    want = {"rank": lora.spec.rank, "alpha": lora.spec.alpha, "targets": list(lora.spec.targets)}
    if saved.get("spec") != want or saved.get("tp_size") != lora.tp_size:
        raise ConfigError(f"{where}: the checkpoint's LoRA ({saved.get('spec')}, TP {saved.get('tp_size')}) differs "
                          f"from this run's ({want}, TP {lora.tp_size}); resume with the same --lora-rank, "
                          "--lora-alpha, --target-modules and --tensor-model-parallel-size.")
    with torch.no_grad():
        for k, v in lora.state_dict().items():
            v.copy_(saved["adapters"][k].to(v.device))
    if optimizer is not None and "optimizer" in saved:
        optimizer.load_state_dict(saved["optimizer"])


def check_megatron(opts, shape, spec: LoraSpec) -> None:
    """Refuse the Megatron layouts LoRA is not built for (one line each)."""
    for flag, value, ok in (("--pipeline-model-parallel-size", opts.pp, opts.pp == 1),
                            ("--context-parallel-size", opts.cp, opts.cp == 1),
                            ("--expert-model-parallel-size", opts.ep, opts.ep == 1),
                            ("--sequence-parallel", "with --tensor-model-parallel-size > 1",
                             not (opts.sequence_parallel and opts.tp > 1)),
                            ("--lora-dropout", f"{spec.dropout} with --tensor-model-parallel-size > 1",
                             not (spec.dropout > 0 and opts.tp > 1))):
        if not ok:
            raise ConfigError(f"{flag} {value} is not supported with --lora-rank: LoRA runs under tensor and data "
                              "parallelism only; drop the flag or train without LoRA.")
    if shape.num_experts:
        raise ConfigError("--lora-rank: LoRA on MoE models is not supported (dense models only); train without LoRA.")


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
def full_pairs(lora: LoraAdapters) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Megatron module name -> (A, B) of the whole model (TP shards gathered; CPU fp32); collective on TP."""
    from miles.trainer.megatron.convert import unshard

    out = {}
    for name, pair in lora.named_pairs():
        a, b = pair.lora_A.detach().float(), pair.lora_B.detach().float()
        if lora.tp_size > 1:
            sh = pair.sharded.detach().float().contiguous()
            parts = [torch.empty_like(sh) for _ in range(lora.tp_size)]
            dist.all_gather(parts, sh, group=lora.tp_group)
            if pair.kind == "column":
                b = unshard(name + ".weight", parts, 0)        # linear_fc1's shards are [gate_r; up_r]
            else:
                a = torch.cat(parts, dim=1)
        out[name] = (a.cpu(), b.cpu())
    return out


def peft_tensors(lora: LoraAdapters, shape) -> list[tuple[str, torch.Tensor]]:
    """The adapters in HF PEFT names (``base_model.model.<HF module>.lora_A.weight`` / ``lora_B``): the fused
    linear_qkv / linear_fc1 become q/k/v and gate/up modules sharing ``A``, each with its rows of ``B``;
    collective on TP."""
    from miles.trainer.megatron.convert import megatron_to_hf

    out = []
    for name, (a, b) in full_pairs(lora).items():
        for hf, rows in megatron_to_hf(name + ".weight", b, shape):
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
    modules = sorted({k.rsplit(".", 3)[1] for k, _ in tensors})      # <prefix>.<module>.lora_X.weight
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "target_modules": modules, "bias": "none",
              "base_model_name_or_path": base, "fan_in_fan_out": False, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
