"""The checkpoint's names and shapes of a transformers model's tensors: transformers' own load-time conversion, reverted.

transformers 5 converts some checkpoints while loading them (``transformers.conversion_mapping``): it renames tensors
(Nemotron-H's ``backbone.*`` -> ``model.*``), stacks per-expert MoE weights into 3-D parameters (Qwen3-MoE's, DeepSeek's,
GLM's ``mlp.experts.<e>.{gate,up}_proj.weight`` -> ``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I];
Nemotron-H's gate-less ``mixer.experts.<e>.up_proj.weight`` -> ``mixer.experts.up_proj``), transposes, splits. A model
loaded by ``from_pretrained`` records the transforms that matched its checkpoint (``model._weight_conversions``), and
``save_pretrained`` writes the checkpoint's layout back through
``transformers.core_model_loading.revert_weight_conversion``. The exports of the FSDP backend (weight sync, ``--save-hf``,
``state_dict_for_check``) use that same function, so what engines (SGLang loads checkpoint names) and ``--save-hf``
directories get is the checkpoint's layout, for every family, with no table of ours:

    layout = CheckpointLayout(hf_model, [(name, shape), ...], checkpoint_names)   # once, on meta tensors
    layout.revert(bucket)            # [(in-memory name, full tensor)] -> [(checkpoint name, view)]

The constructor runs ``revert_weight_conversion`` once per tensor on a meta tensor of its shape, with
``Tensor.contiguous`` left out (transformers' ``Chunk`` copies its pieces), and records where each checkpoint tensor
lies in the in-memory one (:class:`Part`: shape, strides, element offset). ``revert`` then cuts the parts out as views
(``as_strided``, no copy), in the order of their bytes in the in-memory tensor, so a bucket holds the same bytes under
the checkpoint's names (the bucket plan's byte counts hold). Only a conversion that is not a view (one that combines
several in-memory tensors into one checkpoint tensor: ``groups``, kept in one bucket by ``plan_buckets``; or computes
new values) runs transformers' function on the real tensors. The p2p mode's local shards use the same parts
(``miles.weight_sync.p2p.revert_shards``).

Where a reverted name is not in the checkpoint (transformers' revert is not always the inverse: a renaming that also
matched names it did not rename on load), the checkpoint's name with the same load-time name is used (``_canonical``).
An exporter without a transformers model (the Megatron backend's converter) spells its names as the checkpoint does
with the same rule (``checkpoint_spelling``: by the model type's renamings).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Bucket = list[tuple[str, torch.Tensor]]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor inside an in-memory tensor (contiguous): ``t.as_strided(shape, stride, offset)``."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int                    # in elements, from the start of the in-memory tensor

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.shape, self.stride, t.storage_offset() + self.offset)

    @property
    def contiguous(self) -> bool:
        return _numel(self.shape) <= 1 or self.stride == contiguous_strides(self.shape)


class _NoCopy(torch.overrides.TorchFunctionMode):
    """``Tensor.contiguous`` returns its input: a conversion made of views stays a view of the probe."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))


