"""The LoRA adapters' training state (``miles.trainer.lora`` documents the design): gradient reductions over the
TP / EP / DP / PP groups (``finish_grads``), the gradient norm clip and the trainable count summed over the groups
that split the adapters, and checkpoints (``state`` / ``load_state``, ``save_files`` / ``load_files``: each rank's
adapters and AdamW state, the LoRA's shape recorded and checked on load)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from miles.config.base import ConfigError
from miles.trainer.lora_adapters import LoraAdapters, _leaf


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

