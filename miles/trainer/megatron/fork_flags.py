"""The flags of Miles's Megatron fork (radixark/Megatron-LM, which Miles v0.1.0 trains with) that name what a model's
config.json already fixes, checked against it, and the two that change what is trained.

    check_fork_flags(cfg.megatron, shape)   # --dsv4-hc-mult 8 vs config.json's hc_mult 4 -> ConfigError
    apply(model, opts)                      # --moe-router-freeze-gate, --no-activation-func-clamp-shared-expert

Miles's scripts spell a model out as that fork's arguments (radixark/miles@v0.1.0:scripts/models/deepseek-v4-flash.py:
``--experimental-attention-variant dsv4``, ``--dsv4-*``, ``--dsa-indexer-*``, ``--activation-func-clamp-value``).
This build reads the model from config.json, so each such flag given must equal config.json's value: the family
lists the ones its config.json fixes (``Family.fork_flags``: DeepSeek-V4 all of them, the DSA families the attention
variant and the indexer, Qwen3-Next the attention variant, gpt-oss the clamp); any other given is refused in one
line naming it. DeepSeek-V4's list also holds the MLA and YaRN flags as that fork reads them for V4 (``--kv-lora-rank``
= the shared KV head's size, ``--rotary-scaling-factor`` = the compressed layers' YaRN), which ``mla.py`` / ``yarn.py``
then leave to this check.

What changes the math (both built on megatron-core's modules, so every family with them follows):

- ``--moe-router-freeze-gate``: every MoE router's gate weight (megatron-core's ``Router.weight``, DeepSeek-V4's
  ``Dsv4Router`` too) is not trained, as the fork's ``TopKRouter`` sets ``requires_grad`` False.
- ``--no-activation-func-clamp-shared-expert``: the fork skips ``--activation-func-clamp-value`` inside
  ``SharedExpertMLP``, so only the routed experts are clamped. transformers 5.24's DeepSeek-V4 clamps the shared
  expert too (``DeepseekV4MLP``), SGLang's does not (its V4 model turns off shared-expert fusion because the two
  clamp differently), and Miles's V4 scripts pass the flag. Without it this build clamps both (transformers'); with
  it, neither the trainer's shared experts nor the embedded engine's (``python -m miles.engine
  --no-activation-func-clamp-shared-expert``, passed by ``miles.run.fleet``) are clamped. Refused on a model whose
  config.json has no clamped SwiGLU with shared experts.

The FSDP backend refuses every flag of the Megatron group by name (``MegatronConfig.validate``).
"""

from __future__ import annotations

import copy
import math

import torch

from miles.config.base import ConfigError, flag

# MegatronConfig field -> what a config.json without it lacks (the refusal's words)
FORK_FLAGS = {
    "experimental_attention_variant": "attention variant of Miles's Megatron fork (dsv4, dsa, gated_delta_net)",
    "dsv4_hc_mult": "hyper-connections (DeepSeek-V4's hc_mult)",
    "dsv4_hc_sinkhorn_iters": "hyper-connections (DeepSeek-V4's hc_sinkhorn_iters)",
    "dsv4_compress_ratios": "compressed attention layers (DeepSeek-V4's layer_types, compress_rates)",
    "dsv4_compress_rope_theta": "compressed attention layers (DeepSeek-V4's compress_rope_theta)",
    "dsv4_o_groups": "grouped output projection (DeepSeek-V4's o_groups)",
    "dsv4_o_lora_rank": "grouped output projection (DeepSeek-V4's o_lora_rank)",
    "dsv4_n_hash_layers": "hash-routed MoE layers (DeepSeek-V4's mlp_layer_types)",
    "dsv4_window_size": "DeepSeek-V4 sliding window",
    "dsa_indexer_n_heads": "lightning indexer (index_n_heads: DeepSeek-V4, DeepSeek-V3.2, GLM-5)",
    "dsa_indexer_head_dim": "lightning indexer (index_head_dim: DeepSeek-V4, DeepSeek-V3.2, GLM-5)",
    "dsa_indexer_topk": "lightning indexer (index_topk: DeepSeek-V4, DeepSeek-V3.2, GLM-5)",
    "activation_func_clamp_value": "clamped SwiGLU (swiglu_limit: DeepSeek-V4, gpt-oss)",
}


