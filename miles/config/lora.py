"""LoRA target names: ``--target-modules`` / ``--exclude-modules`` (Miles's flags: HF names, Megatron names, or
Megatron-Bridge module paths with wildcards) resolved to what gets adapters. Pure; the config's validation refuses a
bad list with it and the trainer's LoRA (``miles.trainer.lora``) attaches adapters to what it returns.

Megatron fuses q/k/v and gate/up, so, as in Miles's standard ``--lora-type lora``, any of q/k/v selects the fused
``linear_qkv`` and gate/up select ``linear_fc1``; ``all-linear`` is the attention and MLP names below (Miles's
``all-linear``: q/k/v/o, gate/up/down and multi-latent attention's projections; not the gated DeltaNet's). Multi-latent
attention's projections (DeepSeek-V3, Kimi-K2 / K2.5, GLM-4.7-Flash, GLM-5) have their own names: ``q_a_proj`` /
``kv_a_proj_with_mqa`` (the down projections, replicated over TP), ``q_b_proj`` / ``kv_b_proj`` (the up projections,
column-parallel), and ``q_proj`` is also MLA's ``linear_q_proj`` (a model without q LoRA). The gated DeltaNet of
Qwen3-Next / Qwen3.5 has ``in_proj`` (column-parallel: [q; k; v; z; beta; alpha], HF ``in_proj_qkvz`` /
``in_proj_ba`` in Qwen3-Next's checkpoints, as Miles maps them) and ``out_proj`` (row-parallel): targets only where
the model's family builds them as such (``FAMILY_TARGETS``; ``Family.lora_targets``). As with Megatron-Bridge's LoRA
(which matches a target by the module's leaf name) and PEFT, a name selects the modules of that name the model has:
q/k/v select nothing on an MLA model, the MLA names nothing on a standard one (the trainer says which selected nothing;
none matching at all is refused).

Module paths (an entry holding ``.`` or ``*``): Megatron-Bridge's syntax
(radixark/miles@v0.1.0:miles/backends/megatron_utils/lora_utils.py passes them to Megatron-Bridge unchanged, whose
matcher takes a module when ``re.match('^' + pattern.replace('*', '(.*)') + '$', full_name)``; here dots are literal):
``*`` stands for any run of characters, dots
included, and the pattern must match the module's whole name in the model Megatron-Bridge builds (e.g.
``language_model.decoder.layers.*.self_attention.linear_qkv`` for Qwen3.5, whose text model Megatron-Bridge holds
under ``language_model.``). Its last part must be one of the Megatron names below (it decides how the adapter splits
under tensor parallelism). In ``--exclude-modules`` a path removes the modules it matches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from miles.config.base import ConfigError

# HF name -> the Megatron leaf names it selects
HF_TO_MEGATRON = {"q_proj": ("linear_qkv", "linear_q_proj"), "k_proj": ("linear_qkv",), "v_proj": ("linear_qkv",),
                  "o_proj": ("linear_proj",), "gate_proj": ("linear_fc1",), "up_proj": ("linear_fc1",),
                  "down_proj": ("linear_fc2",), "q_a_proj": ("linear_q_down_proj",), "q_b_proj": ("linear_q_up_proj",),
                  "kv_a_proj_with_mqa": ("linear_kv_down_proj",), "kv_b_proj": ("linear_kv_up_proj",),
                  "in_proj_qkvz": ("in_proj",), "in_proj_ba": ("in_proj",)}
# what all-linear selects (Miles: the attention and MLP linears, multi-latent attention's included)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
              "kv_a_proj_with_mqa", "kv_b_proj")
# Megatron leaf name -> how tensor parallelism splits it (miles/trainer/lora.py)
MEGATRON_KIND = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row",
                 "linear_q_proj": "column", "linear_q_up_proj": "column", "linear_kv_up_proj": "column",
                 "linear_q_down_proj": "replicated", "linear_kv_down_proj": "replicated",
                 "in_proj": "column", "out_proj": "row"}
# leaf names that are targets only where the model's family builds them as such (the gated DeltaNet's projections)
FAMILY_TARGETS = ("in_proj", "out_proj")


@dataclass(frozen=True)
class Targets:
    """``--target-modules`` minus ``--exclude-modules``: Megatron leaf names (a module of that leaf name is a target),
    Megatron-Bridge module paths (a module whose full name one matches is a target) and excluded paths."""

    leaves: tuple[str, ...]
    paths: tuple[str, ...] = ()
    exclude_paths: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every leaf name a target can have (the leaves and each path's last part), sorted."""
        return tuple(sorted(set(self.leaves) | {path_leaf(p) for p in self.paths}))


