"""megatron-core parameters -> full HF tensors, bucket by bucket (the weight sync and ``--save-hf``).

Buckets follow ``named_parameters()`` order and are sized by the full (gathered) tensors. For a bucket
each rank casts its TP shards (to ``dtype`` when given), packs them into one flat buffer and one
``all_gather_into_tensor`` over the TP group returns every rank's shards; they are joined
(``convert.unshard``) and converted to HF names and shapes (``convert.megatron_to_hf``: qkv split into
q/k/v, fc1 into gate/up, vocabulary padding cut). The cast precedes the gather and the conversion is
slicing only, so the tensors equal what the FSDP backend sends for the same weights, bit for bit.
The gather of bucket k+1 is issued before bucket k is yielded. Every trainer rank iterates to the end
and receives the full tensors (each data-parallel replica gathers within its own TP group).

Pipeline parallelism (``stage``): the buckets are planned over every stage's parameters in model order
(layers by their global index, the last stage's copy of a tied embedding left out), so they are the buckets
of one stage; each stage gathers its own TP shards (and, under expert parallelism, its experts over the EP group:
``moe.start_units``) and converts them, then broadcasts its part of the bucket over the pipeline group, so every
rank of every stage receives the whole bucket, bit for bit as with one stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from miles.trainer.collectives import bounded_all_gather_object
from miles.trainer.megatron.convert import megatron_to_hf, partition_dim, unshard
from miles.trainer.megatron.model import ModelShape
from miles.trainer.megatron.parallel import Groups
from miles.trainer.weights import iter_prefetched
from miles.utils.process_groups import wait_timeout_message

Bucket = list[tuple[str, torch.Tensor]]
T = TypeVar("T")


def pack(items: Iterable[T], nbytes: Callable[[T], int], bucket_bytes: int) -> list[list[T]]:
    """``items`` in order, in groups of at most ``bucket_bytes`` (by ``nbytes``; an item larger than that is a
    group of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes (--update-weight-buffer-size).")
    out: list[list[T]] = []
    cur: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += n
    if cur:
        out.append(cur)
    return out


def plan(named: list[tuple[str, torch.Tensor]], tp: int, bucket_bytes: int,
         dtype: torch.dtype | None) -> list[list[tuple[str, torch.Tensor]]]:
    """Groups of (megatron name, local parameter), each at most ``bucket_bytes`` of full tensors."""
    return pack(named, lambda np: np[1].numel() * (tp if partition_dim(np[0]) is not None else 1)
                * (dtype or np[1].dtype).itemsize, bucket_bytes)


class _Pending:
    def __init__(self, bucket, out, work, send_numel):
        self.bucket, self.out, self.work, self.send_numel = bucket, out, work, send_numel


def _start(bucket, groups: Groups, device: torch.device, dtype: torch.dtype | None) -> _Pending:
    tp = groups.tp_size
    sharded = [p.detach().to(device=device, dtype=dtype or p.dtype).reshape(-1) for n, p in bucket
               if tp > 1 and partition_dim(n) is not None]
    if not sharded:
        return _Pending(bucket, None, None, 0)
    if len({t.dtype for t in sharded}) > 1:          # one buffer per bucket: cast them all alike
        sharded = [t.float() for t in sharded]
    send = torch.cat(sharded)
    out = torch.empty(tp * send.numel(), dtype=send.dtype, device=device)
    work = dist.all_gather_into_tensor(out, send, group=groups.tp, async_op=True)
    return _Pending(bucket, out, work, send.numel())


def _finish(pend: _Pending, groups: Groups, shape: ModelShape, device: torch.device, dtype: torch.dtype | None,
            timeout: float) -> Bucket:
    return [pair for pairs in _finish_each(pend, groups, shape, device, dtype, timeout) for pair in pairs]


def _finish_each(pend: _Pending, groups: Groups, shape: ModelShape, device: torch.device, dtype: torch.dtype | None,
                 timeout: float) -> list[Bucket]:
    """The HF tensors of each parameter of the bucket, in bucket order."""
    if pend.work is not None and pend.work.wait(timeout=timedelta(seconds=timeout)) is False:
        raise TimeoutError(wait_timeout_message("gathering TP shards of the weights", groups.tp, timeout,
                                                size=groups.tp_size))
    tp = groups.tp_size
    gathered = pend.out.view(tp, -1) if pend.out is not None else None
    result: list[Bucket] = []
    offset = 0
    for name, p in pend.bucket:
        dim = partition_dim(name) if tp > 1 else None
        if dim is None:                              # an integer buffer (DeepSeek-V4's tid2eid) keeps its dtype
            full = p.detach().to(device=device, dtype=dtype if dtype is not None and p.is_floating_point() else p.dtype)
        else:
            n = p.numel()
            shards = [gathered[r, offset:offset + n].view(p.shape).to(dtype or p.dtype) for r in range(tp)]
            offset += n
            full = unshard(name, shards, dim, shape)
        result.append([(hf, t.contiguous()) for hf, t in megatron_to_hf(name, full, shape)])
    return result


@torch.no_grad()  # per resumption (torch wraps generators): never left off while the caller runs
def iter_hf_buckets(model: nn.Module, shape: ModelShape, groups: Groups, *, device: torch.device,
                    bucket_bytes: int, dtype: torch.dtype | None = None, timeout: float = 600.0,
                    prefetch: bool = True, stage=None, only: Callable[[str], bool] | None = None,
                    spelling: Callable[[str], str] | None = None) -> Iterator[Bucket]:
    """Yield buckets of (HF name, full tensor) (see module docstring); collective on the TP group (and the
    pipeline group of ``stage`` when it has more than one stage). ``only``: export just the parameters whose megatron
    name (under pipeline parallelism: with the global layer index, of any stage) it accepts (no buffers), e.g. the
    LoRA targets' weights (--lora-base-cpu-backup).
    ``spelling``: each HF name as the checkpoint spells it (``miles.weight_sync.hf_layout.checkpoint_spelling``)."""
    stream = _iter_hf_buckets(model, shape, groups, device=device, bucket_bytes=bucket_bytes, dtype=dtype,
                              timeout=timeout, prefetch=prefetch, stage=stage, only=only)
    transform = shape.family.export_stream        # e.g. gpt-oss: the experts' slices joined into HF's fused tensors
    stream = stream if transform is None else transform(stream, shape)
    yield from (stream if spelling is None else ([(spelling(n), t) for n, t in b] for b in stream))


def _exported(model: nn.Module, shape: ModelShape, only: Callable[[str], bool] | None) -> list:
    """(megatron name, tensor) of what the export sends: every parameter and the family's exported buffers, or the
    parameters ``only`` accepts."""
    if only is not None:
        return [(n, p) for n, p in model.named_parameters() if only(n)]
    return list(model.named_parameters()) + shape.family.exported_buffers(model)


def _iter_hf_buckets(model: nn.Module, shape: ModelShape, groups: Groups, *, device: torch.device,
                     bucket_bytes: int, dtype: torch.dtype | None, timeout: float, prefetch: bool,
                     stage, only: Callable[[str], bool] | None = None) -> Iterator[Bucket]:
    if stage is not None and stage.size > 1:
        yield from _iter_pipeline(model, shape, groups, stage, device=device, bucket_bytes=bucket_bytes,
                                  dtype=dtype, timeout=timeout, only=only)
        return
    if groups.ep_size > 1:                 # experts gathered over the EP group (moe.py)
        from miles.trainer.megatron.moe import iter_ep_buckets

        yield from iter_ep_buckets(model, shape, groups, device=device, bucket_bytes=bucket_bytes, dtype=dtype,
                                   timeout=timeout, prefetch=prefetch, named=_exported(model, shape, only))
        return
    buckets = plan(_exported(model, shape, only), groups.tp_size, bucket_bytes, dtype)
    yield from iter_prefetched(buckets, lambda b: _start(b, groups, device, dtype),
                               lambda pend: _finish(pend, groups, shape, device, dtype, timeout), prefetch)


def _stage_entries(model: nn.Module, shape: ModelShape, stage,
                   device: torch.device) -> list[tuple[int, str, torch.Tensor]]:
    """(stage, global megatron name, parameter) of every stage's exported parameters (and the family's exported
    buffers, after them, as with one stage) in model order: this stage's real tensors, the others' as meta tensors
    of their local (TP-shard) shape. Cached on the model (shapes never change); one object all-gather over the
    pipeline group the first time, bounded by the stage's timeout."""
    from miles.trainer.megatron.pipeline import global_exported_buffers, global_named_parameters, is_tied_copy

    mine = [(n, p) for n, p in global_named_parameters(model) if not is_tied_copy(p)] + global_exported_buffers(
        model, shape)
    meta = getattr(model, "_miles_pp_export_meta", None)
    if meta is None:
        local = [(n, tuple(p.shape), p.dtype) for n, p in mine]
        meta = bounded_all_gather_object(local, stage.group, stage.timeout, device,
                                         "gathering the stages' parameter shapes for the weight export")
        model._miles_pp_export_meta = meta
    own = dict(mine)
    return [(s, n, own[n] if s == stage.rank else torch.empty(shp, dtype=dt, device="meta"))
            for s, entries in enumerate(meta) for n, shp, dt in entries]


def _iter_pipeline(model, shape: ModelShape, groups: Groups, stage, *, device: torch.device, bucket_bytes: int,
                   dtype: torch.dtype | None, timeout: float,
                   only: Callable[[str], bool] | None = None) -> Iterator[Bucket]:
    from miles.trainer.megatron import moe
    from miles.trainer.megatron.pipeline import wait_all

    entries = _stage_entries(model, shape, stage, device)
    if only is not None:                   # every rank filters every stage's names alike: the same buckets
        entries = [(s, n, p) for s, n, p in entries if only(n)]
    owner = {n: s for s, n, _ in entries}
    units = moe.export_units([(n, p) for _, n, p in entries], groups)     # a layer's experts together (EP > 1)
    for bucket in pack(units, lambda unit: moe.unit_nbytes(unit, groups, dtype), bucket_bytes):
        mine = [unit for unit in bucket if owner[unit[0][0]] == stage.rank]
        local = moe.finish_units(moe.start_units(mine, groups, device, dtype), shape, groups, device, dtype,
                                 timeout) if mine else []
        result: Bucket = []
        for s in sorted({owner[unit[0][0]] for unit in bucket}):
            if s == stage.rank:
                part = local
            else:
                layout = [x for unit in bucket if owner[unit[0][0]] == s
                          for x in moe.unit_layout(unit, groups, shape, dtype)]
                part = [(hf, torch.empty(shp, dtype=dt, device=device)) for hf, shp, dt in layout]
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for _, t in part:
                by_dtype.setdefault(t.dtype, []).append(t)
            for same in by_dtype.values():         # one broadcast per dtype of the stage's part
                flat = torch.cat([t.reshape(-1) for t in same]) if s == stage.rank else torch.empty(
                    sum(t.numel() for t in same), dtype=same[0].dtype, device=device)
                src = dist.get_global_rank(stage.group, s)
                wait_all([dist.broadcast(flat, src=src, group=stage.group, async_op=True)], stage,
                         "broadcasting a weight bucket")
                if s != stage.rank:
                    for t, piece in zip(same, flat.split([t.numel() for t in same])):
                        t.copy_(piece.view(t.shape))
            result.extend(part)
        yield result
        del result
