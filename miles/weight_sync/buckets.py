"""Flattened weight buckets: many tensors packed into one uint8 buffer, and back.

The layout is SGLang's ``FlattenedTensorBucket`` (``load_format="flattened_bucket"``): every tensor is
flattened, viewed as bytes and concatenated in order, with no padding. Each tensor's metadata entry is
``{"name", "shape", "dtype", "start_idx", "end_idx", "numel"}`` where ``start_idx``/``end_idx`` are byte
offsets into the buffer and ``numel`` is the tensor's size in BYTES (the uint8 numel, as SGLang records
it). For ``/update_weights_from_distributed`` only names, dtypes and shapes travel over HTTP; both ends
derive the same offsets with :func:`bucket_metadata`.

The engine (``miles.engine``) imports :func:`unpack_bucket` and :func:`bucket_metadata` from here so the
two ends can never disagree about the layout. The trainer imports :func:`plan_buckets` (which parameters go
in which bucket) from here, so the senders (``p2p``'s local shards) and the trainer's full buckets agree (the
checkpoint's names and shapes of what is in them: ``miles.weight_sync.hf_layout``); this module imports nothing of
the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch

Bucket = list[tuple[str, torch.Tensor]]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling SGLang's HTTP bodies use)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``; raises ValueError naming the value."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in a weight-update request; known: {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (0-dim tensors included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def bucket_metadata(names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """Byte offsets of each tensor in a flattened bucket, from names/dtypes/shapes alone."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    meta, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = dtype_from_str(dt)
        size = nbytes(shape, dtype)
        meta.append({"name": name, "shape": [int(s) for s in shape], "dtype": dtype_to_str(dtype),
                     "start_idx": offset, "end_idx": offset + size, "numel": size})
        offset += size
    return meta


def bucket_nbytes(metadata: Sequence[dict[str, Any]]) -> int:
    return int(metadata[-1]["end_idx"]) if metadata else 0


def pack_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]], device: torch.device | str | None = None) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Concatenate the tensors' bytes into ONE freshly allocated uint8 buffer (on ``device``, default
    the first tensor's device). Returns ``(flat, metadata)``."""
    if not named_tensors:
        raise ValueError("cannot pack an empty weight bucket")
    meta = bucket_metadata([n for n, _ in named_tensors], [t.dtype for _, t in named_tensors],
                           [tuple(t.shape) for _, t in named_tensors])
    dev = torch.device(device) if device is not None else named_tensors[0][1].device
    flat = torch.empty(bucket_nbytes(meta), dtype=torch.uint8, device=dev)
    for (_, t), m in zip(named_tensors, meta):
        flat[m["start_idx"]:m["end_idx"]].copy_(as_bytes(t.detach()), non_blocking=True)
    return flat, meta


def unpack_bucket(flat: torch.Tensor, metadata: Sequence[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a flattened bucket: views into ``flat`` where the offset is aligned, copies otherwise.

    Raises ValueError when the buffer and the metadata disagree (size, dtype), naming the tensor.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a flattened bucket must be a 1-D uint8 tensor, got {flat.dtype} with shape {tuple(flat.shape)}")
    if bucket_nbytes(metadata) != flat.numel():
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes but its metadata describes {bucket_nbytes(metadata)}")
    out = []
    for m in metadata:
        dtype = dtype_from_str(m["dtype"])
        shape = [int(s) for s in m["shape"]]
        start, end = int(m["start_idx"]), int(m["end_idx"])
        if end - start != nbytes(shape, dtype):
            raise ValueError(f"tensor {m['name']!r}: {end - start} bytes in the bucket, but shape {shape} {dtype} needs {nbytes(shape, dtype)}")
        piece = flat[start:end]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if start % itemsize:
            piece = piece.clone()  # misaligned for a dtype view: copy (SGLang never pads)
        out.append((m["name"], piece.view(dtype).reshape(shape)))
    return out


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"--update-weight-buffer-size must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        b = t.numel() * t.element_size()
        if bucket and size + b > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += b
    if bucket:
        yield bucket


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None,
                 together: Callable[[str], Hashable | None] | None = None) -> list[Bucket]:
    """Group (name, param) pairs into buckets of at most bucket_bytes (a larger tensor gets its own);
    a bucket never mixes dtypes. ``together(name)``: a key (None: none) of tensors that must share a bucket
    (``miles.weight_sync.hf_layout.CheckpointLayout.together``): they follow the first of them, in one bucket."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes (--update-weight-buffer-size).")
    if together is not None:
        named = _grouped(named, together)
    buckets: list[Bucket] = []
    cur: Bucket = []
    cur_bytes, cur_dtype, cur_key = 0, None, None
    for name, p in named:
        dt = dtype or p.dtype
        nbytes = p.numel() * torch.empty(0, dtype=dt).element_size()
        key = together(name) if together is not None else None
        if cur and (key is None or key != cur_key) and (cur_bytes + nbytes > bucket_bytes or dt != cur_dtype):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, p))
        cur_bytes += nbytes
        cur_dtype, cur_key = dt, key
    if cur:
        buckets.append(cur)
    return buckets


def _grouped(named: list[tuple[str, torch.Tensor]], together: Callable[[str], Hashable | None]
             ) -> list[tuple[str, torch.Tensor]]:
    """``named`` with the tensors of one ``together`` key moved right after the first of them (order kept otherwise)."""
    groups: dict[Hashable, list[tuple[str, torch.Tensor]]] = {}
    order: list[tuple[str, torch.Tensor] | Hashable] = []
    for item in named:
        key = together(item[0])
        if key is None:
            order.append(item)
        else:
            if key not in groups:
                groups[key] = []
                order.append(_Key(key))
            groups[key].append(item)
    return [x for o in order for x in (groups[o.key] if isinstance(o, _Key) else [o])]


class _Key:
    def __init__(self, key: Hashable):
        self.key = key
