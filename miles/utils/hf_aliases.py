"""HF model types that transformers does not register although it has their architecture, registered as aliases.

    register_hf_aliases()      # AutoConfig / AutoModelForCausalLM then read a Kimi-K2 config.json (model_type kimi_k2)

Kimi-K2's checkpoints (moonshotai/Kimi-K2-Instruct, Kimi-K2-Thinking) say ``model_type`` "kimi_k2" and ship
DeepSeek-V3's remote code; transformers itself maps "kimi_k2" to "deepseek_v3" inside Kimi-K2.5's config. Here the
alias is a ``DeepseekV3Config`` subclass of model type "kimi_k2" (so ``save_pretrained`` keeps the checkpoint's
model type) with the DeepSeek-V3 model classes and weight conversions, so no remote code runs. ``miles.utils.
model_dir`` calls this before it reads a config.json of an aliased type; it is idempotent.
"""

from __future__ import annotations

ALIASES = {"kimi_k2": "deepseek_v3"}       # model type -> the transformers model type of its architecture


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

    if "kimi_k2" in CONFIG_MAPPING:
        return

    class KimiK2Config(DeepseekV3Config):
        """Kimi-K2's config.json: DeepSeek-V3's config under model type kimi_k2."""

        model_type = "kimi_k2"

    class KimiK2Model(DeepseekV3Model):
        config_class = KimiK2Config

    class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
        config_class = KimiK2Config

    AutoConfig.register("kimi_k2", KimiK2Config)
    AutoModel.register(KimiK2Config, KimiK2Model)
    AutoModelForCausalLM.register(KimiK2Config, KimiK2ForCausalLM)
    register_checkpoint_conversion_mapping("kimi_k2", get_checkpoint_conversion_mapping("deepseek_v3") or [],
                                           overwrite=True)


def register_for(model_type: str | None) -> None:
    """``register_hf_aliases()`` when ``model_type`` is an alias (nothing imported otherwise)."""
    if model_type in ALIASES:
        register_hf_aliases()
