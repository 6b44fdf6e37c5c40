"""The receive side of every weight update: a process group outside any torch world, tensor hand-off, disk.

* ``/init_weights_update_group``: joins the trainer's group as SGLang's engines do
  (``init_custom_process_group``): a client ``TCPStore(master_address, master_port)``, a
  ``PrefixStore(group_name, store)``, and ``torch.distributed.distributed_c10d._new_process_group_helper``
  (gloo on CPU, NCCL on GPU), registered so ``dist.broadcast(..., group=pg)`` works without a default
  group. Rank = ``rank_offset`` (one worker per engine). Every step is bounded by a timeout.
* ``/update_weights_from_distributed``: one broadcast per name (src 0, in ``names`` order), or with
  ``load_format="flattened_bucket"`` ONE uint8 broadcast of every tensor's bytes in order
  (layout: ``miles.weight_sync.buckets``). With ``p2p_ranges`` (``--update-weight-transfer-mode p2p``)
  the same bucket arrives in pieces: group rank ``s`` (a trainer rank) sends the bytes of its ranges in one
  point-to-point message; the ranges must tile the bucket exactly.
* ``/update_weights_from_tensor``: SGLang's ``MultiprocessingSerializer`` payload: base64 of a
  ForkingPickler dump holding CUDA IPC handles (GPU) or shared-memory file names (CPU, ``file_system``
  sharing strategy). It is unpickled with an allow-list of torch rebuild functions only.
* ``/update_weights_from_disk``: a full HF safetensors directory, or a disk-delta version directory
  (``delta_manifest.json``) applied with ``miles.weight_sync.disk_delta.apply_delta_dir``.

Nothing touches the live weights until the whole update is received and validated; applying is an
in-place copy run on the scheduler thread between two decode steps (see ``ModelRunner.load_tensors``).
"""

from __future__ import annotations

import base64
import datetime
import inspect
import io
import pickle
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.utils.logging import get_logger
from miles.weight_sync.buckets import bucket_metadata, dtype_from_str, nbytes, unpack_bucket

logger = get_logger("miles.engine.weights")


class WeightUpdateError(ValueError):
    """A weight update that cannot be applied; answered with HTTP 400 and the old weights kept."""


