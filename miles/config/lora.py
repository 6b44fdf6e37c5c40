"""LoRA target names: ``--target-modules`` / ``--exclude-modules`` (Miles's flags, HF or Megatron names) resolved to
the Megatron module leaf names that get adapters. Pure; the config's validation refuses a bad list with it and the
trainer's LoRA (``miles.trainer.lora``) attaches adapters to what it returns.

Megatron fuses q/k/v and gate/up, so, as in Miles's standard ``--lora-type lora``, any of q/k/v selects the fused
``linear_qkv`` and gate/up select ``linear_fc1``; ``all-linear`` is every HF name below. Multi-latent attention's
projections (DeepSeek-V3, Kimi-K2 / K2.5, GLM-4.7-Flash, GLM-5) have their own names: ``q_a_proj`` / ``kv_a_proj_with_mqa``
(the down projections, replicated over TP), ``q_b_proj`` / ``kv_b_proj`` (the up projections, column-parallel), and
``q_proj`` is also MLA's ``linear_q_proj`` (a model without q LoRA). As with Megatron-Bridge's LoRA (which matches a
target by the module's leaf name) and PEFT, a name selects the modules of that name the model has: q/k/v select
nothing on an MLA model, the MLA names nothing on a standard one (the trainer says which selected nothing; none
matching at all is refused).
"""

from __future__ import annotations

from miles.config.base import ConfigError

# HF name -> the Megatron leaf names it selects
HF_TO_MEGATRON = {"q_proj": ("linear_qkv", "linear_q_proj"), "k_proj": ("linear_qkv",), "v_proj": ("linear_qkv",),
                  "o_proj": ("linear_proj",), "gate_proj": ("linear_fc1",), "up_proj": ("linear_fc1",),
                  "down_proj": ("linear_fc2",), "q_a_proj": ("linear_q_down_proj",), "q_b_proj": ("linear_q_up_proj",),
                  "kv_a_proj_with_mqa": ("linear_kv_down_proj",), "kv_b_proj": ("linear_kv_up_proj",)}
# Megatron leaf name -> how tensor parallelism splits it (miles/trainer/lora.py)
MEGATRON_KIND = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row",
                 "linear_q_proj": "column", "linear_q_up_proj": "column", "linear_kv_up_proj": "column",
                 "linear_q_down_proj": "replicated", "linear_kv_down_proj": "replicated"}


def _names(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    return [m.strip() for m in items if m.strip()]


def resolve_targets(target_modules: str | list[str] | None, exclude_modules: str | list[str] | None = None
                    ) -> tuple[str, ...]:
    """Megatron leaf names from ``--target-modules`` minus ``--exclude-modules`` (HF or Megatron names)."""
    names = _names(target_modules)
    if not names:
        raise ConfigError("--lora-rank > 0 needs --target-modules: all-linear, or a comma list such as "
                          "q_proj,k_proj,v_proj,o_proj (HF names) or linear_qkv,linear_proj (Megatron names).")
    if names == ["all-linear"]:
        names = list(HF_TO_MEGATRON)

    def to_megatron(n: str, flag: str) -> tuple[str, ...]:
        if n in MEGATRON_KIND:
            return (n,)
        if n in HF_TO_MEGATRON:
            return HF_TO_MEGATRON[n]
        raise ConfigError(f"{flag}: {n!r} is not a LoRA target of the Megatron backend; use all-linear or names "
                          f"from {sorted(HF_TO_MEGATRON) + sorted(MEGATRON_KIND)}.")

    chosen = {m for n in names for m in to_megatron(n, "--target-modules")}
    excluded = {m for n in _names(exclude_modules) for m in to_megatron(n, "--exclude-modules")}
    chosen -= excluded
    if not chosen:
        raise ConfigError(f"--exclude-modules {exclude_modules} leaves no LoRA target of --target-modules "
                          f"{target_modules}: exclude fewer modules.")
    return tuple(sorted(chosen))