def is_path(entry: str) -> bool:
    return "." in entry or "*" in entry


def path_leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def path_matches(pattern: str, name: str) -> bool:
    """Megatron-Bridge's wildcard match: ``*`` is any run of characters (dots included), the whole name must match."""
    return re.match("^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$", name) is not None


def _names(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    return [m.strip() for m in items if m.strip()]


def _to_megatron(n: str, flag: str) -> tuple[str, ...]:
    if n in MEGATRON_KIND:
        return (n,)
    if n in HF_TO_MEGATRON:
        return HF_TO_MEGATRON[n]
    raise ConfigError(f"{flag}: {n!r} is not a LoRA target of the Megatron backend; use all-linear, names from "
                      f"{sorted(HF_TO_MEGATRON) + sorted(MEGATRON_KIND)}, or Megatron-Bridge module paths such as "
                      "decoder.layers.*.self_attention.linear_qkv.")


def _check_path(p: str, flag: str) -> str:
    leaf = path_leaf(p)
    if "*" in leaf or leaf not in MEGATRON_KIND:
        raise ConfigError(f"{flag}: the module path {p!r} must end in a Megatron linear's name, one of "
                          f"{sorted(MEGATRON_KIND)} (it decides how the adapter splits under tensor parallelism), "
                          "e.g. decoder.layers.*.self_attention.linear_qkv.")
    return p


def resolve(target_modules: str | list[str] | None, exclude_modules: str | list[str] | None = None) -> Targets:
    """``Targets`` of ``--target-modules`` minus ``--exclude-modules`` (HF or Megatron names, module paths)."""
    names = _names(target_modules)
    if not names:
        raise ConfigError("--lora-rank > 0 needs --target-modules: all-linear, or a comma list such as "
                          "q_proj,k_proj,v_proj,o_proj (HF names), linear_qkv,linear_proj (Megatron names) or "
                          "decoder.layers.*.self_attention.linear_qkv (Megatron-Bridge module paths).")
    if names == ["all-linear"]:
        names = list(ALL_LINEAR)
    paths = tuple(dict.fromkeys(_check_path(n, "--target-modules") for n in names if is_path(n)))
    chosen = {m for n in names if not is_path(n) for m in _to_megatron(n, "--target-modules")}
    excluded = _names(exclude_modules)
    exclude_paths = tuple(_check_path(n, "--exclude-modules") for n in excluded if is_path(n))
    removed = {m for n in excluded if not is_path(n) for m in _to_megatron(n, "--exclude-modules")}
    chosen -= removed
    paths = tuple(p for p in paths if path_leaf(p) not in removed)
    if not chosen and not paths:
        raise ConfigError(f"--exclude-modules {exclude_modules} leaves no LoRA target of --target-modules "
                          f"{target_modules}: exclude fewer modules.")
    return Targets(leaves=tuple(sorted(chosen)), paths=paths, exclude_paths=exclude_paths)


def resolve_targets(target_modules: str | list[str] | None, exclude_modules: str | list[str] | None = None
                    ) -> tuple[str, ...]:
    """Every Megatron leaf name a target of ``--target-modules`` minus ``--exclude-modules`` can have (``resolve``)."""
    return resolve(target_modules, exclude_modules).names
