"""HF model types that transformers does not register although it has their architecture, registered as aliases.

    register_hf_aliases()      # AutoConfig / AutoModelForCausalLM then read a Kimi-K2 config.json (model_type kimi_k2)

Kimi-K2's checkpoints (moonshotai/Kimi-K2-Instruct, Kimi-K2-Thinking) say ``model_type`` "kimi_k2" and ship
DeepSeek-V3's remote code; transformers itself maps "kimi_k2" to "deepseek_v3" inside Kimi-K2.5's config.
JoyAI-LLM-Flash's (jdopensource/JoyAI-LLM-Flash) say "joyai_llm_flash", DeepSeek-V3's architecture too (Miles
registers the same alias with its bridge: radixark/miles@v0.1.0:miles_plugins/mbridge/joyai_llm_flash.py). Each
alias is a ``DeepseekV3Config`` subclass of the checkpoint's model type (so ``save_pretrained`` keeps it) with the
DeepSeek-V3 model classes and weight conversions, so no remote code runs. ``miles.utils.model_dir`` calls this
before it reads a config.json of an aliased type; it is idempotent.
"""

from __future__ import annotations

# model type -> the transformers model type of its architecture
ALIASES = {"kimi_k2": "deepseek_v3", "joyai_llm_flash": "deepseek_v3"}


def register_hf_aliases() -> None:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV3Model,
    )
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for alias in ALIASES:
        if alias in CONFIG_MAPPING:
            continue
        config_cls = type(f"{_camel(alias)}Config", (DeepseekV3Config,), {
            "model_type": alias, "__doc__": f"config.json of model type {alias}: DeepSeek-V3's config."})
        model_cls = type(f"{_camel(alias)}Model", (DeepseekV3Model,), {"config_class": config_cls})
        lm_cls = type(f"{_camel(alias)}ForCausalLM", (DeepseekV3ForCausalLM,), {"config_class": config_cls})
        AutoConfig.register(alias, config_cls)
        AutoModel.register(config_cls, model_cls)
        AutoModelForCausalLM.register(config_cls, lm_cls)
        register_checkpoint_conversion_mapping(alias, get_checkpoint_conversion_mapping("deepseek_v3") or [],
                                               overwrite=True)


def _camel(model_type: str) -> str:
    return "".join(part.capitalize() for part in model_type.split("_"))


def register_for(model_type: str | None) -> None:
    """``register_hf_aliases()`` when ``model_type`` is an alias (nothing imported otherwise)."""
    if model_type in ALIASES:
        register_hf_aliases()
