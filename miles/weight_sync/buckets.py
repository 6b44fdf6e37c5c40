"""Flattened weight buckets: many tensors packed into one uint8 buffer, and back.

The layout is SGLang's ``FlattenedTensorBucket`` (``load_format="flattened_bucket"``): every tensor is
flattened, viewed as bytes and concatenated in order, with no padding. Each tensor's metadata entry is
``{"name", "shape", "dtype", "start_idx", "end_idx", "numel"}`` where ``start_idx``/``end_idx`` are byte
offsets into the buffer and ``numel`` is the tensor's size in BYTES (the uint8 numel, as SGLang records
it). For ``/update_weights_from_distributed`` only names, dtypes and shapes travel over HTTP; both ends
derive the same offsets with :func:`bucket_metadata`.

The engine (``miles.engine``) imports :func:`unpack_bucket` and :func:`bucket_metadata` from here so the
two ends can never disagree about the layout. The trainer imports :func:`plan_buckets` (which parameters go
in which bucket) and :func:`split_fused_experts` / :func:`fused_expert_parts` (transformers 5's fused MoE
experts under the checkpoint's per-expert names) from here, so the senders (``p2p``'s local shards) and the
trainer's full buckets agree; this module imports nothing of the trainer.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence
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


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None) -> list[Bucket]:
    """Group (name, param) pairs into buckets of at most bucket_bytes (a larger tensor gets its own);
    a bucket never mixes dtypes."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes (--update-weight-buffer-size).")
    buckets: list[Bucket] = []
    cur: Bucket = []
    cur_bytes, cur_dtype = 0, None
    for name, p in named:
        dt = dtype or p.dtype
        nbytes = p.numel() * torch.empty(0, dtype=dt).element_size()
        if cur and (cur_bytes + nbytes > bucket_bytes or dt != cur_dtype):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, p))
        cur_bytes += nbytes
        cur_dtype = dt
    if cur:
        buckets.append(cur)
    return buckets


# ----------------------------------------------------------------------------- fused MoE experts
_GATE_UP, _DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"



def split_fused_experts(bucket: Bucket, checkpoint_names: Container[str] | None = None) -> Bucket:
    """transformers 5's fused experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) -> the
    checkpoint's per-expert ``mlp.experts.<e>.{gate,up,down}_proj.weight`` ([I, H], [I, H], [H, I]), as views (no
    copy); other tensors unchanged. With ``checkpoint_names``, a fused tensor is split only when the checkpoint
    names its experts that way (a checkpoint that stores fused tensors keeps them)."""
    out: Bucket = []
    for name, t in bucket:
        parts = fused_expert_parts(name, tuple(t.shape), checkpoint_names)
        if parts is None:
            out.append((name, t))
        else:
            out += [(part, t[e, lo:hi]) for part, e, lo, hi in parts]
    return out


def fused_expert_parts(name: str, shape: tuple[int, ...], checkpoint_names: Container[str] | None = None
                       ) -> list[tuple[str, int, int, int]] | None:
    """How ``split_fused_experts`` splits the tensor ``name`` of ``shape``: (per-expert name, expert ``e``, rows
    ``lo:hi`` of ``t[e]``) in the order of their bytes in the fused tensor; None when it stays as it is."""
    fused = name.endswith(_GATE_UP) or name.endswith(_DOWN)
    if not fused or len(shape) != 3:
        return None
    base = name[: name.rindex(".") + 1]
    kind = "gate" if name.endswith(_GATE_UP) else "down"
    if checkpoint_names is not None and f"{base}0.{kind}_proj.weight" not in checkpoint_names:
        return None
    num_experts, rows = shape[0], shape[1]
    if kind == "down":
        return [(f"{base}{e}.down_proj.weight", e, 0, rows) for e in range(num_experts)]
    half = -(-rows // 2)                                # torch.chunk(2)'s first part
    return [part for e in range(num_experts) for part in ((f"{base}{e}.gate_proj.weight", e, 0, half),
                                                          (f"{base}{e}.up_proj.weight", e, half, rows))]