# ----------------------------------------------------------------------------- process groups
class WeightGroups:
    """Weight-update groups this engine belongs to, by name."""

    def __init__(self, device: torch.device):
        self.device = device
        self.groups: dict[str, Any] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.timeouts: dict[str, float] = {}

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

        if group_name in self.groups:
            raise WeightUpdateError(f"weight-update group {group_name!r} already exists on this engine; "
                                    "call /destroy_weights_update_group first")
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError(f"backend 'nccl' needs the engine on a CUDA device, but it runs on {self.device}; use 'gloo'")
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset {rank_offset} must be in [1, world_size={world_size}) (rank 0 is the trainer)")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(master_address, int(master_port), world_size, False, timeout)
        except (RuntimeError, OSError) as e:
            raise WeightUpdateError(f"could not reach the weight-update TCPStore at {master_address}:{master_port} "
                                    f"within {timeout_s:.0f}s: {e}") from e
        prefix = PrefixStore(group_name, store)
        opt_name = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
        kwargs = {opt_name: None, "timeout": timeout}
        if backend == "nccl" and "device_id" in inspect.signature(_new_process_group_helper).parameters:
            kwargs["device_id"] = self.device
        try:
            pg, _ = _new_process_group_helper(world_size, rank_offset, [], Backend(backend), prefix,
                                              group_name=group_name, **kwargs)
        except (RuntimeError, ValueError, dist.DistError) as e:
            raise WeightUpdateError(f"weight-update group {group_name!r} (rank {rank_offset}/{world_size}, {backend}) "
                                    f"did not form within {timeout_s:.0f}s: {e}") from e
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        self.groups[group_name] = pg
        self.locks[group_name] = threading.Lock()
        self.timeouts[group_name] = float(timeout_s)
        if backend == "nccl":  # form the communicator now, bounded, instead of inside the first update
            self._broadcast(group_name, torch.zeros(1, dtype=torch.uint8, device=self.device), "warm-up")
        logger.info("joined weight-update group %s as rank %d of %d (%s)", group_name, rank_offset, world_size, backend)

    def destroy_group(self, group_name: str) -> None:
        pg = self.groups.pop(group_name, None)
        self.locks.pop(group_name, None)
        self.timeouts.pop(group_name, None)
        if pg is None:
            raise WeightUpdateError(f"no weight-update group {group_name!r} on this engine (known: {sorted(self.groups)})")
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError) as e:
            logger.warning("destroying weight-update group %s: %s", group_name, e)

    def _broadcast(self, group_name: str, t: torch.Tensor, what: str) -> None:
        pg = self.groups[group_name]
        try:
            dist.broadcast(t, src=0, group=pg)
        except (RuntimeError, dist.DistError) as e:
            self._drop_failed(group_name, pg)
            raise WeightUpdateError(f"weight-update group {group_name!r}: broadcast of {what} failed (the trainer died or "
                                    f"stalled past the group timeout); the group is dropped, re-init it: {e}") from e

    def _drop_failed(self, group_name: str, pg: Any) -> None:
        self.groups.pop(group_name, None)
        self.locks.pop(group_name, None)
        self.timeouts.pop(group_name, None)
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError):
            pass

    def _receive_p2p(self, group_name: str, meta: list[dict[str, Any]], ranges: list[list[list[int]]]) -> torch.Tensor:
        """Assemble one flattened bucket from the point-to-point pieces of trainer ranks ``0..len(ranges)-1``."""
        pg = self.groups[group_name]
        total = meta[-1]["end_idx"] if meta else 0
        if not 0 < len(ranges) <= pg.rank():
            raise WeightUpdateError(f"p2p_ranges names {len(ranges)} sending rank(s), but this engine is rank {pg.rank()} of "
                                    f"{group_name!r}: the senders must be ranks 0..{pg.rank() - 1}")
        pieces = []
        for s, rs in enumerate(ranges):
            if not isinstance(rs, list) or not all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)
                                                   for r in rs):
                raise WeightUpdateError(f"p2p_ranges[{s}] must be a list of [start, end] byte offsets, got {str(rs)[:80]}")
            pieces += [(a, b, s) for a, b in rs]
        cursor = 0
        for a, b, s in sorted(pieces):
            if a != cursor or b <= a:
                raise WeightUpdateError(f"p2p_ranges do not tile the bucket of {total} bytes: rank {s} sends [{a}, {b}) "
                                        f"where byte {cursor} is next (a gap, an overlap or an empty range)")
            cursor = b
        if cursor != total:
            raise WeightUpdateError(f"p2p_ranges cover {cursor} of the bucket's {total} bytes")
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        recvs = []
        try:
            for s, rs in enumerate(ranges):
                n = sum(b - a for a, b in rs)
                if n == 0:
                    continue
                buf = flat[rs[0][0]:rs[0][1]] if len(rs) == 1 else torch.empty(n, dtype=torch.uint8, device=self.device)
                recvs.append((s, rs, buf, dist.irecv(buf, group_src=s, group=pg)))
            timeout = datetime.timedelta(seconds=self.timeouts.get(group_name, 300.0))
            for s, _, buf, work in recvs:
                if not work.wait(timeout):
                    raise RuntimeError(f"receiving {buf.numel()} bytes from rank {s} timed out after {timeout}")
        except (RuntimeError, dist.DistError) as e:
            self._drop_failed(group_name, pg)
            raise WeightUpdateError(f"weight-update group {group_name!r}: p2p receive of a bucket of {len(meta)} tensors "
                                    f"failed (a trainer rank died or stalled past the timeout); the group is dropped, "
                                    f"re-init it: {e}") from e
        for _, rs, buf, _ in recvs:
            if len(rs) > 1:
                off = 0
                for a, b in rs:
                    flat[a:b].copy_(buf[off:off + b - a])
                    off += b - a
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        return flat

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None, p2p_ranges: list[list[list[int]]] | None = None) -> list[tuple[str, torch.Tensor]]:
        """Join the trainer's broadcast(s) for one request (blocking); returns (name, tensor) on this device."""
        if group_name not in self.groups:
            raise WeightUpdateError(f"no weight-update group {group_name!r} on this engine (known: {sorted(self.groups)}); "
                                    "call /init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightUpdateError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        try:
            torch_dtypes = [dtype_from_str(d) for d in dtypes]
        except ValueError as e:
            raise WeightUpdateError(str(e)) from None
        with self.locks[group_name]:
            if p2p_ranges is not None and load_format != "flattened_bucket":
                raise WeightUpdateError(f"p2p_ranges needs load_format 'flattened_bucket', got {load_format!r}")
            if p2p_ranges is not None:
                return unpack_bucket(self._receive_p2p(group_name, bucket_metadata(names, torch_dtypes, shapes), p2p_ranges),
                                     bucket_metadata(names, torch_dtypes, shapes))
            if load_format == "flattened_bucket":
                meta = bucket_metadata(names, torch_dtypes, shapes)
                flat = torch.empty(meta[-1]["end_idx"] if meta else 0, dtype=torch.uint8, device=self.device)
                self._broadcast(group_name, flat, f"a bucket of {len(names)} tensors")
                return unpack_bucket(flat, meta)
            if load_format not in (None, "auto", "direct"):
                raise WeightUpdateError(f"load_format {load_format!r} is not supported by /update_weights_from_distributed; "
                                        "use null or 'flattened_bucket'")
            out = []
            for name, dt, shape in zip(names, torch_dtypes, shapes):
                t = torch.empty([int(s) for s in shape], dtype=dt, device=self.device)
                self._broadcast(group_name, t, f"tensor {name!r}")
                out.append((name, t))
            return out


# ----------------------------------------------------------------------------- tensor hand-off
class _FlattenedTensorMetadata:
    """Stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata when unpickling."""

    def __init__(self, *args, **kwargs):
        for k, v in zip(("name", "shape", "dtype", "start_idx", "end_idx", "numel"), args):
            setattr(self, k, v)
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else state[1] or {})


