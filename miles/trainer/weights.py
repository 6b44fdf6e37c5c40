"""Gather full parameters from FSDP2 shards, bucket by bucket, in lockstep on the trainer group.

FSDP2 shards every parameter on dim 0 like ``torch.chunk``: with ``c = ceil(d0 / W)`` rank r holds
rows ``[r c, min((r + 1) c, d0))`` (possibly none). For a bucket, each rank lays its shards out
padded to ``c`` rows in one flat buffer, one ``all_gather_into_tensor`` gathers the bucket, and the
full tensors are views cut out of the result. The generator issues the gather of bucket k+1
before it yields bucket k, so a caller that sends bucket k (to engines, to disk) overlaps with
the next gather; at most two buckets are alive.

Every trainer rank must iterate to the end (the gathers are collectives on the trainer group);
every rank receives the full tensors, on the trainer's device.

``iter_checkpoint_buckets`` applies a ``miles.weight_sync.hf_layout.CheckpointLayout`` (transformers 5's load-time
conversion reverted: renames such as Nemotron-H's ``model.*`` -> ``backbone.*``, fused MoE expert tensors -> the
checkpoint's per-expert names and shapes, as views into the gathered bucket): what HF checkpoints, SGLang's loaders
and the Megatron backend's export use. The bucket plan (``miles.weight_sync.buckets``) and the layout live in the
weight plane (which imports nothing of the trainer; the trainer imports them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from miles.utils.process_groups import wait_timeout_message
from miles.weight_sync.buckets import plan_buckets
from miles.weight_sync.hf_layout import CheckpointLayout

Bucket = list[tuple[str, torch.Tensor]]
T = TypeVar("T")
P = TypeVar("P")
R = TypeVar("R")


def _local_and_rows(p: torch.Tensor, world: int) -> tuple[torch.Tensor, int, bool]:
    """(local shard, padded rows per rank, is_sharded) for a parameter."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(p, DTensor):
        placements = p.placements
        if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0 and world > 1:
            d0 = p.shape[0]
            return p.to_local(), -(-d0 // world), True
        return p.full_tensor() if world > 1 else p.to_local(), 0, False
    return p.detach(), 0, False


class _Pending:
    def __init__(self, bucket: Bucket, out: torch.Tensor | None, work, layout, ready: Bucket | None):
        self.bucket, self.out, self.work, self.layout, self.ready = bucket, out, work, layout, ready


def _start(bucket: Bucket, group: dist.ProcessGroup, world: int, device: torch.device,
           dtype: torch.dtype | None) -> _Pending:
    layout, pieces, ready = [], [], []
    sharded_any = False
    for name, p in bucket:
        local, rows, sharded = _local_and_rows(p, world)
        dt = dtype or p.dtype
        if not sharded:
            ready.append((name, local.to(device=device, dtype=dt)))
            layout.append((name, None))
            continue
        sharded_any = True
        rest = tuple(p.shape[1:])
        per_row = 1
        for s in rest:
            per_row *= s
        buf = torch.zeros(rows * per_row, dtype=dt, device=device)
        flat = local.detach().reshape(-1).to(device=device, dtype=dt)
        buf[: flat.numel()] = flat
        pieces.append(buf)
        layout.append((name, (tuple(p.shape), rows, per_row)))
    if not sharded_any:
        return _Pending(bucket, None, None, layout, ready)
    send = torch.cat(pieces)
    out = torch.empty(world * send.numel(), dtype=send.dtype, device=device)
    work = dist.all_gather_into_tensor(out, send, group=group, async_op=True)
    return _Pending(bucket, out, work, layout, ready)


def _finish(pend: _Pending, group: dist.ProcessGroup, world: int, timeout: float) -> Bucket:
    if pend.work is not None:
        ok = pend.work.wait(timeout=timedelta(seconds=timeout))
        if ok is False:
            raise TimeoutError(wait_timeout_message("gathering weights", group, timeout, size=world))
    ready = iter(pend.ready or [])
    gathered = pend.out.view(world, -1) if pend.out is not None else None
    result: Bucket = []
    offset = 0
    for name, info in pend.layout:
        if info is None:
            result.append(next(ready))
            continue
        shape, rows, per_row = info
        n = rows * per_row
        full = gathered[:, offset:offset + n].reshape(world * rows, *shape[1:])[: shape[0]]
        result.append((name, full))
        offset += n
    return result


@torch.no_grad()  # per resumption (torch wraps generators): never left off while the caller runs
def iter_full_params(
    module: nn.Module, *, group: dist.ProcessGroup, device: torch.device, bucket_bytes: int,
    dtype: torch.dtype | None = None, name_fn: Callable[[str], str] = lambda n: n, timeout: float = 600.0,
    prefetch: bool = True, together: Callable[[str], Hashable | None] | None = None,
) -> Iterator[Bucket]:
    """Yield buckets of (name_fn(name), full tensor) in ``module.named_parameters()`` order (``together``: see
    ``plan_buckets``)."""
    world = dist.get_world_size(group)
    named = [(name_fn(n), p) for n, p in module.named_parameters()]
    buckets = plan_buckets(named, bucket_bytes, dtype, together)
    yield from iter_prefetched(buckets, lambda b: _start(b, group, world, device, dtype),
                               lambda pend: _finish(pend, group, world, timeout), prefetch)


def iter_prefetched(buckets: list[T], start: Callable[[T], P], finish: Callable[[P], R],
                    prefetch: bool = True) -> Iterator[R]:
    """``finish(start(b))`` for each bucket in order; with ``prefetch`` bucket k+1 is started (its gathers
    issued) before bucket k is finished and yielded, otherwise after the caller resumes."""
    if not buckets:
        return
    pending = start(buckets[0])
    for k in range(len(buckets)):
        nxt = start(buckets[k + 1]) if (prefetch and k + 1 < len(buckets)) else None
        result = finish(pending)
        yield result
        del result
        if nxt is None and k + 1 < len(buckets):
            nxt = start(buckets[k + 1])
        pending = nxt


def checkpoint_tensor_names(hf_dir: str | Path) -> frozenset[str]:
    """The tensor names in the ``*.safetensors`` files of an HF model dir (headers only; empty when none)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            names.update(h.keys())
    return frozenset(names)


def checkpoint_tensors(hf_dir: str | Path, keep: Callable[[str], bool]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of an HF model dir's ``*.safetensors`` whose names ``keep`` selects, as stored (dtype included),
    read one by one (the others are never loaded)."""
    from safetensors import safe_open

    out: list[tuple[str, torch.Tensor]] = []
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.extend((k, h.get_tensor(k)) for k in h.keys() if keep(k))
    return out


def iter_checkpoint_buckets(buckets: Iterable[Bucket], layout: CheckpointLayout) -> Iterator[Bucket]:
    """``layout.revert`` applied bucket by bucket (the gathers of ``buckets`` keep their lockstep)."""
    for bucket in buckets:
        yield layout.revert(bucket)
