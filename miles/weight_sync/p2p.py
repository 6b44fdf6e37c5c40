"""``--update-weight-transfer-mode p2p``: every trainer rank sends its own shard straight to the engines.

No trainer rank gathers anything. The weight-update group holds every trainer rank (group rank = trainer
rank ``r``, ``0..T-1``) and every engine worker (ranks ``T..``). Per bucket (the same buckets, in the same
order and with the same flattened byte layout as ``broadcast``), each trainer rank knows, from the FSDP2
placements alone, which rows of which tensor every rank holds: a dim-0 shard of rank ``r`` is one
contiguous byte range of the flattened bucket. Rank ``r`` packs its ranges into one buffer and sends it
with one point-to-point ``send`` to every engine worker (NCCL on GPU, gloo on CPU). The source rank
(trainer rank 0) posts ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"`` and
``p2p_ranges`` (per trainer rank, the ``[start, end)`` byte ranges it sends); the engine checks that the
ranges tile the bucket exactly, receives one buffer per trainer rank and assembles the bucket
(``miles.engine.weights.WeightGroups``), so the result is byte for byte what ``broadcast`` delivers.
Tensors that are not dim-0 sharded (replicated, other placements) are sent whole by rank 0.

Choreography across trainer ranks (every step bounded by ``--update-weight-timeout``):

1. the source decides whether this sync uses the current group, forms a new one (first sync, after
   ``reconnect``), or a temporary one (``sync_one``), and broadcasts that over the trainer group;
2. the group forms (every trainer rank joins; the source posts ``/init_weights_update_group`` to the
   engines), the source pauses the engines, and one all-reduce tells every trainer rank whether all of
   that worked before any byte moves;
3. every rank sends its buckets (``max_in_flight`` buckets outstanding); the source finishes the
   choreography. Failures after step 2 are reported by ``WeightSender.sync``'s agreement step.

``FSDPTrainer.iter_weight_shards`` (via :func:`iter_local_shards`) feeds this mode without any gather; a
trainer without it (Megatron) gives full tensors on every rank and each rank sends its dim-0 share. The
engine side must understand ``p2p_ranges`` (the embedded engine does; SGLang's server does not).
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles.utils.logging import get_logger
from miles.utils.net import host_address
from miles.weight_sync.base import Deadline, EngineTarget, SyncResult, WeightSyncError
from miles.weight_sync.broadcast import BroadcastSender
from miles.weight_sync.buckets import as_bytes, bucket_metadata, dtype_to_str, nbytes, plan_buckets
from miles.weight_sync.group import WeightGroup, WeightGroupError, connect_store, host_store
from miles.weight_sync.hf_layout import CheckpointLayout

logger = get_logger(__name__)

_HEADER_BYTES = 4096


@dataclass
class LocalShard:
    """One HF tensor of a bucket as this trainer rank holds it: the full shape and dtype, every rank's
    dim-0 row range ``splits[r] = (start, end)`` (all ranks compute the same), and this rank's rows."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    splits: list[tuple[int, int]]
    data: torch.Tensor        # this rank's rows, contiguous, in ``dtype`` (empty when it sends none)


