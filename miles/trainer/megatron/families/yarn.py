"""The DeepSeek-V3 architecture's families on the Megatron backend (DeepSeek-V3, Kimi-K2, JoyAI-LLM-Flash): Miles's
YaRN rope flags checked against config.json.

    check_rope_flags(cfg.megatron, shape)   # --rotary-scaling-factor 32 vs config.json's rope_scaling factor 40

The model is ``mla.py``'s (multi-latent attention, DeepSeek-style MoE) built from config.json, its YaRN rope
(``ModelShape.yarn``) megatron-core's ``rope_type`` "yarn". Kimi-K2's checkpoints say ``model_type`` "kimi_k2" (a
DeepSeek-V3 config; ``miles.utils.hf_aliases`` registers it with transformers), JoyAI-LLM-Flash's
``joyai_llm_flash`` (the same alias).

Miles's scripts (radixark/miles@v0.1.0:scripts/models/kimi-k2.py, deepseek-v3.py, joyai-llm-flash.py) spell the
rope out as Megatron-LM flags: ``--rope-type``, ``--rotary-scaling-factor``, ``--original-max-position-embeddings``,
``--beta-fast``, ``--beta-slow``, ``--mscale``, ``--mscale-all-dim``. Each one given must equal config.json's
``rope_scaling`` value (one line naming both values otherwise); one not given is config.json's. Without rope
scaling in config.json the only values accepted are those that leave RoPE unscaled: ``--rope-type yarn`` (Miles's
default for MLA) of ``--rotary-scaling-factor`` 1, whose ramp, cos/sin scale and softmax mscale are all identity,
so ``--mscale``, ``--beta-fast``, ... change nothing then (JoyAI's script passes ``--mscale 1.0`` so).
"""

from __future__ import annotations

import math

from miles.config.base import ConfigError

# flag dest -> (config.json rope_scaling key, index in ModelShape.yarn)
ROPE_FLAGS = {"rotary_scaling_factor": ("factor", 0), "original_max_position_embeddings":
              ("original_max_position_embeddings", 1), "beta_fast": ("beta_fast", 2), "beta_slow": ("beta_slow", 3),
              "mscale": ("mscale", 4), "mscale_all_dim": ("mscale_all_dim", 5)}
# model types Megatron builds as DeepSeek-V3 (mla.MLA_FAMILIES holds them all)
FAMILIES = {"deepseek_v3": "DeepSeek-V3", "kimi_k2": "Kimi-K2", "joyai_llm_flash": "JoyAI-LLM-Flash"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _mismatch(name: str, value, key: str, config_value) -> ConfigError:
    return ConfigError(f"{name} {value} does not match --hf-checkpoint's config.json ({key} {config_value}): fix the "
                       "flag or drop it (the rope is read from config.json).")


def check_rope_flags(m, shape) -> None:
    """The rope flags given against config.json's rope scaling (``shape.yarn``): one line per mismatch."""
    if m is None:
        return
    own = shape.family.fork_flags(shape)     # read in Miles's fork's spelling by the family (DeepSeek-V4): its check
    given = {d: getattr(m, d, None) for d in ("rope_type", *ROPE_FLAGS)
             if getattr(m, d, None) is not None and d not in own}
    if not given:
        return
    if shape.yarn:
        if given.get("rope_type", "yarn") != "yarn":
            raise _mismatch("--rope-type", given["rope_type"], "rope_scaling rope_type", "yarn")
        for dest, (key, i) in ROPE_FLAGS.items():
            if dest in given and not math.isclose(float(given[dest]), shape.yarn[i], rel_tol=1e-6):
                raise _mismatch(_flag(dest), given[dest], f"rope_scaling {key}", shape.yarn[i])
        return
    factor = given.get("rotary_scaling_factor")
    if factor is not None and not math.isclose(float(factor), 1.0):
        raise _mismatch("--rotary-scaling-factor", factor, "rope_scaling", "none: unscaled RoPE, factor 1")
    if given.get("rope_type") == "yarn" and not shape.mla:
        raise _mismatch("--rope-type", "yarn", "rope_scaling", "none: plain RoPE, --rope-type rope")