_TORCH_NAMES = {"Tensor", "Size", "device", "dtype"}


class _SafeUnpickler(pickle.Unpickler):
    """Only torch's tensor/storage rebuild functions, dtypes and plain containers may be referenced."""

    def find_class(self, module: str, name: str):
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"):
            return super().find_class(module, name)
        if module == "torch._utils" and name.startswith("_rebuild_"):
            return super().find_class(module, name)
        if module in ("torch.storage", "torch") and name in ("UntypedStorage", "TypedStorage"):
            return super().find_class(module, name)
        if module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if module == "torch.nn.parameter" and name == "Parameter":
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if name == "FlattenedTensorMetadata":
            return _FlattenedTensorMetadata
        raise pickle.UnpicklingError(f"serialized_named_tensors references {module}.{name}, which a tensor payload "
                                     "never needs; refusing to unpickle it")


def _field(m: Any, key: str) -> Any:
    return m[key] if isinstance(m, dict) else getattr(m, key)


def deserialize_named_tensors(b64: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """Decode one TP rank's entry of ``serialized_named_tensors`` into (name, tensor) pairs."""
    try:
        raw = base64.b64decode(b64, validate=False)
        payload = _SafeUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - any decoding problem is the client's
        raise WeightUpdateError(f"serialized_named_tensors could not be decoded: {type(e).__name__}: {e}") from None
    if load_format == "flattened_bucket":
        if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
            raise WeightUpdateError("load_format 'flattened_bucket' needs a dict {'flattened_tensor', 'metadata'}")
        flat, meta = payload["flattened_tensor"], payload["metadata"]
        if not isinstance(flat, torch.Tensor):
            raise WeightUpdateError("flattened_tensor is not a tensor")
        entries = [{k: _field(m, k) for k in ("name", "shape", "dtype", "start_idx", "end_idx")} for m in meta]
        for e in entries:
            e["dtype"] = dtype_from_str(e["dtype"])
            e["shape"] = [int(s) for s in e["shape"]]
        if flat.dtype == torch.uint8 and all(int(e["end_idx"]) - int(e["start_idx"]) == nbytes(e["shape"], e["dtype"]) for e in entries):
            return unpack_bucket(flat.reshape(-1), entries)
        # SGLang's older single-dtype bucket: offsets count elements of flattened_tensor's own dtype
        out = []
        for e in entries:
            piece = flat.reshape(-1)[int(e["start_idx"]): int(e["end_idx"])].reshape(e["shape"])
            out.append((e["name"], piece.to(e["dtype"])))
        return out
    if load_format not in (None, "auto", "direct"):
        raise WeightUpdateError(f"load_format {load_format!r} is not supported by /update_weights_from_tensor; "
                                "use null or 'flattened_bucket'")
    if isinstance(payload, dict):
        payload = list(payload.items())
    if not isinstance(payload, list | tuple) or not all(isinstance(x, list | tuple) and len(x) == 2 for x in payload):
        raise WeightUpdateError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    for name, t in payload:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"serialized_named_tensors: entry {name!r} is not a (str, tensor) pair")
    return [(n, t) for n, t in payload]


