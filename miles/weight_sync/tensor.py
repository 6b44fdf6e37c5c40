"""Same-device hand-off (colocated): buckets move as handles, not bytes, via ``/update_weights_from_tensor``.

Each bucket is packed into ONE freshly allocated uint8 buffer (never a pooled or memory-saver
allocation, which cannot be exported) and serialized as ``base64(ForkingPickler({"flattened_tensor":
buffer, "metadata": [...]}))``, SGLang's ``flattened_bucket`` payload:

- GPU: a CUDA IPC handle (torch's reduction: the device travels as its index, so the engine must see
  the GPUs under the same indices as the trainer rank; SGLang additionally remaps by device UUID);
- CPU: a shared-memory file (torch's ``file_system`` sharing strategy, set only while pickling).

One serialized payload is ONE receiver's ticket: torch's reductions count references per pickle, not
per handle. ``file_system`` pickling increments the shared file's refcount once and every unpickle
decrements it once (``rebuild_storage_filename``), so a payload decoded by N receivers drops N
references for the one it took: with three or more receivers the file is unlinked while the sender
still holds it and the next receiver fails with "unable to open shared memory object". CUDA IPC
likewise gives every pickle its own producer-side counter slot (set to 1; the receiver's release
decrements it), so a payload opened by N receivers leaves the counter wrong and the caching allocator's
limbo stops protecting the block. Hence the buffer is serialized once per receiving worker (every
engine, every TP worker), never one payload posted twice.

The buffer stays referenced until the engine acknowledges the request, then is dropped; each receiver's
ticket additionally keeps the memory alive until that receiver has opened and released it (CPU: the shared
file's refcount; GPU: the counter slot, whose block waits in torch's limbo). Metadata entries are
:class:`FlattenedTensorMetadata` objects, attribute-compatible with SGLang's class of that name.

Who posts: by default the source rank (trainer rank 0, which holds the full tensors) posts every bucket
to every engine, one payload per engine worker. With ``engine_group`` (the engine's gloo group from
``miles.spmd.groups``) every trainer rank of a colocated engine packs the bucket on its own device and
the serialized payloads are gathered to the engine's leader (``engine_leader_rank``), which posts them
in TP-rank order to that one engine; this needs full tensors on every trainer rank.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import pickle
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from miles.config.sglang import LORA_ADAPTER_NAME
from miles.utils.logging import get_logger
from miles.weight_sync.base import Deadline, EngineTarget, SyncResult, WeightSender, WeightSyncError
from miles.weight_sync.buckets import bucket_metadata, dtype_from_str, pack_bucket, unpack_bucket

logger = get_logger(__name__)

@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket, shaped like SGLang's class of the same name (attribute access;
    the embedded engine's unpickler accepts it by name). ``start_idx``/``end_idx``/``numel`` count bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@contextlib.contextmanager
def _sharing_strategy(name: str) -> Iterator[None]:
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy(name)
    try:
        yield
    finally:
        tmp.set_sharing_strategy(old)


def pack_shared(bucket: list[tuple[str, torch.Tensor]], device: torch.device | None = None) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Pack a bucket into a fresh buffer that can be handed over (CUDA memory or CPU shared memory)."""
    dev = device or bucket[0][1].device
    if dev.type == "cuda":
        flat, meta = pack_bucket(bucket, dev)
        torch.cuda.current_stream(dev).synchronize()  # the engine reads it from another process
    else:
        meta = bucket_metadata([n for n, _ in bucket], [t.dtype for _, t in bucket], [tuple(t.shape) for _, t in bucket])
        with _sharing_strategy("file_system"):
            flat = torch.empty(meta[-1]["end_idx"], dtype=torch.uint8).share_memory_()
        for (_, t), m in zip(bucket, meta):
            flat[m["start_idx"]:m["end_idx"]].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, meta


