"""Disk-delta weight versions: a full safetensors baseline, then per-tensor deltas, checksummed.

Layout under ``--update-weight-disk-dir`` (one directory per version, renamed into place atomically, so
a reader either sees a complete version or none)::

    full_v000001/    model.safetensors (or shards + model.safetensors.index.json), config.json and
                     tokenizer files copied from the model dir, full_manifest.json (per-tensor checksums).
                     An HF model dir: an engine loads it like any checkpoint.
    delta_v000002/   delta_manifest.json + deltas/00000.zst ...: tensor i of version 2 against version 1.

``delta_manifest.json``: ``{"format": "miles-disk-delta", "format_version": 1, "kind": "delta", "version",
"base_version", "encoding", "checksum", "tensors": [{"name", "dtype", "shape", "encoding", "file",
"compressed_bytes", "raw_bytes", "delta_checksum", "result_checksum"}, ...]}``. Per-tensor encodings:

- ``xor``: zstd(new_bytes XOR base_bytes); an involution, so it also undoes itself.
- ``overwrite``: zstd(u64 count | positions (u32, or u64 for >= 2**32 elements) | new values): the
  elements whose bits changed (compared bitwise, NaN-safe); idempotent.
- ``raw``: zstd(new bytes): a tensor that is new or changed shape/dtype against the base.
- ``same``: unchanged, no file (frozen parameters cost nothing).

Checksums (``--update-weight-delta-checksum``: ``xxh3-128``, ``blake3`` or ``adler32``; a manifest written
before the rename says ``xxh3``, read as xxh3-128) cover the compressed delta file and the resulting tensor's
bytes. :func:`apply_delta_dir` verifies every delta file before decoding anything, then decodes into new
tensors and checks every result checksum (a wrong base shows up there), and only then returns; it
never mutates ``current_state`` and never returns a partial result. Any problem raises
:class:`DeltaError`, which names the version dir, the tensor and the file; the engine answers it with a
400 and the trainer falls back to a full version (``write_version(..., baseline=None)``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.utils.errors import MilesError
from miles.utils.logging import get_logger
from miles.weight_sync.buckets import as_bytes, dtype_from_str, dtype_to_str, nbytes

logger = get_logger(__name__)

DELTA_MANIFEST = "delta_manifest.json"
FULL_MANIFEST = "full_manifest.json"
FORMAT = "miles-disk-delta"
FORMAT_VERSION = 1
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")   # --update-weight-delta-checksum (Miles's names)
_LEGACY_CHECKSUMS = ("xxh3",)                    # xxh3-128 as versions written before the rename name it
ZSTD_LEVEL = 1
MAX_SHARD_BYTES = 4 << 30
_MODEL_DIR_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")
_INT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(MilesError, ValueError):
    """A delta version cannot be applied (corrupted, missing, or against another base). Never partial."""


def version_dir_name(version: int, kind: str) -> str:
    if kind not in ("full", "delta"):
        raise ValueError(f"version kind must be 'full' or 'delta', got {kind!r}")
    return f"{kind}_v{int(version):06d}"


def checksum(data: Any, algo: str) -> str:
    """``"<algo>:<hex>"`` of a bytes-like object (bytes, memoryview, contiguous numpy array)."""
    if algo in ("xxh3-128", "xxh3"):
        import xxhash

        return f"{algo}:" + xxhash.xxh3_128_hexdigest(data)
    if algo == "blake3":
        import blake3

        return "blake3:" + blake3.blake3(data).hexdigest()
    if algo == "adler32":
        return f"adler32:{zlib.adler32(memoryview(data).cast('B')) & 0xFFFFFFFF:08x}"
    raise ValueError(f"--update-weight-delta-checksum must be one of {CHECKSUMS}, got {algo!r}")


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    return as_bytes(t.detach().to("cpu")).numpy()


def is_delta_dir(path: str | Path) -> bool:
    return (Path(path) / DELTA_MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The delta or full manifest of a version dir; DeltaError when absent or unreadable."""
    path = Path(path)
    for fname in (DELTA_MANIFEST, FULL_MANIFEST):
        f = path / fname
        if f.is_file():
            try:
                m = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise DeltaError(f"{f}: manifest is unreadable ({e}); the version dir is corrupted: load a full version instead") from e
            if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
                raise DeltaError(f"{f}: not a {FORMAT} v{FORMAT_VERSION} manifest (format={m.get('format')!r}, format_version={m.get('format_version')!r})")
            return m
    raise DeltaError(f"{path}: has neither {DELTA_MANIFEST} nor {FULL_MANIFEST}: not a weight version dir (missing or half-copied)")


