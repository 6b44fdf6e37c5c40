"""Multi-latent attention on the Megatron backend (miles/trainer/megatron/families/mla.py): the shape read from GLM-4.7-Flash's
and DeepSeek-V3's config.json, the HF <-> megatron-core converter (bitwise, at TP 1, 2 and 4), Miles's MLA and
DeepSeek-style MoE flags (accepted with Megatron's meaning and checked against config.json, one line per mismatch),
and the values that are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import tp_round_trip

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options
from miles.trainer.megatron.convert import partition_dim, shard
from miles.trainer.megatron.families import mla
from miles.trainer.megatron.model import ModelShape

GLM_JSON = Path(__file__).resolve().parents[3] / "fixtures" / "miles_scripts" / "models" / "GLM-4.7-Flash.json"


@pytest.fixture(scope="module")
def tiny_dsv3_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_mla import build_tiny_mla_model

    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_dsv3"), model_type="deepseek_v3", n_group=2,
                                topk_group=1, q_lora_rank=None,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                                max_position_embeddings=64)


def _shape(config: dict) -> ModelShape:
    return options.shape_of(_hf_config(config))


def _hf_config(config: dict):
    from transformers import AutoConfig

    d = dict(config)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _read(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def test_shape_of_glm47_flash() -> None:
    shape = _shape(json.loads(GLM_JSON.read_text()))
    assert shape.mla and (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_head_dim, shape.qk_pos_emb_head_dim,
                          shape.v_head_dim, shape.kv_channels) == (768, 512, 192, 64, 256, 192)
    assert shape.qk_layernorm and not shape.qkv_bias and not shape.tie_embeddings
    assert shape.moe_layer_pattern == (0,) + (1,) * 46 and shape.num_experts == 64 and shape.moe_router_topk == 4
    assert (shape.moe_score_function, shape.moe_expert_bias, shape.moe_topk_scaling, shape.moe_shared_ffn_hidden_size,
            shape.moe_num_groups) == ("sigmoid", True, 1.8, 1536, 0)
    kw = mla.config_kwargs(shape)
    assert kw["q_lora_rank"] == 768 and kw["rope_type"] == "rope" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_topk_scaling_factor"] == 1.8 and "moe_router_num_groups" not in kw


def test_shape_of_deepseek_v3_and_its_megatron_config(tiny_dsv3_dir: Path) -> None:
    from miles.trainer.megatron.model import transformer_config

    shape = _shape(_read(tiny_dsv3_dir))
    assert shape.model_type == "deepseek_v3" and shape.q_lora_rank == 0 and shape.moe_layer_pattern == (0, 1, 1)
    assert (shape.moe_num_groups, shape.moe_group_topk) == (2, 1)
    from miles.trainer.megatron import moe

    config = transformer_config(shape, tp_size=1, device=torch.device("cpu"),
                                moe=moe.config_kwargs(shape, moe.MoeOptions(), ep=1, etp=1, te=False))
    assert type(config).__name__ == "MLATransformerConfig" and config.q_lora_rank is None
    assert (config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (16, 12, 8, 10)
    assert config.moe_router_num_groups == 2 and config.moe_router_group_topk == 1
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
            config.mscale_all_dim) == ("yarn", 4.0, 8, 1.0)


def _megatron_names(shape: ModelShape) -> list[str]:
    """megatron-core's parameter names (local spec, EP 1) of a tiny MLA model, plus the routers' expert bias."""
    names = ["embedding.word_embeddings.weight"]
    for i, sparse in enumerate(shape.moe_layer_pattern):
        p = f"decoder.layers.{i}."
        q = (["linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight"] if shape.q_lora_rank
             else ["linear_q_proj.weight"])
        names += [p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"]
        names += [p + "self_attention." + n for n in q + ["linear_kv_down_proj.weight", "kv_layernorm.weight",
                                                           "linear_kv_up_proj.weight", "linear_proj.weight"]]
        if not sparse:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
            continue
        names += [p + "mlp.router.weight", p + "mlp.router.expert_bias", p + "mlp.shared_experts.linear_fc1.weight",
                  p + "mlp.shared_experts.linear_fc2.weight"]
        names += [f"{p}mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(shape.num_experts)
                  for k in (1, 2)]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]


@pytest.mark.parametrize("family", ["glm", "dsv3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_bitwise_under_tp(request, family: str, tp: int) -> None:
    from safetensors.torch import load_file

    d = request.getfixturevalue("tiny_glm_dir" if family == "glm" else "tiny_dsv3_dir")
    hf = load_file(str(d / "model.safetensors"))
    shape = _shape(_read(d))
    full, pairs = tp_round_trip(hf, shape, _megatron_names(shape), tp)
    back: dict[str, torch.Tensor] = {}
    for k, t in pairs:
        assert k not in back, k
        back[k] = t
    assert back.keys() == hf.keys()
    assert all(back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]) for k in hf)
    # the shards are megatron-core's: whole heads per TP rank, [gate_r; up_r] for the shared experts
    name = "decoder.layers.1.self_attention.linear_kv_up_proj.weight"
    heads = hf["model.layers.1.self_attn.kv_b_proj.weight"].view(shape.num_attention_heads, -1, shape.kv_lora_rank)
    assert torch.equal(shard(name, full[name], 0, tp - 1, tp).view(-1, *heads.shape[1:]),
                       heads[-shape.num_attention_heads // tp:])
    fc1 = "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"
    gate = hf["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    assert torch.equal(shard(fc1, full[fc1], 0, 0, tp)[:gate.shape[0] // tp], gate[:gate.shape[0] // tp])
    assert partition_dim("decoder.layers.0.self_attention.linear_kv_down_proj.weight") is None   # replicated


# ------------------------------------------------------------------------------------------- flags
GLM_SCRIPT = [  # the MLA and MoE shape flags of Miles's run_glm47_flash.py (tests/fixtures/miles_scripts)
    "--moe-layer-freq", "[0]*1+[1]*46", "--num-experts", "64", "--moe-shared-expert-intermediate-size", "1536",
    "--moe-router-topk", "4", "--moe-ffn-hidden-size", "1536", "--moe-router-score-function", "sigmoid",
    "--moe-router-pre-softmax", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk-scaling-factor", "1.8",
    "--moe-aux-loss-coeff", "0", "--moe-router-dtype", "fp32", "--num-layers", "47", "--hidden-size", "2048",
    "--ffn-hidden-size", "10240", "--num-attention-heads", "20", "--disable-bias-linear", "--add-qkv-bias", "--swiglu",
    "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-position-embedding",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--qk-layernorm", "--multi-latent-attention",
    "--q-lora-rank", "768", "--kv-lora-rank", "512", "--qk-head-dim", "192", "--v-head-dim", "256", "--kv-channels",
    "192", "--qk-pos-emb-head-dim", "64", "--vocab-size", "154880", "--rotary-base", "1000000", "--no-rope-fusion",
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-model-parallel-size", "8",
    "--expert-tensor-parallel-size", "1"]


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def _with(flags: list[str], **changes: str | None) -> list[str]:
    """``flags`` with ``--name value`` replaced (None: the flag dropped)."""
    out = list(flags)
    for name, value in changes.items():
        flag = "--" + name.replace("_", "-")
        i = out.index(flag)
        takes_value = i + 1 < len(out) and not out[i + 1].startswith("--")
        if value is None:
            del out[i:i + 1 + takes_value]
        else:
            out[i + 1] = value
    return out


def test_glm47_flash_flags_accepted(tiny_model_dir: Path) -> None:
    cfg = _cfg(tiny_model_dir, *GLM_SCRIPT)
    options.preflight_check(cfg, json.loads(GLM_JSON.read_text()))
    assert cfg.megatron.multi_latent_attention and cfg.megatron.q_lora_rank == 768


def test_kv_channels_is_not_a_shape_under_mla(tiny_model_dir: Path) -> None:
    """megatron-core's multi-latent attention never reads --kv-channels (its heads are --qk-head-dim +
    --qk-pos-emb-head-dim wide, values --v-head-dim): Miles's Kimi-K2 script passes 64 and its DeepSeek-V3 script 128
    for the same qk_nope_head_dim 128, so any value is taken; without MLA it is head_dim and checked."""
    for value in ("64", "128", "7"):
        cfg = _cfg(tiny_model_dir, *_with(GLM_SCRIPT, kv_channels=value))
        options.preflight_check(cfg, json.loads(GLM_JSON.read_text()))
    plain = _cfg(tiny_model_dir, "--kv-channels", "7")
    with pytest.raises(ConfigError, match=r"^--kv-channels 7 does not match --hf-checkpoint's config.json \(head_dim"):
        options.preflight_check(plain, _read(tiny_model_dir))


@pytest.mark.parametrize("changes,message", [
    ({"q_lora_rank": "512"}, "--q-lora-rank 512 does not match --hf-checkpoint's config.json (q_lora_rank 768)"),
    ({"kv_lora_rank": "256"}, "--kv-lora-rank 256 does not match --hf-checkpoint's config.json (kv_lora_rank 512)"),
    ({"qk_head_dim": "128"}, "--qk-head-dim 128 does not match --hf-checkpoint's config.json (qk_nope_head_dim 192)"),
    ({"qk_pos_emb_head_dim": "32"}, "--qk-pos-emb-head-dim 32 does not match --hf-checkpoint's config.json "
                                    "(qk_rope_head_dim 64)"),
    ({"v_head_dim": "128"}, "--v-head-dim 128 does not match --hf-checkpoint's config.json (v_head_dim 256)"),
    ({"multi_latent_attention": None}, "--multi-latent-attention is missing but --hf-checkpoint's config.json has "
                                       "kv_lora_rank 512"),
    ({"qk_layernorm": None}, "--qk-layernorm is missing but --hf-checkpoint's config.json has "
                             "q_a_layernorm/kv_a_layernorm present"),
    ({"moe_shared_expert_intermediate_size": "1024"}, "--moe-shared-expert-intermediate-size 1024 does not match "
                                                      "--hf-checkpoint's config.json (moe_intermediate_size x "
                                                      "n_shared_experts 1536)"),
    ({"moe_shared_expert_intermediate_size": None}, "--moe-shared-expert-intermediate-size is missing"),
    ({"moe_router_score_function": "softmax"}, "--moe-router-score-function softmax does not match "
                                               "--hf-checkpoint's config.json (router scores sigmoid)"),
    ({"moe_router_enable_expert_bias": None}, "--moe-router-enable-expert-bias is missing"),
    ({"moe_router_topk_scaling_factor": "2.5"}, "--moe-router-topk-scaling-factor 2.5 does not match "
                                                "--hf-checkpoint's config.json (routed_scaling_factor 1.8)"),
    ({"moe_router_topk_scaling_factor": None}, "--moe-router-topk-scaling-factor is missing"),
    ({"moe_router_bias_update_rate": "0.001"}, "--moe-router-bias-update-rate 0.001 is not supported"),
    ({"moe_layer_freq": "[1]*47"}, "--moe-layer-freq [1]*47 does not match"),
    ({"sequence_parallel": None}, "--tensor-model-parallel-size 4 with MoE layers needs --sequence-parallel"),
    ({"tensor_model_parallel_size": "3"}, "--tensor-model-parallel-size 3 does not divide"),
], ids=["q_lora", "kv_lora", "qk_head", "qk_pos", "v_head", "mla_missing", "qk_layernorm_missing",
        "shared_size", "shared_missing", "score_function", "bias_missing", "scaling", "scaling_missing", "bias_rate",
        "layer_freq", "tp_without_sp", "tp_divides"])
def test_glm47_flash_flags_checked_against_config_json(tiny_model_dir: Path, changes: dict, message: str) -> None:
    cfg = _cfg(tiny_model_dir, *_with(GLM_SCRIPT, **changes))
    with pytest.raises(ConfigError) as e:
        options.preflight_check(cfg, json.loads(GLM_JSON.read_text()))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("flags,message", [
    (["--moe-router-num-groups", "4"], "--moe-router-num-groups 4 does not match --hf-checkpoint's config.json "
                                       "(n_group 2)"),
    (["--moe-router-group-topk", "2"], "--moe-router-group-topk 2 does not match --hf-checkpoint's config.json "
                                       "(topk_group 1)"),
    (["--q-lora-rank", "24"], "--q-lora-rank 24 does not match --hf-checkpoint's config.json (q_lora_rank None)"),
], ids=["num_groups", "group_topk", "q_lora_absent"])
def test_deepseek_v3_flags(tiny_dsv3_dir: Path, flags: list[str], message: str) -> None:
    options.preflight_check(_cfg(tiny_dsv3_dir, "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"),
                            _read(tiny_dsv3_dir))
    with pytest.raises(ConfigError) as e:
        options.preflight_check(_cfg(tiny_dsv3_dir, *flags), _read(tiny_dsv3_dir))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("flags", [
    ["--context-parallel-size", "2"],
    ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
     "--decoder-first-pipeline-num-layers", "2", "--context-parallel-size", "2", "--expert-model-parallel-size", "2",
     "--expert-tensor-parallel-size", "1"],
], ids=["cp2", "cp2_a2a_ep2", "pp2", "tp2_pp2_cp2_ep2"])
def test_mla_runs_under_context_and_pipeline_parallelism(tiny_dsv3_dir: Path, flags: list[str]) -> None:
    """MLA is built under CP (its rotary angles of this rank's chunks, ``context_parallel.attention`` on values
    narrower than the keys) and PP (each stage its layers): the checks pass (the runs: test_megatron_mla.py)."""
    options.preflight_check(_cfg(tiny_dsv3_dir, "--actor-num-gpus-per-node", "8", "--moe-router-num-groups", "2",
                                 "--moe-router-group-topk", "1", *flags), _read(tiny_dsv3_dir))


@pytest.mark.parametrize("flags", [
    ["--context-parallel-size", "2", "--allgather-cp"],
    ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--attention-backend", "unfused"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
     "--decoder-last-pipeline-num-layers", "1", "--context-parallel-size", "2", "--expert-model-parallel-size", "2",
     "--expert-tensor-parallel-size", "1", "--allgather-cp"],
], ids=["cp2_allgather_cp", "cp2_a2a_unfused", "tp2_pp2_cp2_ep2"])
def test_dsa_runs_under_context_parallelism(tmp_path: Path, flags: list[str]) -> None:
    """DeepSeek sparse attention under CP (its keys, values and indexer keys all-gathered over the CP group,
    whatever --cp-comm-type, and DSA's own core attention whatever --attention-backend: the shared CP attention's
    checks do not apply; Miles's --allgather-cp accepted, the same values), with PP and EP as GLM-5's disaggregated
    profile runs them: the checks pass (the runs: test_megatron_dsa.py::test_dsa_cp2_matches_cp1)."""
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    d = build_tiny_dsa_model(tmp_path / "dsa")
    options.preflight_check(_cfg(d, "--actor-num-gpus-per-node", "8", *flags), _read(d))


def test_dsa_pipeline_stages_start_with_a_full_layer(tmp_path: Path) -> None:
    """DSA under pipeline parallelism: any split of full layers runs; with GLM-5.2's shared top-k layers a stage
    must not start with a shared layer (its source layer's top-k is on an earlier stage): one line naming the split
    flags, and the split that keeps the pair on one stage passes; nor be recomputed under PP (one line)."""
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    pp = ["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"]
    full = build_tiny_dsa_model(tmp_path / "dsa")
    for split in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        options.preflight_check(_cfg(full, *pp, split, "1"), _read(full))
    shared = build_tiny_dsa_model(tmp_path / "glm52", indexer_types=["full", "shared", "full"])
    options.preflight_check(_cfg(shared, *pp, "--decoder-last-pipeline-num-layers", "1"), _read(shared))  # [0, 1] [2]
    with pytest.raises(ConfigError) as e:                                                             # [0] [1, 2]
        options.preflight_check(_cfg(shared, *pp, "--decoder-first-pipeline-num-layers", "1"), _read(shared))
    assert str(e.value).startswith("--pipeline-model-parallel-size 2: pipeline stage 1 would start with decoder "
                                   "layer 1, a shared DSA layer") and "\n" not in str(e.value), str(e.value)
    assert "--decoder-first-pipeline-num-layers" in str(e.value)
    with pytest.raises(ConfigError) as e:       # under 1F1B a recomputed shared layer would read a later micro-batch's
        options.preflight_check(_cfg(shared, *pp, "--decoder-last-pipeline-num-layers", "1", "--recompute-granularity",
                                     "full"), _read(shared))
    assert str(e.value).startswith("--recompute-granularity full with --pipeline-model-parallel-size 2 and shared "
                                   "DSA layers") and "\n" not in str(e.value), str(e.value)
    options.preflight_check(_cfg(full, *pp, "--decoder-last-pipeline-num-layers", "1", "--recompute-granularity",
                                 "full"), _read(full))     # full layers only: each recomputes its own top-k


def test_dsa_shared_layer_without_its_source_is_refused_when_built() -> None:
    """A shared layer's core attention is built only after its source full layer in the same model (stage)."""
    from miles.trainer.megatron.families.dsa import DsaShape, LayerCoreAttention, TopkHolder

    dsa = DsaShape(index_n_heads=2, index_head_dim=8, index_topk=4, rope_dim=4, rope_interleaved=True,
                   full_layers=(True, False, True))
    with pytest.raises(ValueError, match="DSA layer 2 shares the top-k of layer 1, which is not built"):
        LayerCoreAttention(None, layer_number=2, dsa=dsa, topk_holder=TopkHolder())


def test_mla_flags_on_standard_attention_are_refused(tiny_model_dir: Path) -> None:
    for flags in (["--multi-latent-attention"], ["--kv-lora-rank", "512"]):
        with pytest.raises(ConfigError) as e:
            options.preflight_check(_cfg(tiny_model_dir, *flags), _read(tiny_model_dir))
        assert str(e.value).startswith(f"{flags[0]} is given but --hf-checkpoint's config.json describes standard "
                                       "attention"), str(e.value)


@pytest.mark.parametrize("config,message", [
    ({"rope_interleave": False}, "rope_interleave false"),
    ({"attention_bias": True}, "attention_bias true is not supported with multi-latent attention"),
    ({"norm_topk_prob": False}, "norm_topk_prob false with a sigmoid router is not supported"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 4}, "n_group 2 with num_experts_per_tok 4 / topk_group 1"),
], ids=["rope_interleave", "attention_bias", "norm_topk_prob", "group_score"])
def test_unsupported_mla_configs_are_one_line(tiny_glm_dir: Path, config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        options.preflight_check(_cfg(tiny_glm_dir), _read(tiny_glm_dir) | config)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sparse_glm47_flash_has_its_mtp_layer() -> None:
    """The sparse real-shape model of GLM-4.7-Flash lists the checkpoint's MTP layer (model.layers.47: transformers
    skips it, the hub checkpoint stores it), so the dry run's size checks see the real parameter count."""
    import math

    from miles.utils.sparse_model import checkpoint_tensors

    tensors = checkpoint_tensors(json.loads(GLM_JSON.read_text()))
    assert tensors["model.layers.47.eh_proj.weight"] == [2048, 4096]
    assert tensors["model.layers.47.shared_head.head.weight"] == [154880, 2048]
    assert tensors["model.layers.47.mlp.experts.63.down_proj.weight"] == [2048, 1536]
    assert tensors["model.layers.46.self_attn.kv_b_proj.weight"] == [20 * (192 + 256), 512]
    assert not any(n.startswith("model.layers.48.") for n in tensors)
    assert sum(math.prod(s) for s in tensors.values()) == 31_221_488_576


# ------------------------------------------------------------------ YaRN rope flags and Kimi-K2 (yarn.py)
@pytest.fixture(scope="module")
def tiny_kimi_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_mla import KIMI_K2_YARN, build_tiny_mla_model

    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_kimi"), model_type="kimi_k2", rope_scaling=KIMI_K2_YARN,
                                max_position_embeddings=256)


# the rope flags of Miles's scripts/models/kimi-k2.py (radixark/miles@v0.1.0), original context scaled to the tiny model
KIMI_ROPE = ["--rope-type", "yarn", "--rotary-scaling-factor", "32.0", "--original-max-position-embeddings", "8",
             "--beta-fast", "1", "--beta-slow", "1", "--mscale", "1.0", "--mscale-all-dim", "1.0"]


def test_kimi_k2_is_built_as_deepseek_v3_with_its_yarn(tiny_kimi_dir: Path) -> None:
    from miles.utils.model_dir import load_config

    shape = options.shape_of(load_config(tiny_kimi_dir, "--hf-checkpoint"))
    assert shape.model_type == "kimi_k2" and shape.mla and shape.yarn == (32.0, 8.0, 1.0, 1.0, 1.0, 1.0)
    options.preflight_check(_cfg(tiny_kimi_dir, *KIMI_ROPE), _read(tiny_kimi_dir))


@pytest.mark.parametrize("changes,message", [
    ({"rotary_scaling_factor": "40"}, "--rotary-scaling-factor 40.0 does not match --hf-checkpoint's config.json "
                                      "(rope_scaling factor 32.0)"),
    ({"beta_fast": "32"}, "--beta-fast 32.0 does not match --hf-checkpoint's config.json (rope_scaling beta_fast 1.0)"),
    ({"beta_slow": "2"}, "--beta-slow 2.0 does not match --hf-checkpoint's config.json (rope_scaling beta_slow 1.0)"),
    ({"original_max_position_embeddings": "4096"}, "--original-max-position-embeddings 4096 does not match "
                                                   "--hf-checkpoint's config.json (rope_scaling "
                                                   "original_max_position_embeddings 8.0)"),
    ({"mscale": "0.707"}, "--mscale 0.707 does not match --hf-checkpoint's config.json (rope_scaling mscale 1.0)"),
    ({"mscale_all_dim": "0"}, "--mscale-all-dim 0.0 does not match --hf-checkpoint's config.json (rope_scaling "
                              "mscale_all_dim 1.0)"),
    ({"rope_type": "rope"}, "--rope-type rope does not match --hf-checkpoint's config.json (rope_scaling rope_type "
                            "yarn)"),
], ids=["factor", "beta_fast", "beta_slow", "original", "mscale", "mscale_all_dim", "rope_type"])
def test_yarn_flags_checked_against_config_json(tiny_kimi_dir: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        options.preflight_check(_cfg(tiny_kimi_dir, *_with(KIMI_ROPE, **changes)), _read(tiny_kimi_dir))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_yarn_flags_without_rope_scaling(tiny_glm_dir: Path, tiny_model_dir: Path) -> None:
    """config.json without rope scaling: yarn of factor 1 (Miles's MLA default; JoyAI's --mscale 1.0) is plain RoPE and
    accepted; another factor, or --rope-type yarn on standard attention, is one line naming config.json's value."""
    options.preflight_check(_cfg(tiny_glm_dir, "--rope-type", "yarn", "--mscale", "1.0", "--mscale-all-dim", "1.0"),
                            _read(tiny_glm_dir))
    for model, flags, message in (
            (tiny_glm_dir, ["--rotary-scaling-factor", "40"], "--rotary-scaling-factor 40.0 does not match "
                                                               "--hf-checkpoint's config.json (rope_scaling none"),
            (tiny_model_dir, ["--rope-type", "yarn"], "--rope-type yarn does not match --hf-checkpoint's config.json "
                                                      "(rope_scaling none")):
        with pytest.raises(ConfigError) as e:
            options.preflight_check(_cfg(model, *flags), _read(model))
        assert str(e.value).startswith(message), str(e.value)


def test_rope_flags_need_the_megatron_backend(tiny_kimi_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--rope-type \(and 6 more Megatron flags\) needs --train-backend megatron"):
        parse_args(["--hf-checkpoint", str(tiny_kimi_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
                    "--train-backend", "fsdp", *KIMI_ROPE])


@pytest.mark.parametrize("model_type,nearest", [("deepseek_v2", "deepseek_v32 (DeepSeek-V3.2)")])
def test_a_family_not_built_names_the_nearest(tiny_kimi_dir: Path, model_type: str, nearest: str) -> None:
    with pytest.raises(ConfigError) as e:
        options.preflight_check(_cfg(tiny_kimi_dir), _read(tiny_kimi_dir) | {"model_type": model_type})
    msg = str(e.value)
    assert f"does not build model_type {model_type!r}; the nearest family it builds is {nearest}" in msg, msg
    assert "\n" not in msg
