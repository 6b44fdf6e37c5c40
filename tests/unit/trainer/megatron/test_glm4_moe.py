"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``) on the Megatron backend without ranks: the shape of their config.json
(tests/fixtures/miles_scripts/models/GLM-4.5*.json) and megatron-core's config of it, Miles's recorded model args
checked against config.json, one line for a flag that disagrees. Parity with transformers:
tests/multiprocess/test_megatron_glm4_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options

pytest.importorskip("megatron.core")

MODELS = Path(__file__).resolve().parents[3] / "fixtures" / "miles_scripts" / "models"
SCRIPTS = MODELS.parent
KERNEL = ("--moe-grouped-gemm", "--moe-permute-fusion")     # transformer-engine's (refused by parse_args without it)


def _config(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


def _shape(config: dict):
    from transformers import AutoConfig

    d = dict(config)
    return options.shape_of(AutoConfig.for_model(d.pop("model_type"), **d))


def _model_args(fixture: str) -> list[str]:
    """The recorded command's model args: its flags before ``--hf-checkpoint``, transformer-engine's left out."""
    import shlex

    out: list[str] = []
    for line in (SCRIPTS / f"{fixture}.flags").read_text().splitlines():
        if line.startswith("--hf-checkpoint"):
            return out
        if line.startswith("--") and line.split(" ", 1)[0] not in KERNEL:
            out += shlex.split(line)
    raise AssertionError(fixture)


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def _refusal(model: Path, flags: list[str], config: dict) -> str:
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(model, *flags), config)
    assert "\n" not in str(ei.value), ei.value
    return str(ei.value)


def test_shape_of_glm45_and_its_megatron_config() -> None:
    from miles.trainer.megatron import moe
    from miles.trainer.megatron.model import transformer_config

    shape = _shape(_config("GLM-4.5"))
    assert shape.family.name == "glm4_moe" and not shape.mla
    assert (shape.num_layers, shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads,
            shape.num_query_groups, shape.kv_channels, shape.num_experts, shape.moe_router_topk,
            shape.moe_ffn_hidden_size, shape.moe_shared_ffn_hidden_size) == (92, 5120, 12288, 96, 8, 128, 160, 8,
                                                                             1536, 1536)
    assert shape.qk_layernorm and shape.qkv_bias and shape.rotary_percent == 0.5 and shape.nextn_layers == 1
    assert shape.moe_layer_pattern == (0,) * 3 + (1,) * 89 and shape.moe_score_function == "sigmoid"
    assert shape.moe_expert_bias and shape.moe_topk_scaling == 2.5 and shape.moe_num_groups == 0
    config = transformer_config(shape, tp_size=2, device=torch.device("cpu"),
                                moe=moe.config_kwargs(shape, moe.MoeOptions(), ep=1, etp=1, te=False))
    assert not getattr(config, "multi_latent_attention", False) and config.add_qkv_bias and config.qk_layernorm
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_shared_expert_intermediate_size == 1536
    assert config.moe_router_bias_update_rate == 0.0 and not config.rotary_interleaved
    air = _shape(_config("GLM-4.5-Air"))
    assert not air.qk_layernorm and air.qkv_bias and air.rotary_percent == 0.5
    assert air.moe_layer_pattern == (0,) + (1,) * 45 and air.moe_topk_scaling == 1.0


@pytest.mark.parametrize("fixture, model", [("megatron_moe_glm45_355b_a32b", "GLM-4.5"),
                                            ("p2p_profile_glm45_air", "GLM-4.5-Air")])
def test_recorded_model_args_accepted(tiny_model_dir: Path, fixture: str, model: str) -> None:
    """radixark/miles@v0.1.0:tests/snapshots/model_args/glm4.5-355B-A32B.txt / glm4.5-106B-A12B.txt (as the
    recorded commands pass them) against the config.json: every shape flag and switch agrees."""
    options.preflight_check(_cfg(tiny_model_dir, *_model_args(fixture)), _config(model))


def test_flags_that_disagree_with_config_json_are_refused(tiny_model_dir: Path) -> None:
    glm45, air = _config("GLM-4.5"), _config("GLM-4.5-Air")
    args = _model_args("megatron_moe_glm45_355b_a32b")
    i = args.index("--rotary-percent")
    msg = _refusal(tiny_model_dir, args[:i] + ["--rotary-percent", "1.0"] + args[i + 2:], glm45)
    assert msg.startswith("--rotary-percent 1.0 does not match --hf-checkpoint's config.json "
                          "(partial_rotary_factor 0.5)"), msg
    msg = _refusal(tiny_model_dir, [a for a in args if a != "--qk-layernorm"], glm45)
    assert msg.startswith("--qk-layernorm is missing but --hf-checkpoint's config.json has q_norm/k_norm"), msg
    msg = _refusal(tiny_model_dir, ["--qk-layernorm"], air)       # GLM-4.5-Air: use_qk_norm false
    assert msg.startswith("--qk-layernorm (given) does not match --hf-checkpoint's config.json (q_norm/k_norm absent)"), msg
    msg = _refusal(tiny_model_dir, [a for a in _model_args("p2p_profile_glm45_air") if a != "--add-qkv-bias"], air)
    assert msg.startswith("--add-qkv-bias is missing but --hf-checkpoint's config.json has attention bias"), msg



def test_expert_parallel_size_must_divide_a_pipeline_stage(tiny_model_dir: Path) -> None:
    """GLM-4.5-Air's p2p profile at 2 trainer ranks with its PP and EP halved (PP 2 x EP 2): megatron-core splits
    each stage's ranks into expert groups, so the dry run refuses it in one line (it failed in the group setup)."""
    args = _model_args("p2p_profile_glm45_air")
    msg = _refusal(tiny_model_dir, args + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                           "--actor-num-gpus-per-node", "2"], _config("GLM-4.5-Air"))
    assert msg.startswith("--expert-model-parallel-size 2 (x --expert-tensor-parallel-size 1) does not divide the 1 "
                          "trainer ranks of a pipeline stage"), msg
    options.preflight_check(_cfg(tiny_model_dir, *args, "--pipeline-model-parallel-size", "2",
                                 "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "4"),
                            _config("GLM-4.5-Air"))