def release_handles(entries: list[str], load_format: str | None) -> None:
    """Decode and drop entries this process does not load: each pickled handle carries one reference (CPU: the
    shared file's refcount; GPU: the sender's IPC counter slot) that only its unpickling gives back."""
    for b64 in entries:
        try:
            deserialize_named_tensors(b64, load_format)
        except WeightUpdateError as e:
            logger.debug("unused serialized_named_tensors entry: %s", e)


# ----------------------------------------------------------------------------- disk
def is_delta_dir(path: str | Path) -> bool:
    return Path(path, "delta_manifest.json").is_file()


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in an HF model directory (CPU)."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_dir():
        raise WeightUpdateError(f"model_path {str(p)!r} is not a directory")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"model_path {str(p)!r} has no *.safetensors files (and no delta_manifest.json)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001
            raise WeightUpdateError(f"{f}: not a readable safetensors file: {e}") from None
    return state


def checkpoint_renames(path: str | Path, model: torch.nn.Module) -> dict[str, str]:
    """The checkpoint's tensor names that transformers renames on load (its conversion mapping's renamings, e.g.
    Nemotron-H's ``backbone.*`` -> ``model.*`` in transformers 5), each mapped to the name it gets in the live model
    (a parameter, or a per-expert name of a fused expert tensor). The trainers export under the checkpoint's
    names, so weight updates and reads by them reach the same tensors. Only the safetensors headers are read;
    empty where transformers has no conversion mapping (4.x) or renames nothing."""
    try:
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:
        return {}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not renamings:
        return {}
    out: dict[str, str] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                renamed = apply_renamings(name, renamings)
                if renamed != name:
                    out[name] = renamed
    return out


def checkpoint_parts(path: str | Path, model: torch.nn.Module) -> dict[str, tuple[str, Any]]:
    """The checkpoint's names of tensors that transformers converts on load into parts of a live tensor (per-expert
    weights stacked into one; renamed ones), each mapped to (live name, ``miles.weight_sync.hf_layout.Part``): the
    layout the trainers export (transformers' conversion reverted, ``hf_layout.CheckpointLayout``), so updates and
    reads by the checkpoint's names reach views of the live tensors for every family (DeepSeek-V4's native
    ``layers.L.attn.*``, ``ffn.experts.E.w1``, ...). Only the safetensors headers are read; empty where transformers
    converted nothing."""
    try:
        from safetensors import safe_open

        from miles.weight_sync.hf_layout import CheckpointLayout
    except ImportError:
        return {}
    names: set[str] = set()
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names.update(h.keys())
    live = {n: t for n, t in model.state_dict(keep_vars=True).items() if t.is_contiguous()}
    layout = CheckpointLayout(model, [(n, tuple(t.shape)) for n, t in live.items()], frozenset(names))
    return {p.name: (n, p) for n, parts in layout.parts.items() for p in parts if p.name in names}