# ----------------------------------------------------------------------------------------- writing


def _write_file(path: Path, data: Any) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished temp dir into place; an existing version of the same name is replaced."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    trash = None
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        logger.warning("replacing existing weight version dir %s", final)
    os.rename(tmp, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _encode(new: np.ndarray, old: np.ndarray, itemsize: int, encoding: str) -> tuple[str, bytes | None]:
    if new.size == old.size and np.array_equal(new, old):
        return "same", None
    if encoding == "xor":
        return "xor", np.bitwise_xor(new, old).tobytes()
    ints_new, ints_old = new.view(_INT_OF_SIZE[itemsize]), old.view(_INT_OF_SIZE[itemsize])
    pos = np.flatnonzero(ints_new != ints_old)
    pos = pos.astype(np.uint32 if ints_new.size < 2**32 else np.uint64)
    return "overwrite", np.uint64(pos.size).tobytes() + pos.tobytes() + ints_new[pos].tobytes()


def _write_full(tmp: Path, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], algo: str,
                model_dir: str | Path | None, stats: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    entries: dict[str, Any] = {}
    seen_ptrs: set[int] = set()
    for name, t in named_tensors:
        if name in entries:
            raise ValueError(f"tensor {name!r} appears twice in weight version {version}")
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.data_ptr() in seen_ptrs:
            t = t.clone()  # safetensors refuses shared storage (tied weights)
        if t.numel():
            seen_ptrs.add(t.data_ptr())
        size = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + size > MAX_SHARD_BYTES:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = t
        sizes[-1] += size
        entries[name] = {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "checksum": checksum(_np_bytes(t), algo)}
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
             for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = fname
            entries[n]["file"] = fname
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        _write_file(tmp / "model.safetensors.index.json", json.dumps(index, indent=1).encode())
    if model_dir is not None:
        for fname in _MODEL_DIR_FILES:
            src = Path(model_dir) / fname
            if src.is_file():
                shutil.copyfile(src, tmp / fname)
        if not (Path(model_dir) / "config.json").is_file():
            logger.warning("model dir %s has no config.json; full weight version %d is not loadable as an HF model", model_dir, version)
    stats.update(num_tensors=len(entries), tensor_bytes=sum(sizes), written_bytes=sum(sizes), num_unchanged=0)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "full", "version": int(version),
            "checksum": algo, "tensors": entries}


def _write_delta(tmp: Path, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], baseline: dict[str, torch.Tensor],
                 base_version: int, encoding: str, algo: str, stats: dict[str, Any]) -> dict[str, Any]:
    import zstandard

    (tmp / "deltas").mkdir()
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    tensors, seen = [], set()
    tensor_bytes = written = unchanged = 0
    for i, (name, t) in enumerate(named_tensors):
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in weight version {version}")
        seen.add(name)
        new = _np_bytes(t)
        base = baseline.get(name)
        entry = {"name": name, "dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "file": None,
                 "compressed_bytes": 0, "raw_bytes": 0, "delta_checksum": None, "result_checksum": checksum(new, algo)}
        if base is None or base.dtype != t.dtype or tuple(base.shape) != tuple(t.shape):
            enc, payload = "raw", new.tobytes()
        else:
            enc, payload = _encode(new, _np_bytes(base), t.element_size(), encoding)
        entry["encoding"] = enc
        tensor_bytes += new.nbytes
        if payload is None:
            unchanged += 1
        else:
            blob = cctx.compress(payload)
            fname = f"deltas/{i:05d}.zst"
            _write_file(tmp / fname, blob)
            entry.update(file=fname, compressed_bytes=len(blob), raw_bytes=len(payload), delta_checksum=checksum(blob, algo))
            written += len(blob)
        tensors.append(entry)
    stats.update(num_tensors=len(tensors), tensor_bytes=tensor_bytes, written_bytes=written, num_unchanged=unchanged)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "delta", "version": int(version),
            "base_version": int(base_version), "encoding": encoding, "checksum": algo, "tensors": tensors}


