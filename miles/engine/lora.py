"""LoRA adapters served by the embedded engine, as SGLang serves them (``--enable-lora``).

An adapter is PEFT's layout: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``,
``bias``) and ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] per target linear. It arrives from disk (``/load_lora_adapter``), from tensors
(``/load_lora_adapter_from_tensors``: SGLang's ``MultiprocessingSerializer`` payload of a {name: tensor} dict) or at
the start (``--lora-paths name=path``), and leaves by ``/unload_lora_adapter``. A ``/generate`` request names one
with ``lora_path`` (its name); one without runs the base model.

The maths: each target ``nn.Linear`` of the served HF model gets a forward hook adding, for every token of a
request of adapter ``a``, ``scale_a * (x @ A_a^T) @ B_a^T`` to the base output (``scale = lora_alpha / r``, or
``/ sqrt(r)`` with ``use_rslora``), computed in fp32 and added in the model's dtype. So one forward batch may mix
adapters and base requests: each token takes its own request's adapter (or none). The runner tells the hooks which
KV row each token of the forward belongs to (``tokens``); ``row_adapter`` maps a row to its request's adapter (set
by the scheduler when a request takes a row, moved with it). With adapters served, the decode step runs without
CUDA graphs and without the fused q/k/v and gate/up projections (the hooks sit on the separate linears).
Adapters on MoE experts (transformers' fused 3-D expert tensors, PEFT's per-expert names ``...experts.<e>.gate_proj``
...) are applied in the experts module's forward: ``miles.engine.lora_experts`` (per-expert, and shared-outer under
``--experts-shared-outer-loras``).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.engine import lora_experts
from miles.utils.logging import get_logger

logger = get_logger("miles.engine.lora")

PEFT_PREFIX = "base_model.model."


class LoraLoadError(ValueError):
    """An adapter this engine cannot load (the response's error_message)."""


@dataclass
class Adapter:
    name: str
    index: int                   # 1.. (0 is the base model)
    rank: int
    scale: float
    path: str                    # the directory, or "__tensor__" (as SGLang's LoRARef)
    pinned: bool = False
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # module -> (A, scale * B)
    experts: dict[str, lora_experts.ExpertAdapter] = field(default_factory=dict)     # fused experts -> adapter


def _scale(config: dict[str, Any], rank: int) -> float:
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def lora_path_entry(entry: str) -> tuple[str, str, bool]:
    """(name, path, pinned) of one ``--lora-paths`` entry: ``NAME=PATH``, ``PATH`` (named by itself) or SGLang's JSON
    ``{"lora_name": ..., "lora_path": ..., "pinned": ...}``."""
    if entry.lstrip().startswith("{"):
        try:
            d = json.loads(entry)
            return str(d["lora_name"]), str(d["lora_path"]), bool(d.get("pinned", False))
        except (ValueError, KeyError, TypeError) as e:
            raise LoraLoadError(f"--lora-paths {entry!r}: not a JSON object with lora_name and lora_path ({e})") from None
    name, _, path = entry.rpartition("=")
    return name or path, path, False


def read_adapter_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, the adapter's tensors) of a PEFT adapter directory."""
    d = Path(path)
    cfg_file = d / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraLoadError(f"lora_path {str(path)!r} has no adapter_config.json (a PEFT adapter directory holds "
                            "adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoraLoadError(f"{cfg_file}: not readable JSON ({e})") from None
    st = d / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return config, load_file(str(st))
    raise LoraLoadError(f"lora_path {str(path)!r} has no adapter_model.safetensors")


def _rename_prefixes(renames: dict[str, str]) -> list[tuple[str, str]]:
    """The name prefixes a checkpoint -> live renaming (``weights.checkpoint_renames``) replaces, longest first:
    ``model.language_model.layers.0.x`` -> ``model.layers.0.x`` gives (``model.language_model.``, ``model.``)."""
    pairs = set()
    for ext, live in renames.items():
        a, b = ext.split("."), live.split(".")
        n = 0
        while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
            n += 1
        if n and n < len(a):
            pairs.add((".".join(a[:len(a) - n]) + ".", ".".join(b[:len(b) - n]) + "." if len(b) > n else ""))
    return sorted(pairs, key=lambda p: -len(p[0]))


class LoraServing:
    """The adapters an engine serves and the hooks that apply them (see the module docstring)."""

    def __init__(self, model: nn.Module, rows: int, device: torch.device, *, max_rank: int | None = None,
                 max_loaded: int | None = None, target_modules: list[str] | None = None,
                 experts_shared_outer: bool = False, renames: dict[str, str] | None = None):
        self.model = model
        self.device = device
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.target_modules = set(target_modules) if target_modules and "all" not in target_modules else None
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.expert_mods = lora_experts.fused_experts(model)
        self.experts_shared_outer = experts_shared_outer
        self.prefixes = _rename_prefixes(renames or {})
        self._by_experts: dict[str, dict[int, lora_experts.ExpertAdapter]] = {}
        self.adapters: dict[str, Adapter] = {}
        self.row_adapter = torch.zeros(rows, dtype=torch.long, device=device)
        self.rows: torch.Tensor | None = None   # the KV row of each token of the forward running now
        self.epoch = 0                          # bumped by every load/unload (cached prompt KV keys carry it)
        self._hooks: dict[str, Any] = {}
        self._by_module: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ adapters
    def index(self, name: str | None) -> int:
        """The index a request naming ``name`` runs with (0: the base model); an unknown name is a ValueError."""
        if name is None:
            return 0
        a = self.adapters.get(name)
        if a is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise LoraLoadError(f"lora_path {name!r} is not a loaded LoRA adapter (loaded: {loaded}); load it with "
                                "/load_lora_adapter first")
        return a.index

    def loaded(self) -> dict[str, str]:
        return {n: a.path for n, a in self.adapters.items()}

    def load(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], *, path: str,
             pinned: bool = False, upsert: bool = False) -> Adapter:
        """Check and install one adapter (``upsert``: replace a loaded one of that name in place)."""
        if not name:
            raise LoraLoadError("lora_name is empty")
        if name in self.adapters and not upsert:
            raise LoraLoadError(f"a LoRA adapter named {name!r} is already loaded; unload it first (or upsert)")
        if name not in self.adapters and self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise LoraLoadError(f"{len(self.adapters)} LoRA adapters are loaded, the most --max-loaded-loras "
                                f"{self.max_loaded} allows; unload one first")
        pairs, expert_halves, rank = self._pairs(config, tensors)
        scale = _scale(config, rank)
        old = self.adapters.get(name)
        index = old.index if old is not None else self._free_index()
        adapter = Adapter(name=name, index=index, rank=rank, scale=scale, path=path, pinned=pinned,
                          pairs={m: (a.to(self.device, torch.float32), (b.float() * scale).to(self.device))
                                 for m, (a, b) in pairs.items()},
                          experts={parent: lora_experts.build(parent, self.expert_mods[parent], halves, scale,
                                                              self.experts_shared_outer, self.device, LoraLoadError)
                                   for parent, halves in expert_halves.items()})
        with self._lock:
            if old is not None:
                self._drop(old)
            self.adapters[name] = adapter
            for module, ab in adapter.pairs.items():
                self._by_module.setdefault(module, {})[index] = ab
                if module not in self._hooks:
                    self._hooks[module] = self.linears[module].register_forward_hook(self._hook(module))
            for parent, ea in adapter.experts.items():
                per = self._by_experts.setdefault(parent, {})
                if not per:
                    m = self.expert_mods[parent]
                    m.forward = lora_experts.forward(m, m.forward, per, self._expert_ids)
                per[index] = ea
            self.epoch += 1
        logger.info("LoRA adapter %r loaded (%s): rank %d, scale %g, %d linears, %d experts modules%s", name, path,
                    rank, scale, len(adapter.pairs), len(adapter.experts),
                    " (shared outer)" if any(e.shared for e in adapter.experts.values()) else "")
        return adapter

    def unload(self, name: str) -> None:
        a = self.adapters.get(name)
        if a is None:
            raise LoraLoadError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                f"{', '.join(sorted(self.adapters)) or 'none'})")
        with self._lock:
            self._drop(a)
            del self.adapters[name]
            self.epoch += 1
        logger.info("LoRA adapter %r unloaded", name)

    def _drop(self, a: Adapter) -> None:
        for module in a.pairs:
            per = self._by_module.get(module, {})
            per.pop(a.index, None)
            if not per:
                self._by_module.pop(module, None)
                self._hooks.pop(module).remove()
        for parent in a.experts:
            per = self._by_experts.get(parent, {})
            per.pop(a.index, None)
            if not per:
                self._by_experts.pop(parent, None)
                del self.expert_mods[parent].forward       # the module's own forward again

    def _free_index(self) -> int:
        used = {a.index for a in self.adapters.values()}
        return next(i for i in range(1, len(used) + 2) if i not in used)

    def _pairs(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]
               ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                          dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]], int]:
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise LoraLoadError(f"config_dict peft_type {config.get('peft_type')!r}: only LORA adapters are served")
        if config.get("bias", "none") != "none":
            raise LoraLoadError(f"config_dict bias {config.get('bias')!r}: only bias 'none' adapters are served")
        if config.get("fan_in_fan_out"):
            raise LoraLoadError("config_dict fan_in_fan_out: true is not served (adapters of nn.Linear targets only)")
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            k = self._live(key.removeprefix(PEFT_PREFIX))
            for part in ("lora_A", "lora_B"):
                for suffix in (f".{part}.weight", f".{part}.default.weight"):
                    if k.endswith(suffix):
                        halves.setdefault(k[: -len(suffix)], {})[part] = t
                        break
                else:
                    continue
                break
            else:
                raise LoraLoadError(f"adapter tensor {key!r} is not a lora_A / lora_B weight")
        if not halves:
            raise LoraLoadError("the adapter has no lora_A / lora_B tensors")
        rank = int(config.get("r", 0) or 0)
        pairs = {}
        experts: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, ab in sorted(halves.items()):
            if set(ab) != {"lora_A", "lora_B"}:
                raise LoraLoadError(f"adapter module {module!r} has {', '.join(ab)} but not both lora_A and lora_B")
            hit = lora_experts.EXPERT_KEY.match(module)
            if hit is not None and hit["parent"] in self.expert_mods:     # one expert's linear of fused experts
                if self.target_modules is not None and hit["proj"] not in self.target_modules:
                    raise LoraLoadError(f"adapter module {module!r} is not among --lora-target-modules "
                                        f"{sorted(self.target_modules)}")
                r = ab["lora_A"].shape[0]
                if rank and r != rank:
                    raise LoraLoadError(f"adapter module {module!r} has rank {r}, config_dict r is {rank}")
                rank = rank or r
                experts.setdefault(hit["parent"], {})[(int(hit["e"]), hit["proj"])] = (ab["lora_A"], ab["lora_B"])
                continue
            linear = self.linears.get(module)
            if linear is not None and (".experts." in f".{module}." or module.rsplit(".", 1)[-1] == "lm_head"):
                linear = None     # a forward of these sees other tokens than the rows' (routed subsets, last ones)
            if linear is None:
                raise LoraLoadError(f"adapter module {module!r} is no nn.Linear of the served model nor an "
                                    "expert of its fused MoE experts (embeddings, lm_head and per-expert nn.Linear "
                                    "experts take no adapters here)")
            if self.target_modules is not None and module.rsplit(".", 1)[-1] not in self.target_modules:
                raise LoraLoadError(f"adapter module {module!r} is not among --lora-target-modules "
                                    f"{sorted(self.target_modules)}")
            a, b = ab["lora_A"], ab["lora_B"]
            r = a.shape[0]
            if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features or b.shape[0] != linear.out_features
                    or b.shape[1] != r):
                raise LoraLoadError(f"adapter module {module!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do "
                                    f"not fit the linear [{linear.out_features}, {linear.in_features}] (A [r, in], "
                                    "B [out, r])")
            if rank and r != rank:
                raise LoraLoadError(f"adapter module {module!r} has rank {r}, config_dict r is {rank}")
            rank = rank or r
            pairs[module] = (a, b)
        if self.max_rank is not None and rank > self.max_rank:
            raise LoraLoadError(f"the adapter's rank {rank} exceeds --max-lora-rank {self.max_rank}")
        return pairs, experts, rank

    def _live(self, module: str) -> str:
        """A module's name in the live model: the checkpoint's names the trainers export under (e.g. a multimodal
        checkpoint's ``model.language_model.*`` served as a text model's ``model.*``) renamed as transformers renamed
        the checkpoint's tensors on load."""
        for src, dst in self.prefixes:
            if module.startswith(src):
                return dst + module[len(src):]
        return module

    # ------------------------------------------------------------------ rows and the forward
    def set_row(self, row: int, index: int) -> None:
        self.row_adapter[row] = index

    def move_row(self, src: int, dst: int) -> None:
        self.row_adapter[dst] = self.row_adapter[src]

    def tokens(self, rows: torch.Tensor | None) -> None:
        """The KV row of each token of the next forward, flattened in the order its linears see them."""
        self.rows = rows

    def _expert_ids(self, n: int) -> torch.Tensor | None:
        """The adapter index of each of an experts forward's ``n`` tokens (None: the rows are unknown)."""
        if self.rows is None:
            return None
        ids = self.row_adapter[self.rows]
        if ids.numel() != n:
            raise RuntimeError(f"LoRA on MoE experts: {n} tokens in the forward, {ids.numel()} rows given")
        return ids

    def _hook(self, module: str):
        def hook(_m: nn.Module, args, out: torch.Tensor):
            rows, per = self.rows, self._by_module.get(module)
            if rows is None or not per:
                return None
            ids = self.row_adapter[rows]
            x = args[0]
            xf, of = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
            if ids.numel() != xf.shape[0]:
                raise RuntimeError(f"LoRA on {module}: {xf.shape[0]} tokens in the forward, {ids.numel()} rows given")
            present = [i for i in ids.unique().tolist() if i in per]
            for i in present:
                a, b = per[i]
                sel = (ids == i).nonzero().squeeze(1)
                delta = (xf.index_select(0, sel).float() @ a.T) @ b.T
                of.index_add_(0, sel, delta.to(of.dtype))
            return out
        return hook