def _splits(d0: int, world: int, sharded: bool) -> list[tuple[int, int]]:
    """FSDP2's dim-0 split (``torch.chunk``: ``c = ceil(d0 / world)`` rows per rank, the last ones shorter
    or empty), or everything on rank 0 for a tensor every rank holds whole."""
    if not sharded:
        return [(0, d0)] + [(d0, d0)] * (world - 1)
    c = -(-d0 // world)
    return [(min(r * c, d0), min((r + 1) * c, d0)) for r in range(world)]


def _local_shard(name: str, p: torch.Tensor, rank: int, world: int, device: torch.device,
                 dtype: torch.dtype | None) -> LocalShard:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dt = dtype or p.dtype
    shape = tuple(p.shape)
    d0 = shape[0] if shape else 1
    sharded = False
    if isinstance(p, DTensor):
        placements = p.placements
        if world > 1 and len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
            mesh = p.device_mesh
            if mesh.size() != world or mesh.get_local_rank() != rank:
                raise WeightSyncError(f"p2p weight sync: parameter {name!r} is sharded over a mesh of {mesh.size()} "
                                      f"(this rank's coordinate {mesh.get_local_rank()}), but the trainer group has "
                                      f"{world} ranks (this one {rank}): the shard owners would be wrong")
            local, sharded = p.to_local(), True
        elif all(isinstance(x, Replicate) for x in placements) or p.device_mesh.size() == 1:
            local = p.to_local()  # every rank (or the only one) holds it whole
        else:
            local = p.full_tensor()  # other layouts (HSDP, Shard(1)): collective; rank 0 sends it whole
    else:
        local = p.detach()
    splits = _splits(d0, world, sharded)
    start, end = splits[rank]
    if sharded and local.shape[0] != end - start:
        raise WeightSyncError(f"p2p weight sync: parameter {name!r} holds {local.shape[0]} rows on trainer rank {rank}, "
                              f"but the dim-0 split of {d0} rows over {world} ranks gives it {end - start}")
    if not sharded:
        local = local if rank == 0 else local.reshape(-1)[:0]
    data = local.detach().to(device=device, dtype=dt).contiguous()
    return LocalShard(name, shape, dt, splits, data)


@torch.no_grad()  # per resumption (torch wraps generators): never left off while the caller runs
def iter_local_shards(module: nn.Module, *, rank: int, world: int, bucket_bytes: int, dtype: torch.dtype | None,
                      device: torch.device, name_fn: Callable[[str], str] = lambda n: n,
                      layout: CheckpointLayout | None = None) -> Iterator[list[LocalShard]]:
    """This rank's part of every parameter, in the buckets ``broadcast`` uses (``plan_buckets`` over
    ``module.named_parameters()``), under the checkpoint's names and shapes (``revert_shards`` with ``layout``).
    Local only (no collective), except for parameters that are neither dim-0 sharded nor replicated: every
    trainer rank must then iterate to the end."""
    named = [(name_fn(n), p) for n, p in module.named_parameters()]
    together = layout.together if layout is not None else None
    for bucket in plan_buckets(named, bucket_bytes, dtype, together):
        shards = [_local_shard(n, p, rank, world, device, dtype) for n, p in bucket]
        yield revert_shards(shards, rank, layout) if layout is not None else shards


def revert_shards(bucket: list[LocalShard], rank: int, layout: CheckpointLayout) -> list[LocalShard]:
    """``CheckpointLayout.revert`` on this rank's shards: a tensor holding several checkpoint tensors (a fused expert
    tensor, dim 0 = the experts) becomes one shard per part, each rank holding the rows of the part that lie in its
    own rows. The parts follow each other in the tensor's byte order, so the flattened bucket and every rank's byte
    ranges (``plan_bucket``) are those of the in-memory tensor. A part that is not a run of whole rows of one
    contiguous byte range (a transpose) cannot be sent from shards: WeightSyncError, naming the tensor."""
    out: list[LocalShard] = []
    for s in bucket:
        parts = layout.parts.get(s.name)
        if s.name in layout.groups or s.name in layout.computed:
            raise WeightSyncError(f"p2p weight sync: {s.name!r} is converted to the checkpoint's layout by computing "
                                  "new tensors, which this rank's shard alone cannot give; use "
                                  "--update-weight-transfer-mode broadcast")
        if parts is None:
            out.append(s)
            continue
        row = _numel(s.shape[1:]) if s.shape else 1
        first = s.splits[rank][0] * row
        flat = s.data.reshape(-1)
        for p in parts:
            n = _numel(p.shape)
            prow = _numel(p.shape[1:]) if p.shape else n
            splits = []
            for a, b in s.splits:
                lo, hi = max(p.offset, a * row), min(p.offset + n, b * row)
                if hi <= lo:
                    splits.append((n // max(prow, 1),) * 2)
                    continue
                if not p.contiguous or (lo - p.offset) % prow or (hi - p.offset) % prow:
                    raise WeightSyncError(f"p2p weight sync: the checkpoint's {p.name!r} (shape {list(p.shape)}) is not "
                                          f"whole rows of one byte range of {s.name!r} on every trainer rank; use "
                                          "--update-weight-transfer-mode broadcast")
                splits.append(((lo - p.offset) // prow, (hi - p.offset) // prow))
            a, b = splits[rank]
            data = (flat[p.offset + a * prow - first: p.offset + b * prow - first].view(b - a, *p.shape[1:])
                    if b > a and p.shape else flat[p.offset - first:p.offset - first + 1].view(()) if b > a
                    else flat[:0])
            out.append(LocalShard(p.name, p.shape, s.dtype, splits, data))
    return out


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


@dataclass
class BucketPlan:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    ranges: list[list[list[int]]]   # per trainer rank: merged [start, end) byte ranges of the flattened bucket
    total: int


def plan_bucket(bucket: Sequence[LocalShard], world: int) -> BucketPlan:
    """Where every rank's rows land in the flattened bucket (``miles.weight_sync.buckets`` layout)."""
    names = [s.name for s in bucket]
    meta = bucket_metadata(names, [s.dtype for s in bucket], [s.shape for s in bucket])
    ranges: list[list[list[int]]] = [[] for _ in range(world)]
    for s, m in zip(bucket, meta):
        row = nbytes(s.shape[1:], s.dtype) if s.shape else int(m["numel"])
        for r, (a, b) in enumerate(s.splits):
            if b <= a:
                continue
            lo, hi = int(m["start_idx"]) + a * row, int(m["start_idx"]) + b * row
            if ranges[r] and ranges[r][-1][1] == lo:
                ranges[r][-1][1] = hi     # contiguous with this rank's previous piece: one range
            else:
                ranges[r].append([lo, hi])
    return BucketPlan(names, [dtype_to_str(s.dtype) for s in bucket], [list(s.shape) for s in bucket], ranges,
                      int(meta[-1]["end_idx"]) if meta else 0)


def pack_local(bucket: Sequence[LocalShard], device: torch.device) -> torch.Tensor:
    """This rank's rows of the bucket, concatenated in tensor order (the order of its ``ranges``)."""
    pieces = [s.data for s in bucket if s.data.numel()]
    out = torch.empty(sum(p.numel() * p.element_size() for p in pieces), dtype=torch.uint8, device=device)
    off = 0
    for p in pieces:
        n = p.numel() * p.element_size()
        out[off:off + n].copy_(as_bytes(p), non_blocking=True)
        off += n
    return out


def _wait(work: Any, seconds: float, what: str) -> None:
    if not work.wait(timedelta(seconds=max(0.001, seconds))):
        raise RuntimeError(f"{what} timed out after {seconds:.1f}s")


class P2PSender(BroadcastSender):
    """``--update-weight-transfer-mode p2p``: see the module docstring. All trainer ranks construct it with
    the trainer group as ``status_group`` (none with one trainer rank) and call ``sync`` together."""

    mode = "p2p"

    def __init__(self, cfg, source, *, status_group: Any = None, **kwargs: Any) -> None:
        if kwargs.pop("flatten", True) is not True:
            raise ValueError("p2p weight sync always sends flattened buckets (flatten=True)")
        super().__init__(cfg, source, status_group=status_group, **kwargs)
        if status_group is not None:
            self.trainer_rank, self.num_sources = dist.get_rank(status_group), dist.get_world_size(status_group)
        else:
            self.trainer_rank, self.num_sources = 0, 1
        if self.is_source != (self.trainer_rank == 0):
            raise ValueError(f"p2p weight sync: the source must be trainer rank 0 of status_group (this is rank "
                             f"{self.trainer_rank}, is_source={self.is_source})")
        self._store_clients: dict[tuple[str, int], Any] = {}

    # -- group membership: decided by the source, formed inside sync() on every trainer rank ---------------
    def connect(self, engines: Sequence[EngineTarget] | None = None) -> None:
        """Record the engines; the group forms in the next ``sync`` (collective on every trainer rank)."""
        if engines is not None:
            self.engines = list(engines)

    def reconnect(self, live_engines: Sequence[EngineTarget]) -> None:
        """Source: drop the current group (telling the live engines); the next ``sync`` forms a new one."""
        old = list(self._group_engines)
        self.engines = list(live_engines)
        if self.is_source:
            self._drop_group(notify=[e for e in old if e in self.engines])

    def _plan_group(self, engines: list[EngineTarget]) -> dict[str, Any]:
        if not engines:
            return {"op": "skip"}
        if self._group is not None and [e.url for e in engines] == [e.url for e in self._group_engines]:
            return {"op": "use", "name": self._group.name}
        if self._store is None:
            self._store = host_store(self.store_port, self.cfg.update_weight_timeout)
        self._formations += 1
        temp = [e.url for e in engines] != [e.url for e in self.engines]
        return {"op": "form", "temp": temp, "name": f"miles-weights-p2p-{self._formations}-{uuid.uuid4().hex[:8]}",
                "addr": self.master_addr or host_address(), "port": int(self._store.port),
                "world": self.num_sources + sum(e.num_workers for e in engines),
                "workers": sum(e.num_workers for e in engines)}

    def _trainer_device(self) -> torch.device:
        if self.status_group is not None and dist.get_backend(self.status_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _share(self, header: dict[str, Any], deadline: Deadline) -> dict[str, Any]:
        """The source's header to every trainer rank (one bounded broadcast on the trainer group)."""
        if self.status_group is None:
            return header
        buf = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
        if self.is_source:
            raw = json.dumps(header).encode()
            if len(raw) + 4 > _HEADER_BYTES:
                raise WeightSyncError(f"p2p header of {len(raw)} bytes does not fit {_HEADER_BYTES}")
            buf[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
            buf[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        t = buf.to(self._trainer_device())
        try:
            _wait(dist.broadcast(t, group_src=0, group=self.status_group, async_op=True), deadline.left(),
                  "sharing the p2p sync plan on the trainer group")
        except (RuntimeError, dist.DistError) as e:
            raise WeightSyncError(f"p2p weight sync: the trainer ranks could not agree on the plan: {e}") from e
        raw = bytes(t.cpu().tolist())
        return json.loads(raw[4:4 + int.from_bytes(raw[:4], "little")].decode())

    def _any_failed(self, failed: bool, deadline: Deadline) -> bool:
        """Whether any trainer rank failed so far (one bounded all-reduce on the trainer group)."""
        if self.status_group is None:
            return failed
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=self._trainer_device())
        try:
            _wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.status_group, async_op=True), deadline.left(),
                  "agreeing on the p2p group formation")
        except (RuntimeError, dist.DistError) as e:
            raise WeightSyncError(f"p2p weight sync: the trainer ranks could not agree on the group: {e}") from e
        return bool(int(flag.item()))

    def _join(self, header: dict[str, Any], engines: list[EngineTarget], deadline: Deadline) -> WeightGroup:
        """This rank's member of the group ``header`` names (forming it when asked)."""
        if header["op"] == "use":
            if self._group is None or self._group.name != header["name"]:
                raise WeightSyncError(f"p2p weight sync: trainer rank {self.trainer_rank} is not in group "
                                      f"{header['name']!r} (holds {self.group_name!r})")
            return self._group
        if self.is_source:
            if not header["temp"]:
                self._drop_group(notify=[e for e in self._group_engines if e in self.engines])
            group = self._form(engines, name=header["name"])
        else:
            if not header["temp"] and self._group is not None:
                old, self._group = self._group, None
                old.abort()
            key = (header["addr"], int(header["port"]))
            if key not in self._store_clients:
                self._store_clients[key] = connect_store(*key, timeout_s=deadline.left())
            try:
                if self.device is not None and self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                group = WeightGroup(header["name"], self._store_clients[key], self.trainer_rank, int(header["world"]),
                                    self.backend, timeout_s=deadline.left(), device=self.device)
            except WeightGroupError as e:
                raise WeightSyncError(f"trainer rank {self.trainer_rank}: {e}") from e
        if not header["temp"]:
            self._group, self._group_engines = group, list(engines)
        return group

    # -- one sync ----------------------------------------------------------------------------------------
    def _sync(self, engines: list[EngineTarget], version: int) -> SyncResult:
        result = SyncResult(self.mode, version, num_engines=len(engines))
        t_start = time.monotonic()
        deadline = Deadline(self.cfg.update_weight_timeout, f"weight sync v{version} (p2p)")
        header: dict[str, Any] = {"op": "skip"}
        err: BaseException | None = None
        if self.is_source:
            try:
                header = self._plan_group(engines)
            except (WeightSyncError, WeightGroupError, OSError, RuntimeError) as e:
                err, header = e, {"op": "fail"}
        header = self._share(header, deadline)
        if header["op"] in ("skip", "fail"):
            if err is not None:
                raise WeightSyncError(str(err)) from err
            result.total_s = time.monotonic() - t_start
            return result  # "fail": WeightSender.sync's agreement makes this rank raise too
        group: WeightGroup | None = None
        try:
            group = self._join(header, engines, deadline)
            if self.is_source:
                tc = time.monotonic()
                self.begin(engines, deadline)
                result.control_s += time.monotonic() - tc
        except (WeightSyncError, WeightGroupError, OSError, RuntimeError, ValueError) as e:
            err = e
        temp = group if header.get("temp") else None
        try:
            if self._any_failed(err is not None, deadline):  # nobody sends unless every rank is in the group
                if err is not None:
                    raise WeightSyncError(str(err)) from err
                return result
            self._send_all_p2p(group, engines, version, deadline, result)
            if self.is_source:
                tc = time.monotonic()
                self.finish(engines, version, deadline)
                result.control_s += time.monotonic() - tc
        except (WeightSyncError, WeightGroupError) as e:
            if temp is None:
                self._drop_stale()
            raise WeightSyncError(str(e)) from e
        finally:
            if temp is not None:
                temp.destroy()
            result.total_s = time.monotonic() - t_start
        return result

    def _agree(self, err: BaseException | None) -> None:
        """As the base, and when any rank failed every rank drops its group (the next sync forms a new one),
        so no rank is left holding a group the others gave up."""
        try:
            super()._agree(err)
        except WeightSyncError:
            self._drop_stale()
            raise

    def _drop_stale(self) -> None:
        """After a failure the group is unusable: the next sync forms a new one."""
        if self.is_source:
            self._drop_group(notify=[])
        elif self._group is not None:
            old, self._group = self._group, None
            old.abort()

    def iter_shards(self) -> Iterator[list[LocalShard]]:
        """The trainer's own shards (``iter_weight_shards``); a trainer without them (the Megatron backend:
        TP shards are not dim-0 row ranges of the HF tensor) gives full tensors on every rank
        (``iter_weight_buckets``), and each rank sends its dim-0 share of them: the gather stays, the
        sending is still spread over every trainer rank."""
        fn = getattr(self.source, "iter_weight_shards", None)
        if fn is not None:
            return fn(self.cfg.update_weight_buffer_size, self.dtype)
        return self._shares_of_full_buckets()

    def _shares_of_full_buckets(self) -> Iterator[list[LocalShard]]:
        world, rank = self.num_sources, self.trainer_rank
        for bucket in self.iter_buckets():
            out = []
            for name, t in bucket:
                splits = _splits(t.shape[0] if t.dim() else 1, world, t.dim() > 0)
                a, b = splits[rank]
                data = t[a:b] if t.dim() else (t if rank == 0 else t.reshape(-1)[:0])
                out.append(LocalShard(name, tuple(t.shape), t.dtype, splits, data.contiguous()))
            yield out

    def _send_all_p2p(self, group: WeightGroup, engines: list[EngineTarget], version: int, deadline: Deadline,
                      result: SyncResult) -> None:
        device = self.device or torch.device("cpu")
        world = int(group.world_size)
        dsts = list(range(self.num_sources, world))
        pending: collections.deque = collections.deque()  # (send works, engine futures, buffer, bytes)
        self._in_flight = collections.deque()
        sync_id, index = uuid.uuid4().hex[:12], 0  # the engines take the buckets in order, whatever their arrival
        failure: BaseException | None = None
        sent = 0

        def settle(keep: int) -> None:
            nonlocal sent
            while len(pending) > keep:
                works, futs, buf, _ = pending[0]
                t0 = time.monotonic()
                if futs is not None:
                    # the source waits for the engines' answers first: they come once an engine holds the whole
                    # bucket, and a refusal (400) arrives at once instead of a send waiting out the deadline
                    self.wait_all(engines, futs, deadline, "update_weights_from_distributed")
                    self._in_flight.popleft()
                for d, w in works:
                    _wait(w, deadline.left(), f"sending {buf.numel()} bytes to group rank {d}")
                if buf.is_cuda:
                    torch.cuda.current_stream(buf.device).synchronize()
                result.transfer_s += time.monotonic() - t0
                sent += buf.numel() * len(works)
                pending.popleft()

        it = self.iter_shards()
        while True:
            t0 = time.monotonic()
            bucket = next(it, None)
            if bucket is None:
                break
            if failure is not None:
                continue  # keep iterating: a non-dim-0 parameter is gathered collectively on every rank
            try:
                plan = plan_bucket(bucket, self.num_sources)
                buf = pack_local(bucket, device)
                if buf.numel() != sum(b - a for a, b in plan.ranges[self.trainer_rank]):
                    raise WeightSyncError(f"p2p weight sync: trainer rank {self.trainer_rank} packed {buf.numel()} bytes "
                                          f"but its ranges cover {sum(b - a for a, b in plan.ranges[self.trainer_rank])}")
                result.gather_s += time.monotonic() - t0
                result.num_buckets += 1
                result.num_tensors += len(plan.names)
                result.bytes += plan.total
                futs = None
                if self.is_source:
                    left = deadline.left()
                    futs = self.submit_all(engines, lambda c, p=plan, t=left, i=index: c.update_weights_from_distributed(
                        p.names, p.dtypes, p.shapes, group.name, load_format="flattened_bucket",
                        weight_version=str(version), flush_cache=False, timeout=t, p2p_ranges=p.ranges,
                        bucket_order=(sync_id, i)))
                    index += 1
                    self._in_flight.append((futs, len(plan.names)))
                works = [(d, dist.isend(buf, group_dst=d, group=group.pg)) for d in dsts] if buf.numel() else []
                pending.append((works, futs, buf, plan.total))
                settle(self.max_in_flight - 1)
            except (WeightSyncError, RuntimeError, dist.DistError) as e:
                failure = e
        if failure is None:
            try:
                settle(0)
            except (WeightSyncError, RuntimeError, dist.DistError) as e:
                failure = e
        result.extra["sent_bytes"] = float(sent)
        if failure is not None:
            if self.is_source:
                self._release_refusers(group.name, engines, deadline)
            group.abort()
            if not isinstance(failure, WeightSyncError):
                failure = WeightSyncError(f"p2p weight sync, trainer rank {self.trainer_rank}: group {group.name!r}: "
                                          f"{type(failure).__name__}: {failure} (a member died, or stalled past "
                                          f"--update-weight-timeout={deadline.seconds:g}s?)")
            raise self._name_suspects(failure, engines) if self.is_source else failure
        self._in_flight = collections.deque()

    def _release_refusers(self, name: str, engines: list[EngineTarget], deadline: Deadline) -> None:
        """Engines that answered a bucket with an error are alive and hold the group: have them destroy it,
        which closes their connections, so the other trainer ranks' sends to them fail now rather than at
        the deadline. Best effort: up to 5 s, within what is left of the sync's deadline but at least 1 s (after a
        stall the deadline is spent, and an engine still busy with its receive would hold the error path 6 s more)."""
        refused = [e for futs, _ in self._in_flight for e, f in zip(engines, futs)
                   if f.done() and not f.cancelled() and f.exception() is not None]
        if not refused:
            return
        wait = min(5.0, max(1.0, deadline.left()))
        futs = self.submit_all(refused, lambda c: c.destroy_weights_update_group(name, timeout=wait))
        for e, f in zip(refused, futs):
            try:
                f.result(timeout=wait + 1.0)
            except Exception as exc:  # noqa: BLE001 - it may have dropped the group itself already
                logger.debug("destroy_weights_update_group(%s) on %s after its refusal: %s", name, e.url, exc)

    def close(self) -> None:
        if not self.is_source and self._group is not None:
            group, self._group = self._group, None
            group.destroy()
        super().close()
