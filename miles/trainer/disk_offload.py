"""``--offload-train-target disk``: the paused trainer's state spilled to this rank's files and read back bit for bit.

    disk = DiskOffload(root, rank=dist.get_rank(), chunk_bytes=256 << 20, device=device)   # rank_<r>/ emptied
    disk.offload({"weights": params_and_buffers, "optimizer": grads_and_adam_state})      # written, then freed
    with disk.resident(("weights",)):     # read back for a reader (the weight sync), freed again after
        ...
    disk.onload()                         # everything back: the same tensors, storages and bytes
    disk.close()                          # rank_<r>/ removed (at exit too: miles.utils.exit_cleanup)

What moves is memory, never a tensor: each tensor's storage (its ``UntypedStorage``; a DTensor's local shard's,
i.e. FSDP2's padded shard; deduplicated, so views and shared storages go once) is written to ``<kind>.bin`` at a
fixed offset, then resized to 0 bytes (FSDP2 frees its unsharded parameters the same way); onload resizes it back
and reads the bytes in. (A storage torch did not allocate, e.g. a CPU parameter mmapped from a safetensors file,
cannot be resized: it is copied once into one torch allocated, its tensors re-pointed to it in place.) So every ``Parameter`` object, every view of a storage (an FSDP2 shard, a contiguous
buffer's views), the optimizer's references (its state is keyed by the parameters) and every tensor in its state
stay the same objects, on the same device; only the addresses of their memory change. On GPU the device memory is
returned to the CUDA caching allocator and released (``empty_cache``); on CPU to the host allocator. Between
``offload`` and ``onload`` those tensors must not be read (their storages are empty: reading one crashes the
process), hence ``resident`` for readers that need them while the trainer is paused (the weight sync, checkpoints):
it reads the kinds back and frees them again afterwards without writing (the files still hold exactly those bytes).

Every byte goes through one staging buffer of ``chunk_bytes`` (pinned on CUDA), the only host memory the spill
takes: device -> staging -> file and back, one chunk at a time, with synchronous copies (the buffer is reused only
once its copy finished). The files are overwritten in place at every offload (sizes change only when the state
does, e.g. the AdamW state appearing after the first step). All of a spill is written before anything is freed,
so a failed write (a full disk) leaves the state in memory. A file error is one ``MilesError`` line naming the
path and ``--offload-train-disk-dir``; the directory is emptied when created (files of a killed earlier start of
this rank) and removed when the rank exits, whether it ends normally, on an error or on the launcher's SIGTERM.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.utils import exit_cleanup
from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

FLAG = "--offload-train-disk-dir"
KINDS = ("weights", "optimizer")        # what a reader may ask back alone (the weight sync reads only weights)
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
_IN_USE: set[str] = set()               # rank directories of the live DiskOffload objects of this process


@dataclass
class _Entry:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int                          # in its kind's file


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def filesystem_type(path: str | Path) -> str | None:
    """The type (``/proc/mounts``) of the filesystem ``path`` (or its nearest existing parent) is on; None unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        real = os.path.realpath(p)
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    best, kind = "", None
    for mount, fstype in mounts:
        mount = mount.replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s memory: a DTensor's local shard, else ``t``."""
    local = getattr(t, "_local_tensor", None)           # torch.distributed.tensor.DTensor
    return local if isinstance(local, torch.Tensor) else t


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of memory behind ``t`` now (a DTensor's: its local shard's storage); 0 once spilled."""
    return _local(t).untyped_storage().nbytes()


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (made anew: one made before a resize keeps the old size)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _adopt(tensors: list[torch.Tensor]) -> torch.UntypedStorage:
    """A storage torch cannot resize (memory it did not allocate: a CPU parameter loaded straight from an mmapped
    safetensors file) copied into one it allocated, every tensor of ``tensors`` (all of them on it) re-pointed there
    in place: the same tensor objects, offsets, sizes and strides. Once per such storage (the copy is resizable)."""
    old = tensors[0].untyped_storage()
    new = torch.UntypedStorage(old.nbytes(), device=old.device)
    _bytes(new).copy_(_bytes(old))
    with torch.no_grad():
        for t in tensors:
            t.set_(new, t.storage_offset(), t.size(), t.stride())
    return new


def _release(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    exit_cleanup.forget(path)
    _IN_USE.discard(path)


class DiskOffload:
    """One trainer rank's spill directory ``<root>/rank_<rank>`` (see the module docstring)."""

    def __init__(self, root: str | Path, *, rank: int, chunk_bytes: int, device: torch.device | str):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.root, self.dir = str(root), Path(root) / f"rank_{rank}"
        self.chunk_bytes, self.device = int(chunk_bytes), torch.device(device)
        key = str(self.dir.absolute())
        if key in _IN_USE:
            raise RuntimeError(f"{self.dir} is already the spill directory of another trainer of this process")
        self._entries: dict[str, list[_Entry]] = {}
        self._spilled: set[str] = set()
        self._stage: torch.Tensor | None = None
        try:
            if self.dir.exists():                       # a killed earlier start of this rank left it behind
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            probe = self.dir / ".probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise MilesError(f"{FLAG} {self.root}: cannot create this rank's spill directory {self.dir} "
                             f"({e.strerror or e}); give a directory on a writable node-local filesystem.") from None
        _IN_USE.add(key)
        exit_cleanup.remove_at_exit(key)
        self._finalizer = weakref.finalize(self, _release, key)
        fstype = filesystem_type(self.dir)
        if fstype in RAM_FILESYSTEMS:
            logger.warning("%s %s is on a %s: the spilled trainer state stays in RAM there; point %s at node-local "
                           "disk (NVMe) to free host memory.", FLAG, self.root, fstype, FLAG)

    # ------------------------------------------------------------------ state
    @property
    def spilled(self) -> bool:
        """Whether some of the state is on disk only (its tensors must not be read)."""
        return bool(self._spilled)

    @property
    def spilled_bytes(self) -> int:
        return sum(e.nbytes for k in self._spilled for e in self._entries[k])

    def path(self, kind: str) -> Path:
        return self.dir / f"{kind}.bin"

    def _staging(self) -> torch.Tensor:
        if self._stage is None:
            self._stage = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._stage

    def _collect(self, groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, list[_Entry]]:
        unknown = set(groups) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; valid: {KINDS}")
        by_storage: dict[tuple[str, int], list[torch.Tensor]] = {}
        kind_of: dict[tuple[str, int], str] = {}
        for kind in KINDS:
            for t in groups.get(kind, ()):
                local = _local(t)
                st = local.untyped_storage()
                if st.nbytes() == 0:
                    continue
                key = (str(st.device), st.data_ptr())
                by_storage.setdefault(key, []).append(local)
                kind_of.setdefault(key, kind)
        out: dict[str, list[_Entry]] = {kind: [] for kind in KINDS}
        offsets = dict.fromkeys(KINDS, 0)
        for key, tensors in by_storage.items():
            st = tensors[0].untyped_storage()
            if not st.resizable():
                st = _adopt(tensors)
            kind = kind_of[key]
            out[kind].append(_Entry(st, st.nbytes(), offsets[kind]))
            offsets[kind] += st.nbytes()
        return out

    def _check_room(self, need: int) -> None:
        have = sum(self.path(k).stat().st_size for k in KINDS if self.path(k).exists())
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            return
        if need > free + have:
            raise MilesError(f"{FLAG} {self.root}: this rank's trainer state needs {_gib(need)} in {self.dir}, but its "
                             f"filesystem has {_gib(free + have)} free; free space there or point {FLAG} at a larger "
                             "node-local filesystem.")

    # ------------------------------------------------------------------ the moves
    def offload(self, groups: dict[str, Iterable[torch.Tensor]]) -> int:
        """Write every storage of ``groups`` (kind -> tensors) to its kind's file, then free them all; the bytes
        written. The state must be resident (``onload`` first)."""
        if self._spilled:
            raise RuntimeError(f"offload while {sorted(self._spilled)} are still on disk: onload first")
        t0 = time.perf_counter()
        entries = self._collect(groups)
        total = sum(e.nbytes for es in entries.values() for e in es)
        self._check_room(total)
        for kind, es in entries.items():
            self._write(kind, es)
        self._entries = entries
        self._free(list(entries))
        logger.info("trainer state spilled to %s: %s in %.2f s", self.dir, _gib(total), time.perf_counter() - t0)
        return total

    def onload(self, kinds: Iterable[str] | None = None) -> int:
        """Read ``kinds`` (default: every spilled one) back into their storages; the bytes read."""
        t0 = time.perf_counter()
        todo = [k for k in (KINDS if kinds is None else kinds) if k in self._spilled]
        n = 0
        for kind in todo:
            n += self._read(kind, self._entries[kind])
            self._spilled.discard(kind)
        if todo:
            logger.info("trainer state (%s) read back from %s: %s in %.2f s", "+".join(todo), self.dir, _gib(n),
                        time.perf_counter() - t0)
        return n

    @contextlib.contextmanager
    def resident(self, kinds: Iterable[str] | None = None) -> Iterator[None]:
        """Inside: ``kinds`` (default all) read back if they were spilled; after: freed again, nothing written
        (the files still hold their bytes). For readers only: a change made inside would be lost."""
        todo = [k for k in (KINDS if kinds is None else kinds) if k in self._spilled]
        self.onload(todo)
        try:
            yield
        finally:
            self._free(todo)

    def _free(self, kinds: list[str]) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for kind in kinds:
            for e in self._entries[kind]:
                e.storage.resize_(0)
            self._spilled.add(kind)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _write(self, kind: str, entries: list[_Entry]) -> None:
        path = self.path(kind)
        stage = self._staging()
        view = memoryview(stage.numpy())
        try:
            with open(path, "r+b" if path.exists() else "w+b", buffering=0) as f:
                for e in entries:
                    src = _bytes(e.storage)
                    for start in range(0, e.nbytes, self.chunk_bytes):
                        n = min(self.chunk_bytes, e.nbytes - start)
                        stage[:n].copy_(src[start:start + n])
                        done = 0
                        while done < n:
                            done += f.write(view[done:n])
                f.truncate(sum(e.nbytes for e in entries))
        except OSError as e:
            raise MilesError(f"{FLAG} {self.root}: cannot write the trainer's spill file {path} ({e.strerror or e}); "
                             f"free space there or point {FLAG} at a writable node-local filesystem.") from None

    def _read(self, kind: str, entries: list[_Entry]) -> int:
        path = self.path(kind)
        stage = self._staging()
        view = memoryview(stage.numpy())
        try:
            with open(path, "rb", buffering=0) as f:
                for e in entries:
                    e.storage.resize_(e.nbytes)
                    dst = _bytes(e.storage)
                    f.seek(e.offset)
                    for start in range(0, e.nbytes, self.chunk_bytes):
                        n = min(self.chunk_bytes, e.nbytes - start)
                        done = 0
                        while done < n:
                            got = f.readinto(view[done:n])
                            if not got:
                                raise OSError(f"the file ends at byte {e.offset + start + done}, before the "
                                              f"{sum(x.nbytes for x in entries)} bytes written there")
                            done += got
                        dst[start:start + n].copy_(stage[:n])
        except OSError as e:
            raise MilesError(f"{FLAG} {self.root}: cannot read the trainer's spill file {path} back "
                             f"({e.strerror or e}); the trainer state in it is lost: resume from the last checkpoint, "
                             f"with {FLAG} on a filesystem nothing else cleans.") from None
        return sum(e.nbytes for e in entries)

    def close(self) -> None:
        """Remove this rank's directory (its files); the state must be resident."""
        if self._spilled:
            raise RuntimeError(f"close while {sorted(self._spilled)} are on disk only: onload first")
        self._stage = None
        self._finalizer()


def tensors_of(modules: Iterable[torch.nn.Module], optimizers: Iterable) -> dict[str, list[torch.Tensor]]:
    """The ``offload`` groups of trained ``modules`` (parameters and buffers: ``weights``; gradients with the
    ``optimizers``' state tensors: ``optimizer``). ``optimizers``: objects with a torch optimizer's ``state``."""
    modules = list(modules)
    weights = [t for m in modules for t in itertools.chain(m.parameters(), m.buffers())]
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    states = [v for o in optimizers for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"weights": weights, "optimizer": grads + states}