def write_version(
    out_root: str | Path,
    version: int,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    baseline: dict[str, torch.Tensor] | None,
    encoding: str = "xor",
    checksum: str = "xxh3-128",
    base_version: int | None = None,
    model_dir: str | Path | None = None,
    stats: dict[str, Any] | None = None,
    partial: bool = False,
) -> Path:
    """Write weight version ``version`` under ``out_root`` and return its dir.

    ``baseline`` None: a full, HF-loadable safetensors dir (``full_v{version:06d}``; ``model_dir``'s
    config.json and tokenizer files are copied in); ``partial``: the trainer exports part of the model (a
    multimodal checkpoint trained text-only: its towers stay as the engines loaded them), said in the manifest
    (``"partial": true``) so that an engine does not ask the version for the tensors it never holds. Otherwise a delta dir (``delta_v{version:06d}``)
    against ``baseline`` (the previous version's tensors, on CPU), whose version is ``base_version``
    (default ``version - 1``). ``stats``, when given, receives num_tensors, tensor_bytes, written_bytes
    and num_unchanged. The dir is built under a temp name and renamed into place when complete.
    """
    algo = checksum
    if encoding not in ENCODINGS:
        raise ValueError(f"--update-weight-delta-encoding must be one of {ENCODINGS}, got {encoding!r}")
    if algo not in CHECKSUMS:
        raise ValueError(f"--update-weight-delta-checksum must be one of {CHECKSUMS}, got {algo!r}")
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    kind = "full" if baseline is None else "delta"
    final = out_root / version_dir_name(version, kind)
    tmp = out_root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    stats = stats if stats is not None else {}
    try:
        if baseline is None:
            manifest = _write_full(tmp, version, named_tensors, algo, model_dir, stats)
            if partial:
                manifest["partial"] = True
            mname = FULL_MANIFEST
        else:
            bv = version - 1 if base_version is None else base_version
            manifest = _write_delta(tmp, version, named_tensors, baseline, bv, encoding, algo, stats)
            mname = DELTA_MANIFEST
        _write_file(tmp / mname, json.dumps(manifest, indent=1).encode())
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ----------------------------------------------------------------------------------------- reading


def _decode(entry: dict[str, Any], payload: bytes, base: torch.Tensor | None, where: str) -> np.ndarray:
    dtype = dtype_from_str(entry["dtype"])
    size = nbytes(entry["shape"], dtype)
    enc = entry["encoding"]
    if enc == "raw":
        out = np.frombuffer(payload, dtype=np.uint8).copy()
    else:
        old = _np_bytes(base)
        if enc == "same":
            out = old.copy()
        elif enc == "xor":
            out = np.bitwise_xor(np.frombuffer(payload, dtype=np.uint8), old)
        elif enc == "overwrite":
            itemsize = torch.empty((), dtype=dtype).element_size()
            count = int(np.frombuffer(payload[:8], dtype=np.uint64)[0])
            numel = size // itemsize
            pos_dtype = np.uint32 if numel < 2**32 else np.uint64
            pos_end = 8 + count * np.dtype(pos_dtype).itemsize
            if len(payload) != pos_end + count * itemsize:
                raise DeltaError(f"{where}: overwrite payload of {len(payload)} bytes does not match its count {count}")
            pos = np.frombuffer(payload[8:pos_end], dtype=pos_dtype)
            if count and int(pos.max()) >= numel:
                raise DeltaError(f"{where}: overwrite position {int(pos.max())} is out of range for {numel} elements")
            out = old.copy()
            out.view(_INT_OF_SIZE[itemsize])[pos] = np.frombuffer(payload[pos_end:], dtype=_INT_OF_SIZE[itemsize])
        else:
            raise DeltaError(f"{where}: unknown per-tensor encoding {enc!r}")
    if out.size != size:
        raise DeltaError(f"{where}: decodes to {out.size} bytes, but shape {entry['shape']} {entry['dtype']} needs {size}")
    return out