def mtp_layer_names(config: Any) -> Callable[[str], bool]:
    """Whether a HF name belongs to the checkpoint's multi-token-prediction layers (GLM-4.7-Flash, DeepSeek-V3 keep
    them as ``model.layers.{num_hidden_layers + k}.*``, config.json's ``num_nextn_predict_layers``; Qwen3-Next and
    Qwen3.5 as ``mtp.*``, ``mtp_num_hidden_layers``): the engine
    serves the main model, so these tensors (in a checkpoint or a weight update from a trainer that carries the
    MTP block, ``--mtp-num-layers``) are skipped, not refused."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    extra = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    prefixes = tuple(f"model.layers.{layers + k}." for k in range(extra))
    if int(getattr(config, "mtp_num_hidden_layers", 0) or 0):     # Qwen3-Next / Qwen3.5: mtp.fc, mtp.layers.k, ...
        prefixes += ("mtp.",)
    return (lambda name: name.startswith(prefixes)) if prefixes else (lambda name: False)


def drop_mtp(tensors: dict[str, torch.Tensor], is_mtp: Callable[[str], bool] | None) -> dict[str, torch.Tensor]:
    """``tensors`` without the MTP layers' (``mtp_layer_names``)."""
    return tensors if is_mtp is None else {n: t for n, t in tensors.items() if not is_mtp(n)}


def check_full_coverage(state: dict[str, torch.Tensor], live: dict[str, torch.Tensor], partial: bool = False) -> None:
    """A full checkpoint must name every live tensor (a tied alias counts for its twin; a fused MoE expert tensor
    is covered by its per-expert names, ``ParamIndex.aliases``, when they name every expert); ``partial`` (a trainer's
    disk-delta full version whose manifest says it exports part of the model: a multimodal checkpoint trained
    text-only) only its own names are checked, the tensors it does not name keep their values."""
    aliases = getattr(live, "aliases", {})
    covered = {id(live[n]) for n in state if n in live and n not in aliases}
    # each (fused tensor, expert, half) once: a fused expert may have two names (the checkpoint's and transformers')
    need = Counter(a[0] for a in set(aliases.values()))
    got = Counter(a[0] for a in {aliases[n] for n in state if n in aliases})
    covered |= {id(live[f]) for f, k in got.items() if k == need[f]}
    parts = getattr(live, "parts", {})      # the checkpoint's names of parts of live tensors: all of them cover one
    need_parts = Counter(n for n, _ in parts.values())
    got_parts = Counter(parts[n][0] for n in set(state) if n in parts)
    covered |= {id(live[n]) for n, k in got_parts.items() if k == need_parts[n]}
    missing = [n for n, t in live.items() if id(t) not in covered]
    unknown = [n for n in state if n not in live]
    if unknown:
        raise WeightUpdateError(f"the checkpoint has tensors this model does not: {unknown[:5]}"
                                f"{' ...' if len(unknown) > 5 else ''} (is it the same architecture?)")
    if missing and not partial:
        raise WeightUpdateError(f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:5]}")


def load_from_disk(path: str, live: dict[str, torch.Tensor],
                   is_mtp: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The complete new weights from ``path`` (full dir or delta dir), the MTP layers' skipped (``is_mtp``);
    raises WeightUpdateError/DeltaError."""
    if is_delta_dir(path):
        from miles.weight_sync.disk_delta import apply_delta_dir

        current = {n: t.detach().to("cpu") for n, t in live.items()}
        for a, (fused, e, half) in getattr(live, "aliases", {}).items():   # per-expert names of fused experts
            current[a] = current[fused][e] if half is None else current[fused][e].chunk(2, dim=0)[half]
        for a, n in getattr(live, "renames", {}).items():   # the checkpoint's names of renamed parameters
            current[a] = current[n]
        for a, (n, part) in getattr(live, "parts", {}).items():   # ... of parts of converted ones
            current[a] = part.of(current[n])
        new = apply_delta_dir(path, current, skip=is_mtp)
        return {n: t for n, t in new.items() if n not in current or t is not current[n]}   # MTP: skipped
    partial = False
    if Path(path, "full_manifest.json").is_file():
        import json

        from miles.weight_sync.disk_delta import read_full_dir

        state = read_full_dir(path, verify=True)  # a disk-delta full version: checksums verified
        partial = bool(json.loads(Path(path, "full_manifest.json").read_text()).get("partial", False))
    else:
        state = read_safetensors_dir(path)
    state = drop_mtp(state, is_mtp)
    check_full_coverage(state, live, partial=partial)
    return state
