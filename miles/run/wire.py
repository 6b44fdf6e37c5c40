"""The sample wire format: how samples travel from the driver to the trainer ranks. Never pickle.

    data = encode_samples(samples)          # bytes: one safetensors file
    samples = decode_samples(data)          # raises SampleWireError naming what is wrong

Layout (format ``miles.samples``, version 1), one safetensors payload holding:

- flat tensors with offsets (``*_offsets`` are int64, ``n + 1`` entries, starting at 0):
  ``tokens`` (int32: prompt + response ids of every sample, concatenated) / ``token_offsets``;
  ``loss_mask`` (uint8, one entry per response token) / ``loss_mask_offsets``;
  ``log_probs`` (float32, ``rollout_log_probs``) / ``log_prob_offsets``. A sample whose loss mask or
  log-probs is None has an empty slice and ``has_loss_mask`` / ``has_log_probs`` false.
- JSON metadata in the safetensors header (``__metadata__["samples"]``): one object per sample with
  every other ``Sample`` field (prompt, response, label, reward, status, metadata, ...). Above
  ``HEADER_JSON_LIMIT`` bytes the JSON goes into a uint8 tensor ``samples_json`` instead (safetensors
  caps header size).
- ``__metadata__["checksum"]``: blake2b-128 over every tensor's bytes and the JSON, so corruption that
  still parses is caught.

Log-probs are stored as float32 (what engines compute): python floats round to float32 on the way.
Every problem while decoding (truncated payload, bad header, length mismatch, missing field, wrong
dtype, checksum mismatch) raises ONE exception type, :class:`SampleWireError`, whose message says what
is wrong; encoding checks the same invariants so a bad sample is reported at the sender.

``split_for_dp`` assigns whole groups to data-parallel ranks balancing tokens; ``scatter_samples`` and
``broadcast_bytes`` move payloads over a gloo process group (sizes first, then uint8 tensors; a small
``broadcast_bytes`` payload travels with its size in one broadcast), each step bounded by ``timeout``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from miles.types import RewardSpec, Sample, SampleStatus
from miles.utils.errors import MilesError
from miles.utils.process_groups import group_name, wait_timeout_message

FORMAT = "miles.samples"
VERSION = "1"
HEADER_JSON_LIMIT = 32 * 1024 * 1024
_TENSOR_FIELDS = {"tokens": "token", "loss_mask": "loss_mask", "rollout_log_probs": "log_prob"}
_FLAT = {"tokens": ("tokens", "token_offsets", torch.int32),
         "loss_mask": ("loss_mask", "loss_mask_offsets", torch.uint8),
         "rollout_log_probs": ("log_probs", "log_prob_offsets", torch.float32)}
_ROLLOUT_ONLY = {"rollout_indexer_topk", "routing_key"}   # Miles's fields no trainer reads (types.py says why): not sent
_JSON_FIELDS = [f.name for f in dataclasses.fields(Sample) if f.name not in _FLAT and f.name not in _ROLLOUT_ONLY]
_INT32_MAX = 2**31 - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# JSON fields whose type the decoder checks (a payload with a valid checksum can still be built wrong)
_FIELD_TYPES: list[tuple[str, Any, str]] = [
    ("group_index", _is_int, "an int"), ("index", _is_int, "an int"), ("rollout_id", _is_int, "an int"),
    ("response_length", _is_int, "an int"),
    ("weight_version", lambda v: v is None or _is_int(v), "an int or null"),
    ("reward", lambda v: v is None or isinstance(v, int | float | dict), "a number, an object or null"),
    ("response", lambda v: isinstance(v, str), "a string"),
    ("prompt", lambda v: isinstance(v, str | list), "a string or a list of messages"),
    ("metadata", lambda v: isinstance(v, dict), "an object"),
    ("reward_spec", lambda v: v is None or (isinstance(v, dict) and set(v) == {"rm_type", "custom_rm_path"}
                                            and all(x is None or isinstance(x, str) for x in v.values())),
     "null or an object {rm_type, custom_rm_path} of strings or nulls"),
]


class SampleWireError(MilesError, ValueError):
    """A sample payload cannot be encoded or decoded; the message says what is wrong and where."""


def _checksum(tensors: dict[str, torch.Tensor], json_bytes: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(json_bytes)
    return h.hexdigest()


def _sample_json(i: int, s: Sample) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for name in _JSON_FIELDS:
        v = getattr(s, name)
        d[name] = v.value if isinstance(v, SampleStatus) else dataclasses.asdict(v) if isinstance(v, RewardSpec) else v
    d["has_loss_mask"] = s.loss_mask is not None
    d["has_log_probs"] = s.rollout_log_probs is not None
    return d


def _check_sample(i: int, s: Sample) -> None:
    if not isinstance(s, Sample):
        raise SampleWireError(f"item {i} is a {type(s).__name__}, not a Sample")
    if not 0 <= s.response_length <= len(s.tokens):
        raise SampleWireError(f"sample {i} (index {s.index}): response_length {s.response_length} is outside "
                              f"0..{len(s.tokens)} (its token count)")
    for name, what in (("loss_mask", "loss mask"), ("rollout_log_probs", "log-probs")):
        v = getattr(s, name)
        if v is not None and len(v) != s.response_length:
            raise SampleWireError(f"sample {i} (index {s.index}): {what} has {len(v)} entries, expected one per "
                                  f"response token ({s.response_length})")


def encode_samples(samples: list[Sample]) -> bytes:
    """Serialise samples into one safetensors payload (see the module docstring for the layout)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for i, s in enumerate(samples):
        _check_sample(i, s)
        try:   # Miles's Sample.multimodal_inputs, as a plugin left it: the image references the trainer reads
            s.store_multimodal_inputs()
        except ValueError as e:
            raise SampleWireError(str(e)) from None
    for field, (flat_name, off_name, dtype) in _FLAT.items():
        values = [getattr(s, field) or [] for s in samples]
        lengths = torch.tensor([0] + [len(v) for v in values], dtype=torch.int64)
        np_dtype = np.int64 if dtype == torch.int32 else {torch.uint8: np.uint8, torch.float32: np.float32}[dtype]
        try:
            parts = [np.asarray(v, dtype=np_dtype) for v in values]
            flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np_dtype)
        except (TypeError, ValueError, OverflowError) as e:
            raise SampleWireError(f"field '{field}' holds a value that is not a {dtype} number: {e}") from e
        if flat.ndim != 1:
            raise SampleWireError(f"field '{field}' must be a flat list of numbers per sample")
        tensors[flat_name] = torch.from_numpy(flat)
        if dtype == torch.int32:
            t = tensors[flat_name]
            if t.numel() and (int(t.min()) < 0 or int(t.max()) > _INT32_MAX):
                raise SampleWireError(f"field 'tokens' holds an id outside 0..{_INT32_MAX} "
                                      f"(min {int(t.min())}, max {int(t.max())})")
            tensors[flat_name] = t.to(torch.int32)
        tensors[off_name] = torch.cumsum(lengths, 0)
    try:
        meta = json.dumps([_sample_json(i, s) for i, s in enumerate(samples)], ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        bad = next((i for i, s in enumerate(samples) if not _json_ok(_sample_json(i, s))), None)
        where = f"sample {bad} (index {samples[bad].index})" if bad is not None else "a sample"
        raise SampleWireError(f"{where} has a field that is not JSON-serialisable (prompt, label, metadata must be "
                              f"plain JSON values, no NaN): {e}") from e
    json_bytes = meta.encode("utf-8")
    header: dict[str, str] = {"format": FORMAT, "version": VERSION, "count": str(len(samples))}
    if len(json_bytes) > HEADER_JSON_LIMIT:
        tensors["samples_json"] = torch.frombuffer(bytearray(json_bytes), dtype=torch.uint8)
        header["samples_in"] = "tensor"
    else:
        header["samples"] = meta
        header["samples_in"] = "header"
    header["checksum"] = _checksum(tensors, json_bytes)
    return save(tensors, metadata=header)


def _json_ok(obj: Any) -> bool:
    try:
        json.dumps(obj, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def _read_header(data: bytes) -> tuple[dict[str, Any], int]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SampleWireError(f"sample payload must be bytes, got {type(data).__name__}")
    if len(data) < 8:
        raise SampleWireError(f"truncated payload: {len(data)} bytes, shorter than the 8-byte safetensors header length")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8:
        raise SampleWireError(f"truncated payload: the header claims {n} bytes but only {len(data) - 8} follow")
    try:
        header = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SampleWireError(f"bad header: the safetensors header is not valid JSON ({type(e).__name__}: {e})") from e
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise SampleWireError("bad header: no __metadata__ object (not a miles sample payload)")
    return header, 8 + n


def decode_samples(data: bytes) -> list[Sample]:
    """Inverse of :func:`encode_samples`; raises SampleWireError for anything malformed."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    header, data_start = _read_header(data)
    meta = header["__metadata__"]
    if meta.get("format") != FORMAT:
        raise SampleWireError(f"bad header: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise SampleWireError(f"bad header: version {meta.get('version')!r}, this build reads version {VERSION}")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, ValueError, IndexError) as e:
        raise SampleWireError(f"bad header: malformed tensor entry ({e})") from e
    if len(data) - data_start < end:
        raise SampleWireError(f"truncated payload: tensor data needs {end} bytes, only {len(data) - data_start} present")
    if len(data) - data_start > end:
        raise SampleWireError(f"length mismatch: {len(data) - data_start - end} unexpected bytes after the tensor data")
    try:
        tensors = load(bytes(data))
    except SafetensorError as e:
        raise SampleWireError(f"bad payload: safetensors cannot read it ({e})") from e
    json_bytes = _samples_json(meta, tensors)
    if _checksum(tensors, json_bytes) != meta.get("checksum"):
        raise SampleWireError("checksum mismatch: the payload was corrupted in transit")
    try:
        records = json.loads(json_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SampleWireError(f"bad header: the samples JSON does not parse ({type(e).__name__}: {e})") from e
    if not isinstance(records, list) or str(len(records)) != meta.get("count"):
        raise SampleWireError(f"length mismatch: header count {meta.get('count')} but "
                              f"{len(records) if isinstance(records, list) else 'no'} sample records")
    flats = {field: _slices(tensors, field, len(records)) for field in _FLAT}
    return [_build(i, rec, flats) for i, rec in enumerate(records)]


def _samples_json(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    where = meta.get("samples_in")
    if where == "header" and isinstance(meta.get("samples"), str):
        return meta["samples"].encode("utf-8")
    if where == "tensor" and "samples_json" in tensors:
        t = tensors["samples_json"]
        if t.dtype != torch.uint8:
            raise SampleWireError(f"wrong dtype: tensor 'samples_json' is {t.dtype}, expected torch.uint8")
        return t.numpy().tobytes()
    raise SampleWireError(f"missing field: the samples JSON (samples_in={where!r}) is absent")


def _slices(tensors: dict[str, torch.Tensor], field: str, n: int) -> list[torch.Tensor]:
    flat_name, off_name, dtype = _FLAT[field]
    for name, want in ((flat_name, dtype), (off_name, torch.int64)):
        if name not in tensors:
            raise SampleWireError(f"missing field: tensor '{name}' is absent")
        if tensors[name].dtype != want:
            raise SampleWireError(f"wrong dtype: tensor '{name}' is {tensors[name].dtype}, expected {want}")
        if tensors[name].dim() != 1:
            raise SampleWireError(f"bad payload: tensor '{name}' has shape {tuple(tensors[name].shape)}, expected 1-D")
    flat, off = tensors[flat_name], tensors[off_name]
    if off.numel() != n + 1 or int(off[0]) != 0 or int(off[-1]) != flat.numel() or bool((off[1:] < off[:-1]).any()):
        raise SampleWireError(f"length mismatch: '{off_name}' ({off.numel()} entries, last "
                              f"{int(off[-1]) if off.numel() else None}) does not cut '{flat_name}' "
                              f"({flat.numel()} values) into {n} samples")
    return [flat[int(off[i]):int(off[i + 1])] for i in range(n)]


def _build(i: int, rec: Any, flats: dict[str, list[torch.Tensor]]) -> Sample:
    if not isinstance(rec, dict):
        raise SampleWireError(f"bad payload: sample record {i} is a {type(rec).__name__}, not an object")
    missing = [k for k in [*_JSON_FIELDS, "has_loss_mask", "has_log_probs"] if k not in rec]
    if missing:
        raise SampleWireError(f"missing field: sample record {i} lacks {missing}")
    for k, ok, want in _FIELD_TYPES:
        if not ok(rec[k]):
            raise SampleWireError(f"wrong type: sample record {i} field '{k}' is {rec[k]!r:.60}, expected {want}")
    kwargs = {k: rec[k] for k in _JSON_FIELDS}
    try:
        kwargs["status"] = SampleStatus(rec["status"])
    except ValueError as e:
        raise SampleWireError(f"bad payload: sample record {i} has unknown status {rec['status']!r}") from e
    kwargs["tokens"] = flats["tokens"][i].tolist()
    if rec["reward_spec"] is not None:
        kwargs["reward_spec"] = RewardSpec(**rec["reward_spec"])
    rl = rec["response_length"]
    if not isinstance(rl, int) or not 0 <= rl <= len(kwargs["tokens"]):
        raise SampleWireError(f"length mismatch: sample {i} response_length {rl!r} vs {len(kwargs['tokens'])} tokens")
    for field, has in (("loss_mask", "has_loss_mask"), ("rollout_log_probs", "has_log_probs")):
        values = flats[field][i]
        if rec[has]:
            if values.numel() != rl:
                raise SampleWireError(f"length mismatch: sample {i} {field} has {values.numel()} entries, "
                                      f"response_length is {rl}")
            kwargs[field] = values.tolist()
        elif values.numel():
            raise SampleWireError(f"length mismatch: sample {i} has {values.numel()} {field} entries but is marked None")
        else:
            kwargs[field] = None
    return Sample(**kwargs)


def split_for_dp(groups: list[list[Sample]], dp_size: int) -> list[list[Sample]]:
    """Assign whole groups to ``dp_size`` ranks, balancing total tokens.

    Longest groups first, each to the rank with the fewest tokens among those with fewer than
    ``ceil(len(groups) / dp_size)`` groups, so group counts differ by at most one. Each rank's samples
    keep their rollout order. Raises ValueError when there are fewer groups than ranks.
    """
    if dp_size <= 0:
        raise ValueError(f"dp_size must be positive, got {dp_size}")
    if len(groups) < dp_size:
        raise ValueError(f"{len(groups)} groups cannot feed {dp_size} data-parallel ranks (a rank would get no "
                         f"samples): raise --rollout-batch-size to at least {dp_size}")
    cap = -(-len(groups) // dp_size)
    sizes = [sum(len(s.tokens) for s in g) for g in groups]
    load = [0] * dp_size
    assigned: list[list[int]] = [[] for _ in range(dp_size)]
    for gi in sorted(range(len(groups)), key=lambda i: (-sizes[i], i)):
        rank = min((r for r in range(dp_size) if len(assigned[r]) < cap), key=lambda r: (load[r], len(assigned[r]), r))
        assigned[rank].append(gi)
        load[rank] += sizes[gi]
    return [[s for gi in sorted(idx) for s in groups[gi]] for idx in assigned]


def _wait(work: Any, timeout: float, what: str, group: Any, src: int) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as e:
        from miles.spmd.errors import PeerGoneError
        from miles.spmd.groups import translate_collective_error

        # a member that exited (its connection closed) is that, not a timeout: one known error naming the group
        gone = translate_collective_error(e, group_name(group), timedelta(seconds=timeout))
        if isinstance(gone, PeerGoneError):
            raise gone from e
        raise TimeoutError(wait_timeout_message(f"{what} from rank {src}", group, timeout, error=e)) from e
    if ok is False:
        raise TimeoutError(wait_timeout_message(f"{what} from rank {src}", group, timeout))


# broadcast_bytes: the first collective carries the size and up to this many payload bytes, so a command of the
# driver's control channel (tens of bytes) is one gloo broadcast, not two (size, then bytes); larger payloads send
# the rest in a second one. Every member must use the same value (it is part of the wire format).
INLINE_BYTES = 1016


def broadcast_bytes(data: bytes | None, group: Any, src: int, timeout: float) -> bytes:
    """Send ``data`` from global rank ``src`` to every member of ``group`` (gloo). One broadcast of a fixed
    ``8 + INLINE_BYTES``-byte head (the size, then the first bytes); a payload longer than ``INLINE_BYTES`` sends
    the rest in a second broadcast."""
    import torch.distributed as dist

    me = dist.get_rank()
    if me == src and data is None:
        raise ValueError("broadcast_bytes: the source rank must pass the bytes to send")
    head = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
    if me == src:
        inline = data[:INLINE_BYTES]
        head[:8] = torch.frombuffer(bytearray(struct.pack("<q", len(data))), dtype=torch.uint8)
        if inline:
            head[8:8 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
    _wait(dist.broadcast(head, src=src, group=group, async_op=True), timeout, "payload size broadcast", group, src)
    if me == src:
        if len(data) > INLINE_BYTES:
            rest = torch.frombuffer(bytearray(data[INLINE_BYTES:]), dtype=torch.uint8)
            _wait(dist.broadcast(rest, src=src, group=group, async_op=True), timeout, "payload broadcast", group, src)
        return bytes(data)
    raw = head.numpy().tobytes()
    (n,) = struct.unpack("<q", raw[:8])
    if n < 0:
        raise ValueError(f"broadcast_bytes: rank {src} announced a payload of {n} bytes")
    if n <= INLINE_BYTES:
        return raw[8:8 + n]
    rest = torch.empty(n - INLINE_BYTES, dtype=torch.uint8)
    _wait(dist.broadcast(rest, src=src, group=group, async_op=True), timeout, "payload broadcast", group, src)
    return raw[8:] + rest.numpy().tobytes()


def scatter_samples(per_rank: list[list[Sample]] | None, group: Any, src: int, timeout: float) -> list[Sample]:
    """Send ``per_rank[i]`` to the group's rank ``i``; every member calls this and gets its own samples.

    ``src`` is a global rank (as in torch.distributed) and must be in ``group``; only ``src`` passes
    ``per_rank`` (one list per group member, in group-rank order; an entry may be empty, e.g. for a
    driver that does not train). Sizes travel first, then payloads padded to the largest one.
    A payload that does not decode raises SampleWireError naming the source and receiving ranks. The source's own
    list is not sent: it is checked as an encode would check it and returned as given (a list of the same
    samples), without the encode and decode round trip of its share (an empty payload travels in its slot).
    """
    import torch.distributed as dist

    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if src not in ranks:
        raise ValueError(f"scatter_samples: source rank {src} is not in the group {ranks}")
    if me == src:
        if per_rank is None or len(per_rank) != len(ranks):
            raise ValueError(f"scatter_samples: the source needs one sample list per group member ({len(ranks)}), "
                             f"got {None if per_rank is None else len(per_rank)}")
        own = ranks.index(src)
        for i, smp in enumerate(per_rank[own]):
            _check_sample(i, smp)
        payloads = [b"" if r == own else encode_samples(x) for r, x in enumerate(per_rank)]
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    else:
        sizes = torch.zeros(len(ranks), dtype=torch.int64)
    _wait(dist.broadcast(sizes, src=src, group=group, async_op=True), timeout, "sample payload sizes", group, src)
    width = max(int(sizes.max()), 1)   # the source's own slot is empty: never a zero-size scatter
    out = torch.empty(width, dtype=torch.uint8)
    scatter_list = None
    if me == src:
        scatter_list = []
        for p in payloads:
            t = torch.zeros(width, dtype=torch.uint8)
            if p:
                t[:len(p)] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
            scatter_list.append(t)
    _wait(dist.scatter(out, scatter_list, src=src, group=group, async_op=True), timeout, "sample scatter", group, src)
    if me == src:
        return list(per_rank[ranks.index(src)])
    mine = int(sizes[ranks.index(me)])
    try:
        return decode_samples(out[:mine].numpy().tobytes())
    except SampleWireError as e:
        raise SampleWireError(f"samples sent by rank {src} to rank {me}: {e}") from e
