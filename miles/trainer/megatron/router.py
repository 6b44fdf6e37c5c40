"""The MoE router's flags against config.json, for every MoE family: Qwen3-MoE's softmax router without bias, or
the DeepSeek-style sigmoid router with expert bias, top-k scaling, groups and shared experts (``families/mla.py``).

    check_router_shape(cfg.megatron, shape)   # --moe-router-score-function softmax vs config.json's sigmoid router
"""

from __future__ import annotations

import math

from miles.config.base import ConfigError


def _mismatch(name: str, value, key: str, config_value) -> ConfigError:
    return ConfigError(f"{name} {value} does not match --hf-checkpoint's config.json ({key} {config_value}): fix "
                       f"the flag or drop it (the model shape is read from config.json).")


def check_router_shape(m, shape) -> None:
    """The router and shared-expert flags against config.json (``moe.check_moe_shape`` calls it): Qwen3-MoE's
    softmax router without bias, or the DeepSeek-style sigmoid router with bias, scaling and groups."""
    spec = shape.moe_shared_ffn_hidden_size
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and int(shared) != spec:
        raise _mismatch("--moe-shared-expert-intermediate-size", shared, "moe_intermediate_size x n_shared_experts",
                        spec or "none")
    if m.moe_router_score_function not in (None, shape.moe_score_function):
        raise _mismatch("--moe-router-score-function", m.moe_router_score_function, "router scores",
                        shape.moe_score_function)
    if m.moe_router_enable_expert_bias and not shape.moe_expert_bias:
        raise _mismatch("--moe-router-enable-expert-bias", "(given)", "router expert bias", "none")
    scale = m.moe_router_topk_scaling_factor
    if scale is not None and not math.isclose(scale, shape.moe_topk_scaling, rel_tol=1e-6):
        raise _mismatch("--moe-router-topk-scaling-factor", scale, "routed_scaling_factor", shape.moe_topk_scaling)
    for dest, key, cv in (("moe_router_num_groups", "n_group", shape.moe_num_groups or 1),
                          ("moe_router_group_topk", "topk_group", shape.moe_group_topk or 1)):
        v = getattr(m, dest, None)
        if v is not None and int(v) != int(cv):
            raise _mismatch(f"--{dest.replace('_', '-')}", v, key, cv)
    rate = m.moe_router_bias_update_rate
    if shape.moe_expert_bias and rate not in (None, 0):
        raise ConfigError(f"--moe-router-bias-update-rate {rate:g} is not supported: the Megatron backend keeps the "
                          "router's expert bias (e_score_correction_bias) as the checkpoint has it; pass 0, as "
                          "Miles's scripts do.")
    if m.num_layers is None:
        return
    for name, given, key, cv, needed in (
            ("--moe-router-score-function sigmoid", m.moe_router_score_function == "sigmoid", "router scores",
             "sigmoid", shape.moe_score_function == "sigmoid"),
            ("--moe-router-enable-expert-bias", m.moe_router_enable_expert_bias, "e_score_correction_bias",
             "present", shape.moe_expert_bias),
            ("--moe-shared-expert-intermediate-size", shared is not None, "moe_intermediate_size x n_shared_experts",
             spec, spec > 0),
            (f"--moe-router-topk-scaling-factor {shape.moe_topk_scaling:g}", scale is not None,
             "routed_scaling_factor", shape.moe_topk_scaling, not math.isclose(shape.moe_topk_scaling, 1.0))):
        if needed and not given:
            raise ConfigError(f"{name.split(' ')[0]} is missing but --hf-checkpoint's config.json has {key} {cv}: add "
                              f"{name} (with --num-layers the Megatron shape flags must describe the model fully), "
                              "or drop the shape flags.")