def claimed(shape) -> dict:
    """The family's fork flags for this shape: field -> (config.json key, value)."""
    return shape.family.fork_flags(shape)


def _shown(v) -> str:
    if isinstance(v, bool):
        return "(given)" if v else "(absent)"
    if isinstance(v, (list, tuple)):
        return " ".join(_shown(x) for x in v)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _same(v, cv, extra: int) -> bool:
    """``v`` (the flag) equals ``cv`` (config.json's); a per-layer list may carry ``extra`` more values (the
    checkpoint's MTP layers, which are not built)."""
    if isinstance(cv, (list, tuple)):
        v = list(v)
        return len(cv) <= len(v) <= len(cv) + extra and v[:len(cv)] == list(cv)
    if isinstance(cv, bool):
        return bool(v) == cv
    if isinstance(cv, float):
        return math.isclose(float(v), cv, rel_tol=1e-6)
    return v == cv


def check_fork_flags(m, shape) -> None:
    """Each fork flag given equals config.json's (one line naming flag, value, key and the config's); one the
    family does not list is refused; so is ``--no-activation-func-clamp-shared-expert`` without a clamped shared
    expert, and ``--moe-router-freeze-gate`` on a dense model (``moe.check_moe_shape``)."""
    if m is None:
        return
    own = claimed(shape)
    for dest, (key, cv) in own.items():
        v = getattr(m, dest, None)
        if v is None or v is False:
            continue
        if not _same(v, cv, shape.nextn_layers):
            more = f" and at most {shape.nextn_layers} more for its MTP layers" if isinstance(cv, tuple) and \
                shape.nextn_layers else ""
            raise ConfigError(f"{flag(dest)} {_shown(v)} does not match --hf-checkpoint's config.json ({key} "
                              f"{_shown(cv)}{more}): fix the flag or drop it (the model is read from config.json).")
    for dest, what in FORK_FLAGS.items():
        v = getattr(m, dest, None)
        if v is not None and dest not in own:
            raise ConfigError(f"{flag(dest)} {_shown(v)} is given but --hf-checkpoint's config.json (model_type "
                              f"{shape.model_type}) has no {what}: drop the flag.")
    if getattr(m, "no_activation_func_clamp_shared_expert", False) and not (
            "activation_func_clamp_value" in own and shape.moe_shared_ffn_hidden_size):
        raise ConfigError("--no-activation-func-clamp-shared-expert is given but --hf-checkpoint's config.json "
                          f"(model_type {shape.model_type}) has no clamped SwiGLU with shared experts (DeepSeek-V4's "
                          "swiglu_limit): drop the flag.")


# ------------------------------------------------------------------------------------------- what is trained
def freeze_router_gates(model: torch.nn.Module) -> int:
    """``--moe-router-freeze-gate``: every MoE router's gate weight (and bias) without gradient, so neither the
    optimizer nor weight decay changes it. Returns how many routers."""
    from megatron.core.transformer.moe.router import Router

    n = 0
    for mod in model.modules():
        if isinstance(mod, Router):
            for p in (mod.weight, getattr(mod, "bias", None)):
                if isinstance(p, torch.nn.Parameter):
                    p.requires_grad_(False)
            n += 1
    return n


def unclamp_shared_experts(model: torch.nn.Module) -> int:
    """``--no-activation-func-clamp-shared-expert``: each megatron-core ``SharedExpertMLP`` computes its SwiGLU
    without ``activation_func_clamp_value`` (its own copy of the config; the routed experts keep the clamp).
    Returns how many."""
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    n = 0
    for mod in model.modules():
        if isinstance(mod, SharedExpertMLP):
            config = copy.copy(mod.config)
            config.activation_func_clamp_value = None
            mod.config = config
            n += 1
    return n


def apply(model: torch.nn.Module, o) -> None:
    """The fork flags that change what is trained (``o``: ``options.Options``), on a model just built."""
    if o.freeze_router_gate and not freeze_router_gates(model):
        raise ValueError("--moe-router-freeze-gate: the built model has no MoE router (a bug: the flag is refused on "
                         "dense models before the build)")
    if not o.clamp_shared_expert and not unclamp_shared_experts(model):
        raise ValueError("--no-activation-func-clamp-shared-expert: the built model has no shared expert (a bug: the "
                         "flag is refused without one before the build)")