def apply_delta_dir(model_path: str | Path, current_state: dict[str, torch.Tensor], *, current_version: int | None = None,
                    skip: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Verify a delta version dir completely, then return ``current_state`` with the delta applied.

    ``skip(name)``: tensors the reader does not hold and ignores (an engine's MTP layers), left out of the result.

    ``current_state`` holds the tensors of the base version (any device; not modified). Tensors not in
    the manifest pass through unchanged; updated ones are new tensors on the same device. With
    ``current_version`` given, a base-version mismatch is refused up front. Raises DeltaError on any
    missing, corrupted or mismatched piece, before anything is returned.
    """
    import zstandard

    path = Path(model_path)
    m = read_manifest(path)
    if m.get("kind") != "delta":
        raise DeltaError(f"{path}: is a full version (no {DELTA_MANIFEST}); load it with read_full_dir / as a model dir")
    algo, version, base_version = m["checksum"], m["version"], m["base_version"]
    if algo not in CHECKSUMS + _LEGACY_CHECKSUMS:
        raise DeltaError(f"{path}: manifest checksum {algo!r} is not one of {CHECKSUMS}: written by a newer trainer?")
    if current_version is not None and int(current_version) != int(base_version):
        raise DeltaError(f"{path}: base version mismatch: delta v{version} applies to v{base_version}, but this engine holds "
                         f"v{current_version}; load a full version instead")
    # 1. every piece present, the right size and checksum, and matching the current tensors' layout
    blobs: dict[str, bytes] = {}
    entries = [e for e in m["tensors"] if skip is None or not skip(e["name"])]
    for e in entries:
        name = e["name"]
        where = f"{path} tensor {name!r}" + (f" ({e['file']})" if e.get("file") else "")
        if e["encoding"] != "raw":
            cur = current_state.get(name)
            if cur is None:
                raise DeltaError(f"{where}: base version mismatch: the engine has no tensor {name!r}")
            if dtype_to_str(cur.dtype) != e["dtype"] or list(cur.shape) != list(e["shape"]):
                raise DeltaError(f"{where}: base version mismatch: engine tensor is {dtype_to_str(cur.dtype)} {list(cur.shape)}, "
                                 f"delta expects {e['dtype']} {list(e['shape'])}")
        if e["encoding"] == "same":
            continue
        f = path / e["file"]
        if not f.is_file():
            raise DeltaError(f"{where}: delta file is missing")
        blob = f.read_bytes()
        if len(blob) != e["compressed_bytes"]:
            raise DeltaError(f"{where}: delta file is corrupted (truncated?): {len(blob)} bytes, manifest says {e['compressed_bytes']}")
        got = checksum(blob, algo)
        if got != e["delta_checksum"]:
            raise DeltaError(f"{where}: delta file is corrupted: checksum {got} != manifest {e['delta_checksum']}")
        blobs[name] = blob
    # 2. decode into new arrays and check every result before returning any
    dctx = zstandard.ZstdDecompressor()
    updated: dict[str, torch.Tensor] = {}
    for e in entries:
        name = e["name"]
        where = f"{path} tensor {name!r}" + (f" ({e['file']})" if e.get("file") else "")
        payload = b""
        if name in blobs:
            try:
                payload = dctx.decompress(blobs[name], max_output_size=e["raw_bytes"])
            except zstandard.ZstdError as err:
                raise DeltaError(f"{where}: delta file does not decompress ({err}): corrupted") from err
            if len(payload) != e["raw_bytes"]:
                raise DeltaError(f"{where}: decompressed to {len(payload)} bytes, manifest says {e['raw_bytes']}: corrupted")
        cur = current_state.get(name)
        out = _decode(e, payload, cur, where)
        got = checksum(out, algo)
        if got != e["result_checksum"]:
            raise DeltaError(f"{where}: result checksum {got} != manifest {e['result_checksum']}: base version mismatch "
                             f"(this engine's weights are not v{base_version}); load a full version instead")
        t = torch.from_numpy(out).view(dtype_from_str(e["dtype"])).reshape(e["shape"])
        updated[name] = t.to(cur.device) if cur is not None else t
    result = dict(current_state)
    result.update(updated)
    logger.info("applied delta v%d (base v%d): %d tensors, %d changed", version, base_version, len(entries), len(blobs))
    return result


def read_full_dir(model_path: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Load a full version dir's tensors (CPU), checking each against full_manifest.json when ``verify``."""
    from safetensors.torch import load_file

    path = Path(model_path)
    m = read_manifest(path)
    if m.get("kind") != "full":
        raise DeltaError(f"{path}: is a delta version; apply it with apply_delta_dir")
    state: dict[str, torch.Tensor] = {}
    for fname in sorted({e["file"] for e in m["tensors"].values()}):
        if not (path / fname).is_file():
            raise DeltaError(f"{path}: safetensors file {fname} is missing")
        state.update(load_file(str(path / fname)))
    if verify:
        for name, e in m["tensors"].items():
            if name not in state:
                raise DeltaError(f"{path} tensor {name!r}: missing from {e['file']}")
            got = checksum(_np_bytes(state[name]), m["checksum"])
            if got != e["checksum"]:
                raise DeltaError(f"{path} tensor {name!r} ({e['file']}): corrupted: checksum {got} != manifest {e['checksum']}")
    return state


def prune_versions(out_root: str | Path, keep_from: int) -> list[Path]:
    """Delete version dirs older than ``keep_from`` and leftover temp dirs (call it only between writes)."""
    removed = []
    for p in Path(out_root).iterdir():
        v = None
        if p.name.startswith(("full_v", "delta_v")):
            try:
                v = int(p.name.split("_v", 1)[1])
            except ValueError:
                continue
        if (v is not None and v < keep_from) or p.name.startswith((".trash-", ".tmp-")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