def serialize_bucket(flat: torch.Tensor, metadata: list[dict[str, Any]]) -> str:
    """``base64(pickle({"flattened_tensor", "metadata"}))`` with the buffer passed by handle.

    The result is for exactly ONE receiver (it carries one reference; see the module docstring): call it
    again for every other worker that will decode the buffer.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions

    payload = {"flattened_tensor": flat,
               "metadata": [FlattenedTensorMetadata(m["name"], tuple(int(x) for x in m["shape"]), dtype_from_str(m["dtype"]),
                                                    int(m["start_idx"]), int(m["end_idx"]), int(m["numel"])) for m in metadata]}
    with _sharing_strategy("file_system"):
        data = ForkingPickler.dumps(payload, pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(bytes(data)).decode("ascii")


def deserialize_bucket(serialized: str) -> list[tuple[str, torch.Tensor]]:
    """The engine side: map the handle and return (name, tensor) views into the shared buffer.

    The views alias the trainer's buffer: copy them into the engine's parameters before answering.
    """
    try:
        payload = pickle.loads(base64.b64decode(serialized))
    except Exception as e:  # noqa: BLE001 - any undecodable payload is one clear bad request
        raise ValueError(f"serialized_named_tensors entry is not a weight hand-off payload ({type(e).__name__}: {e})") from e
    if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
        raise ValueError("serialized_named_tensors entry must hold {'flattened_tensor', 'metadata'} (load_format=flattened_bucket)")
    meta = [m if isinstance(m, dict) else {k: getattr(m, k) for k in ("name", "shape", "dtype", "start_idx", "end_idx", "numel")}
            for m in payload["metadata"]]
    return unpack_bucket(payload["flattened_tensor"], meta)


class TensorSender(WeightSender):
    """``--update-weight-transfer-mode tensor`` (colocated)."""

    mode = "tensor"

    def __init__(self, cfg, source, *, device: torch.device | str | None = None, engine_group: Any = None,
                 engine_leader_rank: int | None = None, **kwargs: Any) -> None:
        super().__init__(cfg, source, **kwargs)
        self.device = torch.device(device) if device is not None else None
        self.engine_group = engine_group
        self.engine_leader_rank = engine_leader_rank
        if engine_group is not None and engine_leader_rank is None:
            raise ValueError("TensorSender: engine_group needs engine_leader_rank (the engine's first global rank)")

    def _sync(self, engines: list[EngineTarget], version: int) -> SyncResult:
        result = SyncResult(self.mode, version, num_engines=len(engines))
        t_start = time.monotonic()
        deadline = Deadline(self.cfg.update_weight_timeout, f"weight sync v{version} (tensor)")
        per_rank = self.engine_group is not None
        posting = bool(engines)  # the source (or an engine leader) with engines to serve
        in_flight: tuple[list[Future], torch.Tensor] | None = None
        failure: WeightSyncError | None = None
        whole: str | None = None  # the pause mode of a one-request sync (one bucket, embedded engines)
        try:
            it = self.iter_buckets()
            if posting:
                tc = time.monotonic()
                whole = None if self.lora_adapter else self.whole_sync_mode(engines, deadline)
                if whole is None:
                    self.begin(engines, deadline)
                result.control_s += time.monotonic() - tc
            if whole is not None:
                t0 = time.monotonic()
                first = next(it, None)
                second = next(it, None) if first is not None else None
                result.gather_s += time.monotonic() - t0
                if first is None or second is not None:
                    tc = time.monotonic()
                    self.begin(engines, deadline)
                    result.control_s += time.monotonic() - tc
                    whole = None
                it = itertools.chain([b for b in (first, second) if b is not None], it)
            while True:
                t0 = time.monotonic()
                bucket = next(it, None)
                if bucket is None:
                    break
                if not (posting or per_rank) or (failure is not None and not per_rank):
                    result.gather_s += time.monotonic() - t0
                    continue  # stay in lockstep with the other trainer ranks (and the engine group)
                flat, meta = pack_shared(self._on_device(bucket), self.device)
                t1 = time.monotonic()
                result.gather_s += t1 - t0
                if per_rank:  # this rank's worker of the engine: one receiver
                    payloads = self._gather_payloads(serialize_bucket(flat, meta))
                    per_engine = [payloads] if payloads is not None else None
                elif posting:  # one payload per receiving worker, never one posted twice
                    per_engine = [[serialize_bucket(flat, meta) for _ in range(e.num_workers)] for e in engines]
                result.transfer_s += time.monotonic() - t1
                result.num_buckets += 1
                result.num_tensors += len(bucket)
                result.bytes += flat.numel()
                if not posting or failure is not None:
                    continue
                try:
                    if in_flight is not None:
                        self._wait(engines, in_flight, deadline, result)
                    in_flight = (self._post(engines, per_engine, version, deadline, whole), flat)
                except WeightSyncError as e:
                    failure = e
            if failure is None and in_flight is not None:
                self._wait(engines, in_flight, deadline, result)
            if self.lora_adapter:     # collective (the adapters' gathers); then loaded by the posting ranks
                failure = self._send_adapter(engines, deadline, result, posting and failure is None) or failure
            if failure is not None:
                raise failure
            if posting and whole is None:
                tc = time.monotonic()
                self.finish(engines, version, deadline, versioned=result.num_buckets > 0)
                result.control_s += time.monotonic() - tc
        finally:
            result.total_s = time.monotonic() - t_start
        return result

    def _send_adapter(self, engines: list[EngineTarget], deadline: Deadline, result: SyncResult,
                      post: bool) -> WeightSyncError | None:
        """The LoRA adapter to every engine: unload the last one (a failure there is fine: none yet) and load the new
        one under LORA_ADAPTER_NAME by ``/load_lora_adapter_from_tensors`` (a flattened bucket, one payload per
        worker), as Miles's colocated LoRA sync does. Collective: every rank gathers the adapter."""
        t0 = time.monotonic()
        config, tensors = self.source.lora_adapter()
        result.gather_s += time.monotonic() - t0
        if not post:
            return None
        if not tensors:
            return WeightSyncError("LoRA adapter sync: the trainer exported no adapter tensors")
        flat, meta = pack_shared(self._on_device(tensors), self.device)
        result.bytes += flat.numel()
        result.num_tensors += len(tensors)
        t1 = time.monotonic()
        try:
            self.unload_adapter(engines, deadline)
            futures = [self.submit_all([e], lambda c, e=e: c.load_lora_adapter_from_tensors(
                LORA_ADAPTER_NAME, config, [serialize_bucket(flat, meta) for _ in range(e.num_workers)],
                load_format="flattened_bucket", timeout=deadline.left()))[0] for e in engines]
            self.wait_all(engines, futures, deadline, "load_lora_adapter_from_tensors")
            result.extra["lora_adapter_tensors"] = float(len(tensors))
        except WeightSyncError as e:
            return e
        finally:
            result.load_s += time.monotonic() - t1
        return None

    def _on_device(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        for name, t in bucket:
            if t is None:
                raise WeightSyncError(f"tensor {name!r} is not materialised on this trainer rank; per-rank tensor hand-off "
                                      "needs full tensors on every rank of the engine (drop engine_group to post from rank 0)")
        if self.device is None:
            return bucket
        return [(n, t.to(self.device, non_blocking=True)) for n, t in bucket]

    def _gather_payloads(self, payload: str) -> list[str] | None:
        import torch.distributed as dist

        size = dist.get_world_size(self.engine_group)
        out = [None] * size if dist.get_rank() == self.engine_leader_rank else None
        dist.gather_object(payload, out, dst=self.engine_leader_rank, group=self.engine_group)
        return out  # TP-rank order: the engine group's ranks are the engine's GPUs in order

    def _post(self, engines: list[EngineTarget], per_engine: list[list[str]] | None, version: int,
              deadline: Deadline, whole: str | None = None) -> list[Future]:
        """Post ``per_engine[i]`` (one payload per worker of engine i, each serialized for that worker only)."""
        if per_engine is None or len(per_engine) != len(engines):
            raise WeightSyncError(f"per-rank tensor hand-off posts one engine's payloads, but this engine leader was given "
                                  f"{len(engines)} engines; give each engine leader only its own engine")
        kw = {"load_format": "flattened_bucket", "weight_version": str(version), "flush_cache": False,
              "timeout": deadline.left(), **({"whole_sync": whole} if whole is not None else {})}
        return [self.submit_all([e], lambda c, p=p: c.update_weights_from_tensor(p, **kw))[0]
                for e, p in zip(engines, per_engine)]

    def _wait(self, engines: list[EngineTarget], in_flight: tuple[list[Future], torch.Tensor], deadline: Deadline,
              result: SyncResult) -> None:
        t0 = time.monotonic()
        self.wait_all(engines, in_flight[0], deadline, "update_weights_from_tensor")
        result.load_s += time.monotonic() - t0  # the buffer (in_flight[1]) is released by the caller now
