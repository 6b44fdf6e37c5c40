"""megatron-core's process groups over the trainer ranks, and the gradient collectives of a step.

    groups = init_parallel(tp_size=2, num_trainer_ranks=4, seed=1234, device=dev)   # once per process
    groups.tp, groups.dp          # tensor-parallel group (consecutive ranks), data-parallel group
    finish_grads(model, groups)   # after the last backward: TP sums where needed, DP average
    norm = clip_grad_norm(model, groups, max_norm)
    opt = distributed_adamw(model, groups, lr=1e-6, ...)   # --use-distributed-optimizer with DP > 1

Layout: megatron-core's ``tp-cp-ep-dp-pp`` order over trainer ranks ``0..n-1`` (``compat.trainer_world``),
so a TP group is ``tp_size`` consecutive ranks and data parallelism spans the rest of the trainer
group (not the world). Gradients: the parameters megatron-core splits over TP (``convert.partition_dim``)
hold their own shard's gradient; replicated ones are equal on every TP rank except the q/k layernorms
(each rank sees its own heads), whose gradients are summed over TP, as megatron-core's
``finalize_model_grads`` does; so are the norms of the sequence-parallel region under ``--sequence-parallel``
(parameters marked ``sequence_parallel``). Then every gradient is averaged over DP (the loss was scaled by the
DP size); with context parallelism (``cp_size > 1``) the CP ranks of a replica hold partial gradients (each
of its own chunks), so they are summed over DP x CP in one all-reduce and divided by the DP size, and the
sharded optimizer shards over DP x CP, as Megatron does. With pipeline parallelism (``pp_size > 1``, the
outermost axis: a stage is a block of ``n / pp`` consecutive ranks) each stage reduces its own parameters;
the two copies of a tied embedding (first and last stage) have their gradients summed over megatron-core's
embedding group first, and the gradient norm sums the stages (the last stage's copy counted once). MoE experts
under EP > 1 or TP > 1 (``moe.edp_reduced``) are summed over the expert-data-parallel group instead and divided
by the DP size (``moe.reduce_expert_grads``).

``--use-distributed-optimizer`` (ZeRO-1, Megatron's meaning): with DP > 1 the AdamW state is sharded over
the DP group by whole (TP-local) parameters (torch's ``ZeroRedundancyOptimizer``): each DP rank updates the
parameters it owns and broadcasts them; gradients are still averaged over DP first. Under expert parallelism the
DP ranks hold different experts, so the experts are sharded over the expert-DP group instead, in a second
ZeroRedundancyOptimizer (``ExpertShardedAdamW``), as megatron-core's distributed optimizer does. The broadcast after the
step is one flattened tensor per owner rank (and dtype, device; split at ``_SYNC_BUCKET_BYTES``), not torch's one
per parameter: each gloo collective is a fixed 1-2 ms on a small CPU host (issue 13). The bytes sent are the
same, so the weights are bit for bit torch's; state_dict/load_state_dict are torch's own. Not torch's
``parameters_as_bucket_view``: that makes every ``p.data`` a view of a bucket, and ``MasterWeights`` swaps
``p.data`` (fp32 masters, bf16 copies) twice a step, which would silently cut the parameters off their buckets.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from miles.config.base import ConfigError
from miles.trainer.megatron.convert import partition_dim
from miles.trainer.megatron.moe import edp_reduced, ep_sharded, expert_sq_norm, reduce_expert_grads


@dataclass(frozen=True)
class Groups:
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    pp: dist.ProcessGroup | None = None          # pipeline group (``pipeline.py``); None with one stage
    pp_rank: int = 0
    pp_size: int = 1
    mp: dist.ProcessGroup | None = None          # TP x PP: the ranks of one model replica (same samples)
    mp_size: int = 1
    cp: dist.ProcessGroup | None = None          # context-parallel group (``context_parallel.py``); None with CP 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_cp: dist.ProcessGroup | None = None       # DP x CP: gradients are reduced over it
    ep: dist.ProcessGroup | None = None          # expert-parallel group (moe.py); None with EP 1
    ep_rank: int = 0
    ep_size: int = 1
    edp: dist.ProcessGroup | None = None         # expert-data-parallel group: expert gradients reduced over it
    edp_size: int = 1


def init_parallel(*, tp_size: int, num_trainer_ranks: int, seed: int, device: torch.device, pp_size: int = 1,
                  timeout: float | None = None, cp_size: int = 1, ep_size: int = 1, etp_size: int = 1) -> Groups:
    """Create (or reuse, when already laid out the same way) megatron-core's groups; seed its RNG tracker.
    ``timeout`` (seconds) bounds every collective of the groups megatron-core creates."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from miles.trainer.megatron.compat import apply_cpu_compat, check_version, trainer_world

    check_version()
    if device.type != "cuda":
        apply_cpu_compat()
    if num_trainer_ranks % tp_size:
        raise ValueError(f"--tensor-model-parallel-size {tp_size} does not divide the {num_trainer_ranks} trainer "
                         "ranks; choose a divisor of --actor-num-nodes x --actor-num-gpus-per-node.")
    if num_trainer_ranks % (tp_size * pp_size):
        raise ValueError(f"--tensor-model-parallel-size {tp_size} x --pipeline-model-parallel-size {pp_size} does "
                         f"not divide the {num_trainer_ranks} trainer ranks; choose sizes whose product divides it.")
    if num_trainer_ranks % (tp_size * pp_size * cp_size):
        raise ConfigError(f"--tensor-model-parallel-size {tp_size} x --pipeline-model-parallel-size {pp_size} x "
                          f"--context-parallel-size {cp_size} does not divide the {num_trainer_ranks} trainer ranks; "
                          "choose sizes whose product divides --actor-num-nodes x --actor-num-gpus-per-node.")
    if ps.model_parallel_is_initialized():
        if ps.get_context_parallel_world_size() != cp_size:
            raise RuntimeError(f"megatron-core is already initialised with CP {ps.get_context_parallel_world_size()}, "
                               f"not {cp_size}.")
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp_size,
                                                                                                      pp_size):
            raise RuntimeError(f"megatron-core is already initialised with TP "
                               f"{ps.get_tensor_model_parallel_world_size()} x PP "
                               f"{ps.get_pipeline_model_parallel_world_size()}, not {tp_size} x {pp_size}.")
    else:
        kw = {"distributed_timeout_minutes": timeout / 60} if timeout else {}  # a timedelta(minutes=...): any float
        with trainer_world(num_trainer_ranks):
            ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
                                         context_parallel_size=cp_size, create_gloo_process_groups=False,
                                         expert_model_parallel_size=ep_size,
                                         expert_tensor_parallel_size=etp_size, **kw)
    model_parallel_cuda_manual_seed(seed)
    return Groups(tp=ps.get_tensor_model_parallel_group(), dp=ps.get_data_parallel_group(),
                  tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp_size,
                  dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                  pp=ps.get_pipeline_model_parallel_group() if pp_size > 1 else None,
                  pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp_size,
                  mp=ps.get_model_parallel_group(), mp_size=tp_size * pp_size,
                  cp=ps.get_context_parallel_group() if cp_size > 1 else None, cp_rank=ps.get_context_parallel_rank(),
                  cp_size=cp_size, dp_cp=ps.get_data_parallel_group(with_context_parallel=True) if cp_size > 1 else None,
                  ep=ps.get_expert_model_parallel_group() if ep_size > 1 else None,
                  ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep_size,
                  edp=ps.get_expert_data_parallel_group() if ep_size > 1 or tp_size > 1 else None,
                  edp_size=ps.get_expert_data_parallel_world_size())