def _revert(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _same_tensor_names(renamings: list, prefix: str,
                       checkpoint_names: Container[str] | None) -> Callable[[str], str] | None:
    """name -> the checkpoint's name that transformers loads (``renamings``: its load-time ones) as the same tensor,
    the name itself where it is the checkpoint's or none is; None when there is nothing to map."""
    if checkpoint_names is None or not hasattr(checkpoint_names, "__iter__") or not renamings:
        return None
    from transformers.core_model_loading import apply_renamings

    prefix = f"{prefix}."

    def load_name(name: str) -> str:    # transformers loads a name with or without the base model's prefix
        return apply_renamings(name.removeprefix(prefix), renamings).removeprefix(prefix)

    by_load_name: dict[str, str] = {}

    def canonical(name: str) -> str:
        if name in checkpoint_names:
            return name
        if not by_load_name:            # built at the first name the checkpoint lacks (a regex per name and renaming)
            by_load_name.update((load_name(n), n) for n in checkpoint_names)
        return by_load_name.get(load_name(name), name)

    return canonical


def checkpoint_spelling(model_type: str, checkpoint_names: Collection[str]) -> Callable[[str], str]:
    """name -> how the checkpoint spells the tensor transformers loads from ``name``, by ``model_type``'s load-time
    renamings (``transformers.conversion_mapping``; e.g. DeepSeek-V4's ``layers.0.attn.wq_a.weight`` as a
    ``save_pretrained`` directory's ``model.layers.0.attn.wq_a.weight``); a name the checkpoint holds, or one no
    checkpoint name loads like, is itself. What ``CheckpointLayout`` does to reverted names, for an exporter without
    a transformers model (the Megatron backend's): both backends send the checkpoint's spelling."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:                 # transformers 4: no load-time conversion
        return lambda n: n
    renamings = [t for t in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(t, WeightRenaming)]
    names = frozenset(checkpoint_names)
    return _same_tensor_names(renamings, "model", names) or (lambda n: n)


class CheckpointLayout:
    """How the in-memory tensors of a transformers model (``from_pretrained``) map onto its checkpoint's tensors.

    ``parts[name]``: the checkpoint tensors held by the in-memory tensor ``name`` as views (absent: the tensor is the
    checkpoint's as it is); ``groups[name]``: a key shared by the in-memory tensors that transformers reverts together
    into one checkpoint tensor (they go in one bucket, ``together``); ``computed``: tensors whose checkpoint form is
    not a view (transformers' function runs on them). A model that transformers did not convert gives an empty layout.
    """

    def __init__(self, model: Any, tensors: Iterable[tuple[str, Sequence[int]]],
                 checkpoint_names: Container[str] | None = None):
        self.model = model
        self.parts: dict[str, tuple[Part, ...]] = {}
        self.groups: dict[str, str] = {}
        self._group_size: dict[str, int] = {}
        self.computed: set[str] = set()
        self._canonical: Callable[[str], str] = lambda n: n
        if not getattr(model, "_weight_conversions", None):
            return                  # not converted on load (or transformers 4): in-memory names are the checkpoint's
        self._names_from(checkpoint_names)
        producers: dict[str, list[str]] = {}
        for name, shape in tensors:
            shape = tuple(int(s) for s in shape)
            names, parts = self._probe(name, shape)
            for n in names:
                producers.setdefault(n, []).append(name)
            if parts is None:
                self.computed.add(name)
            elif len(parts) != 1 or parts[0] != Part(name, shape, contiguous_strides(shape), 0):
                self.parts[name] = parts
        for out, names in producers.items():
            if len(names) > 1:              # several in-memory tensors -> one checkpoint tensor: reverted together
                self._group_size[out] = len(names)
                for n in names:
                    self.groups[n] = out
                    self.parts.pop(n, None)
                    self.computed.discard(n)

    def _names_from(self, checkpoint_names: Container[str] | None) -> None:
        """``_canonical``: a reverted name -> the checkpoint's name that loads as the same tensor."""
        from transformers.core_model_loading import WeightRenaming

        renamings = [t for t in self.model._weight_conversions if isinstance(t, WeightRenaming)]
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        self._canonical = _same_tensor_names(renamings, prefix, checkpoint_names) or self._canonical

    def _probe(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], tuple[Part, ...] | None]:
        """The checkpoint names reverting a meta tensor of ``shape`` gives, and its parts: None when they are not
        views of it that partition its elements (or the conversion does not run on meta tensors)."""
        base = torch.empty(shape, device="meta")
        try:
            with _NoCopy():
                out = _revert(self.model, {name: base})
        except Exception:  # noqa: BLE001 -- a conversion that does not run on meta tensors: the real one runs
            return [], None
        names = [self._canonical(n) for n in out]
        parts = []
        for n, t in zip(names, out.values()):
            if t is not base and getattr(t, "_base", None) is not base:
                return names, None
            offset = 0 if t is base else int(t.storage_offset())
            parts.append(Part(n, tuple(t.shape), tuple(t.stride()), offset))
        if sum(_numel(p.shape) for p in parts) != _numel(shape):
            return names, None
        return names, tuple(sorted(parts, key=lambda p: p.offset))

    def together(self, name: str) -> str | None:
        """The key of the tensors ``name`` must share a bucket with (None: any bucket)."""
        return self.groups.get(name)

    def revert(self, bucket: Bucket) -> Bucket:
        """The bucket under the checkpoint's names and shapes: views of its tensors where the conversion is a view
        (each tensor's parts in the order of their bytes), transformers' revert on the others."""
        out: Bucket = []
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in bucket:
            parts = self.parts.get(name)
            if parts is not None:
                full = t if t.is_contiguous() else t.contiguous()
                out += [(p.name, p.of(full)) for p in parts]
            elif name in self.groups:
                key = self.groups[name]
                pending.setdefault(key, {})[name] = t
                if len(pending[key]) == self._group_size[key]:
                    out += [(self._canonical(n), v) for n, v in _revert(self.model, pending.pop(key)).items()]
            elif name in self.computed:
                out += [(self._canonical(n), v) for n, v in _revert(self.model, {name: t}).items()]
            else:
                out.append((name, t))
        if pending:
            raise RuntimeError(f"tensors {sorted(n for d in pending.values() for n in d)} revert together into the "
                               "checkpoint's tensors, but their bucket lacks the others (plan_buckets' together)")
        return out