def _coalesced_all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup, op) -> None:
    """All-reduce ``grads`` in one flat buffer per dtype. On gloo an AVG is a SUM, then a division of the flat
    buffer by the group size: gloo's own AVG computes the same bits (measured, 2 and 3 ranks) but took 3.7 ms
    against 2.1 for SUM on a 3.2 MB buffer over 2 CPU ranks."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    divide = op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo"
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM if divide else op, group=group)
        if divide:
            flat.div_(float(dist.get_world_size(group)))
        for g, synced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(synced)


def _tp_partial(name: str, mla: bool = False) -> bool:
    """Replicated parameters whose gradient is split over TP ranks (each rank sees its own heads): the per-head
    q/k layernorms, and the families' own (``Family.tp_partial``). Multi-latent attention's
    ``q_layernorm``/``kv_layernorm`` normalise the whole latent on every TP rank (complete gradients; under
    ``--sequence-parallel`` each rank's part of the sequence, summed as the other sequence-parallel norms are)."""
    from miles.trainer.megatron.families import tp_partial_parts

    if any(part in name for part in tp_partial_parts()):
        return True
    return not mla and (".q_layernorm." in name or ".k_layernorm." in name)


_SYNC_BUCKET_BYTES = 256 << 20     # per broadcast, and the flat copies in flight: the sync's extra memory


@functools.cache
def _zero_class() -> type:
    """``ZeroRedundancyOptimizer`` with a bucketed parameter sync (module docstring); built on first use, as
    ``torch.distributed.optim`` takes about a second to import."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class BucketedZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
        @torch.no_grad()
        def _sync_params(self) -> None:
            pending: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor], bool]] = []
            in_flight = 0

            def finish(work: dist.Work, flat: torch.Tensor, tensors: list[torch.Tensor], owned: bool) -> None:
                work.wait()
                if not owned:
                    torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))

            for rank, param_groups in enumerate(self._partition_parameters()):
                src = dist.get_global_rank(self.process_group, rank)
                for bucket in _sync_buckets([p for g in param_groups for p in g["params"]]):
                    tensors = [p.data for p in bucket]
                    flat = _flatten_dense_tensors(tensors)
                    work = dist.broadcast(flat, src=src, group=self.process_group, async_op=True)
                    pending.append((work, flat, tensors, rank == self.rank))
                    in_flight += flat.numel() * flat.element_size()
                    while len(pending) > 1 and in_flight > _SYNC_BUCKET_BYTES:   # at most ~2 buckets of copies
                        done = pending.pop(0)
                        in_flight -= done[1].numel() * done[1].element_size()
                        finish(*done)
            for done in pending:
                finish(*done)

    return BucketedZeroRedundancyOptimizer


def _sync_buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """One owner rank's parameters in broadcast buckets: same device and dtype, at most ``_SYNC_BUCKET_BYTES``
    each (a larger parameter alone); the order is the parameters', so every rank builds the same buckets."""
    open_: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    out: list[list[torch.Tensor]] = []
    for p in params:
        bucket, size = open_.setdefault((p.device, p.dtype), ([], [0]))
        nbytes = p.numel() * p.element_size()
        if bucket and size[0] + nbytes > _SYNC_BUCKET_BYTES:
            out.append(bucket[:])
            bucket.clear()
            size[0] = 0
        bucket.append(p)
        size[0] += nbytes
    return out + [bucket for bucket, _ in open_.values() if bucket]


def _zero_adamw(params: list[nn.Parameter], group: dist.ProcessGroup, *, lr: float, weight_decay: float,
                betas: tuple[float, float], eps: float, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    param_groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return _zero_class()(param_groups, optimizer_class=torch.optim.AdamW, process_group=group, lr=lr, betas=betas,
                         eps=eps, **kw)


def distributed_adamw(model: nn.Module, groups: Groups, *, lr: float, weight_decay: float,
                      betas: tuple[float, float], eps: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with its state sharded over the DP group (DP x CP with context parallelism; same parameter groups as
    ``optim.build_adamw``). Under expert parallelism the DP ranks hold different experts, so the experts' state is
    sharded over the expert-data-parallel group instead (the ranks holding the same experts), as megatron-core's
    distributed optimizer does: ``ExpertShardedAdamW``."""
    adam = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, device=device)
    dense_group = groups.dp_cp if groups.cp_size > 1 else groups.dp
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups.ep_size == 1:
        return _zero_adamw([p for _, p in named], dense_group, **adam)
    dense = [p for n, p in named if not ep_sharded(n, groups)]
    experts = [p for n, p in named if ep_sharded(n, groups)]
    return ExpertShardedAdamW(_zero_adamw(dense, dense_group, **adam), _zero_adamw(experts, groups.edp, **adam))


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (the inner one of a ZeroRedundancyOptimizer)."""
    return getattr(optimizer, "optim", optimizer)


class _LocalState:
    """The state and parameter groups of this rank's part of an ``ExpertShardedAdamW`` (``local_optimizer``)."""

    def __init__(self, parts: tuple[torch.optim.Optimizer, ...]):
        self._parts = parts

    @property
    def state(self) -> dict:
        return {p: st for o in self._parts for p, st in local_optimizer(o).state.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self._parts for g in local_optimizer(o).param_groups]


class ExpertShardedAdamW:
    """``--use-distributed-optimizer`` under expert parallelism: two sharded AdamWs, the dense parameters' over DP
    (x CP) and the experts' over the expert-DP group. ``param_groups`` (the LR schedule writes ``lr`` there),
    ``step`` and ``zero_grad`` are both parts'; ``optim`` (``local_optimizer``) holds this rank's state of both,
    keyed by parameter, so checkpoints save and load it as a ZeroRedundancyOptimizer's; a hook registered with
    ``register_step_post_hook`` (the run's progress line) runs once per ``step``, after both parts stepped."""

    def __init__(self, dense: torch.optim.Optimizer, experts: torch.optim.Optimizer):
        self.parts = (dense, experts)
        self.optim = _LocalState(self.parts)
        self._step_post_hooks: OrderedDict = OrderedDict()      # (weakly referenced by the hooks' handles)

    def register_step_post_hook(self, hook):
        """``torch.optim.Optimizer``'s: ``hook(self, args, kwargs)`` after each ``step``; returns its removable
        handle."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._step_post_hooks)
        self._step_post_hooks[handle.id] = hook
        return handle

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts for g in o.param_groups]

    def step(self, closure=None) -> None:
        for o in self.parts:
            o.step()
        for hook in list(self._step_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)


@torch.no_grad()
def finish_grads(model: nn.Module, groups: Groups) -> None:
    """Sum the TP-partial gradients over TP, then average every gradient over DP (collective).
    Parameters without a gradient get a zero one first, so every rank reduces the same tensors."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    mla = bool(getattr(getattr(model, "config", None), "multi_latent_attention", False))
    if groups.tp_size > 1:
        partial = [p.grad for n, p in named if _tp_partial(n, mla)]
        if partial:
            _coalesced_all_reduce(partial, groups.tp, dist.ReduceOp.SUM)
    tied = [p.grad for _, p in named if getattr(p, "shared_embedding", False)]
    if groups.pp_size > 1 and tied:        # tied embeddings over PP: the first and last stage's copies
        from megatron.core import parallel_state as ps

        _coalesced_all_reduce(tied, ps.get_embedding_group(), dist.ReduceOp.SUM)
    sequence_parallel = [p.grad for n, p in named if getattr(p, "sequence_parallel", False) and not _tp_partial(n, mla)
                         and not edp_reduced(n, groups)]
    if groups.tp_size > 1 and sequence_parallel:    # norms in the sequence-parallel region: each TP rank saw
        _coalesced_all_reduce(sequence_parallel, groups.tp, dist.ReduceOp.SUM)    # its part of the sequence
    if groups.cp_size > 1:      # CP ranks hold partial sums (their chunks): sum over DP x CP, average over DP
        grads = [p.grad for n, p in named if not edp_reduced(n, groups)]
        _coalesced_all_reduce(grads, groups.dp_cp, dist.ReduceOp.SUM)
        if groups.dp_size > 1:
            torch._foreach_div_(grads, float(groups.dp_size))
    elif groups.dp_size > 1:
        _coalesced_all_reduce([p.grad for n, p in named if not edp_reduced(n, groups)], groups.dp,
                              dist.ReduceOp.AVG)
    reduce_expert_grads(named, groups)      # EP > 1 or TP > 1: experts over expert-DP (moe.py)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, groups: Groups, max_norm: float) -> float:
    """Global L2 norm of the full model's gradients (TP shards summed, replicated ones once, PP stages summed,
    the last stage's copy of a tied embedding left out) and, when ``max_norm > 0``, scale them to it (torch's
    ``clip_grads_with_norm_`` rule)."""
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return 0.0
    counted = [(n, p) for n, p in named if not getattr(p, "shared", False)]
    sharded = [p.grad for n, p in counted if partition_dim(n) is not None]
    replicated = [p.grad for n, p in counted if partition_dim(n) is None and not ep_sharded(n, groups)]
    dev = named[0][1].grad.device

    def sq(gs: list[torch.Tensor]) -> torch.Tensor:
        if not gs:
            return torch.zeros((), dtype=torch.float32, device=dev)
        return torch.nn.utils.get_total_norm(gs, norm_type=2.0, foreach=True).float().square()

    local = sq(sharded)
    if groups.tp_size > 1:
        dist.all_reduce(local, group=groups.tp)
    total = local + sq(replicated) + expert_sq_norm(counted, groups, sq)
    if groups.pp_size > 1:
        dist.all_reduce(total, group=groups.pp)
    norm = total.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for _, p in named], max_norm, norm, foreach=True)
    return float(norm)
