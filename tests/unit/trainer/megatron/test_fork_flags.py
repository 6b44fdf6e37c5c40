"""The flags of Miles's Megatron fork (miles/trainer/megatron/fork_flags.py) against real config.json shapes
(tests/fixtures/miles_scripts/models/): Miles's recorded DeepSeek-V4-Flash 4-layer model flags pass as recorded, each
changed value is refused in one line naming the flag, its value, the config.json key and the config's value; a fork
flag on a model without what it names is refused naming it; --model-name names config.json's model or is refused."""

from __future__ import annotations

import json

import pytest
from miles_fixtures import MODELS

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options

# radixark/miles@v0.1.0:tests/snapshots/model_args/deepseek-v4-flash-4layer.txt (scripts/models/deepseek-v4-flash.py
# with 4 layers), as recorded but for --moe-grouped-gemm (transformer-engine: refused by package where it does not
# import, miles/config/kernels.py)
V4_FLASH_4LAYER = (
    "--disable-bias-linear --num-layers 4 --hidden-size 4096 --ffn-hidden-size 2048 --num-attention-heads 64 "
    "--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 129280 --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--multi-latent-attention --q-lora-rank 1024 --kv-lora-rank 512 --qk-head-dim 512 --qk-pos-emb-head-dim 64 "
    "--v-head-dim 512 --qk-layernorm --rotary-scaling-factor 16 --rotary-base 10000 "
    "--original-max-position-embeddings 65536 --beta-fast 32 --beta-slow 1 --attention-softmax-in-fp32 "
    "--no-rope-fusion --num-experts 256 --moe-layer-freq [1,1,1,1] --moe-ffn-hidden-size 2048 --moe-router-topk 6 "
    "--moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax --moe-router-score-function sqrtsoftplus "
    "--moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type "
    "alltoall --moe-aux-loss-coeff 0 --moe-router-topk-scaling-factor 1.5 --experimental-attention-variant dsv4 "
    "--dsv4-hc-mult 4 --dsv4-hc-sinkhorn-iters 20 --dsv4-compress-ratios 0 0 4 128 --dsv4-compress-rope-theta 160000 "
    "--dsv4-o-groups 8 --dsv4-o-lora-rank 1024 --dsv4-n-hash-layers 3 --dsv4-window-size 128 "
    "--dsa-indexer-n-heads 64 --dsa-indexer-head-dim 128 --dsa-indexer-topk 512 --activation-func-clamp-value 10 "
    "--spec miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec --no-bias-swiglu-fusion "
    "--no-activation-func-clamp-shared-expert").split()
# the rest of the recorded command's fork flags (radixark/miles@v0.1.0:scripts/run_deepseek_v4.py)
V4_RUN = ["--moe-router-freeze-gate", "--freeze-e-score-correction-bias"]


def _cfg(*flags: str):
    return parse_args(["--hf-checkpoint", "/nonexistent", "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *flags])


def _model(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


def _refused(model: str, *flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        options.preflight_check(_cfg(*flags), _model(model))
    assert "\n" not in str(e.value)
    return str(e.value)


def _swap(argv: list[str], flag: str, *values: str) -> list[str]:
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i + 1] + list(values) + argv[j:]


def test_recorded_v4_flash_flags_pass_against_its_config() -> None:
    cfg = _cfg(*V4_FLASH_4LAYER, *V4_RUN)
    options.preflight_check(cfg, _model("DeepSeek-V4-Flash-4layer"))
    o = options.resolve(cfg.megatron, cfg.train)
    assert o.freeze_router_gate and not o.clamp_shared_expert
    # the full V4-Flash script's list: 43 layers and its MTP layer's ratio (radixark/miles@v0.1.0:scripts/models/
    # deepseek-v4-flash.py COMPRESS_RATIOS has 44 values): one value past the layers is the MTP layer's
    options.preflight_check(_cfg(*_swap(V4_FLASH_4LAYER, "--dsv4-compress-ratios", "0", "0", "4", "128", "0")),
                            _model("DeepSeek-V4-Flash-4layer"))


@pytest.mark.parametrize("flag,value,key,config_value", [
    ("--experimental-attention-variant", "dsa", "attention", "dsv4"),
    ("--dsv4-hc-mult", "8", "hc_mult", "4"),
    ("--dsv4-hc-sinkhorn-iters", "10", "hc_sinkhorn_iters", "20"),
    ("--dsv4-compress-ratios", "0 4 4 128", "layer_types / compress_rates", "0 0 4 128"),
    ("--dsv4-compress-rope-theta", "40000", "compress_rope_theta", "160000"),
    ("--dsv4-o-groups", "16", "o_groups", "8"),
    ("--dsv4-o-lora-rank", "512", "o_lora_rank", "1024"),
    ("--dsv4-n-hash-layers", "2", "mlp_layer_types hash_moe layers", "3"),
    ("--dsv4-window-size", "4096", "sliding_window", "128"),
    ("--dsa-indexer-n-heads", "32", "index_n_heads", "64"),
    ("--dsa-indexer-head-dim", "64", "index_head_dim", "128"),
    ("--dsa-indexer-topk", "2048", "index_topk", "512"),
    ("--activation-func-clamp-value", "7", "swiglu_limit", "10"),
    ("--kv-lora-rank", "256", "head_dim", "512"),
    ("--qk-pos-emb-head-dim", "32", "qk_rope_head_dim", "64"),
    ("--rotary-scaling-factor", "40", "rope_parameters compress factor", "16"),
    ("--beta-fast", "16", "rope_parameters compress beta_fast", "32"),
])
def test_each_v4_value_is_checked(flag: str, value: str, key: str, config_value: str) -> None:
    argv = _swap(V4_FLASH_4LAYER, flag, *value.split())
    msg = _refused("DeepSeek-V4-Flash-4layer", *argv)
    assert msg.startswith(f"{flag} {value} does not match --hf-checkpoint's config.json ({key} {config_value}"), msg


def test_v4_refuses_what_its_rope_lacks_and_a_short_layer_list() -> None:
    assert _refused("DeepSeek-V4-Flash-4layer", *V4_FLASH_4LAYER, "--mscale", "1.0").startswith(
        "--mscale 1 is given but DeepSeek-V4's compressed rope has no mscale")
    msg = _refused("DeepSeek-V4-Flash-4layer", *_swap(V4_FLASH_4LAYER, "--dsv4-compress-ratios", "0", "0", "4"))
    assert msg.startswith("--dsv4-compress-ratios 0 0 4 does not match"), msg


@pytest.mark.parametrize("model,flags,start", [
    ("Qwen3-4B", ["--dsv4-hc-mult", "4"], "--dsv4-hc-mult 4 is given but --hf-checkpoint's config.json (model_type "
                                          "qwen3) has no hyper-connections"),
    ("Qwen3-4B", ["--experimental-attention-variant", "dsv4"], "--experimental-attention-variant dsv4 is given but"),
    ("Qwen3-4B", ["--activation-func-clamp-value", "10"], "--activation-func-clamp-value 10 is given but"),
    ("Qwen3-4B", ["--moe-router-freeze-gate"], "--moe-router-freeze-gate is given but --hf-checkpoint's config.json "
                                               "describes a dense model"),
    ("GLM-5", ["--dsv4-window-size", "128"], "--dsv4-window-size 128 is given but"),
    ("GLM-5", ["--experimental-attention-variant", "dsv4"], "--experimental-attention-variant dsv4 does not match "
                                                            "--hf-checkpoint's config.json (attention dsa)"),
    ("GLM-5", ["--dsa-indexer-topk", "512"], "--dsa-indexer-topk 512 does not match --hf-checkpoint's config.json "
                                             "(index_topk 2048)"),
    ("GLM-5", ["--no-activation-func-clamp-shared-expert"], "--no-activation-func-clamp-shared-expert is given but"),
    ("gpt-oss-20b", ["--no-activation-func-clamp-shared-expert"], "--no-activation-func-clamp-shared-expert is given"),
    ("gpt-oss-20b", ["--activation-func-clamp-value", "10"], "--activation-func-clamp-value 10 does not match "
                                                             "--hf-checkpoint's config.json (swiglu_limit 7)"),
    ("Qwen3-Next-80B-A3B-Thinking", ["--experimental-attention-variant", "dsa"], "--experimental-attention-variant "
                                                                                 "dsa does not match"),
])
def test_fork_flags_on_other_families(model: str, flags: list[str], start: str) -> None:
    msg = _refused(model, *flags)
    assert msg.startswith(start), msg


@pytest.mark.parametrize("model,flags", [
    ("GLM-5", ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "32", "--dsa-indexer-head-dim",
               "128", "--dsa-indexer-topk", "2048", "--moe-router-freeze-gate", "--freeze-e-score-correction-bias"]),
    ("gpt-oss-20b", ["--activation-func-clamp-value", "7", "--no-bias-swiglu-fusion"]),
    ("Qwen3-Next-80B-A3B-Thinking", ["--experimental-attention-variant", "gated_delta_net"]),
])
def test_fork_flags_naming_the_model_pass(model: str, flags: list[str]) -> None:
    options.preflight_check(_cfg(*flags), _model(model))


def test_bad_values_are_refused_at_parse() -> None:
    for flags, start in ((["--dsv4-n-hash-layers", "-1"], "--dsv4-n-hash-layers must be >= 0"),
                         (["--dsv4-compress-ratios", "0", "-4"], "--dsv4-compress-ratios must be >= 0"),
                         (["--activation-func-clamp-value", "0"], "--activation-func-clamp-value must be a finite "
                                                                  "number > 0"),
                         (["--dsv4-hc-mult", "0"], "--dsv4-hc-mult must be positive")):
        with pytest.raises(ConfigError) as e:
            _cfg(*flags)
        assert str(e.value).startswith(start), e.value


def test_model_name_names_config_json_s_model() -> None:
    from miles.run.preflight import check_model_name

    check_model_name("deepseekv4", _model("DeepSeek-V4-Flash-4layer"))     # Miles's V4 scripts
    check_model_name("DeepseekV4Config", _model("DeepSeek-V4-Flash-4layer"))   # Miles's default: the config class
    check_model_name("deepseek-v3", _model("Kimi-K2-Instruct"))            # kimi_k2: DeepSeek-V3's config class
    check_model_name("glm_moe_dsa", _model("GLM-5"))
    with pytest.raises(ConfigError) as e:
        check_model_name("qwen3", _model("DeepSeek-V4-Flash-4layer"))
    assert str(e.value).startswith("--model-name qwen3 does not name --hf-checkpoint's model (config.json model_type "
                                   "deepseek_v4)"), e.value


def test_fp8_training_flags_are_refused_with_their_reason() -> None:
    for flag in ("--fp8-format", "--fp8-recipe", "--te-precision-config-file"):
        with pytest.raises(ConfigError) as e:
            _cfg(flag, "e4m3")
        assert str(e.value).startswith(f"{flag}: FP8 training (transformer-engine's FP8 GEMMs in the trainer) is not "
                                       "built"), e.value


def test_flags_reach_the_engine_argv() -> None:
    from miles.fleet.engines import model_server_flags

    cfg = _cfg("--no-activation-func-clamp-shared-expert")
    assert model_server_flags("embedded", cfg.megatron) == ["--no-activation-func-clamp-shared-expert"]
    assert model_server_flags("sglang", cfg.megatron) == [] == model_server_flags("embedded", _cfg().megatron)
    from miles.engine.__main__ import parse_args as engine_args

    assert engine_args(["--hf-checkpoint", "m", "--no-activation-func-clamp-shared-expert"]
                       ).no_activation_func_clamp_shared_expert


def test_models_json_parse() -> None:
    """The V4-Flash config reads as transformers and this build read it (4 layers: 2 sliding, CSA, HCA)."""
    from transformers import AutoConfig

    from miles.trainer.megatron.model import ModelShape

    d = _model("DeepSeek-V4-Flash-4layer")
    shape = ModelShape.from_hf_config(AutoConfig.for_model(d.pop("model_type"), **d))
    g = shape.variant
    assert (shape.num_layers, g.csa_rate, g.hca_rate, g.num_hash_layers, g.yarn) == (4, 4, 128, 3,
                                                                                      (16.0, 65536.0, 32.0, 1.0))


# radixark/miles@v0.1.0:scripts/models/deepseek-v4-flash.py COMPRESS_RATIOS: V4-Flash's 43 layers and its MTP layer
FLASH_RATIOS = "0 0 " + "4 128 " * 20 + "4 0"


def test_full_v4_flash_flags_of_the_amd_command() -> None:
    """Miles's AMD V4 command (radixark/miles@v0.1.0:tests/snapshots/launch_scripts/py/scripts/amd/run_deepseek_v4.py/
    full_train.txt) trains the whole V4-Flash: 43 layers, 44 compress ratios (the last its MTP layer's), against the
    43-layer config (the 4-layer one's, with V4-Flash's layer schedule)."""
    d = _model("DeepSeek-V4-Flash-4layer")
    kind = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    d.update(num_hidden_layers=43, layer_types=[kind[int(r)] for r in FLASH_RATIOS.split()[:43]],
             mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40)
    argv = _swap(_swap(_swap(V4_FLASH_4LAYER, "--num-layers", "43"), "--moe-layer-freq", "[" + ",".join("1" * 43) + "]"),
                 "--dsv4-compress-ratios", *FLASH_RATIOS.split())
    options.preflight_check(_cfg(*argv, *V4_RUN), d)
    d["layer_types"][2] = "heavily_compressed_attention"
    msg = _refused_dict(d, *argv)
    assert msg.startswith("--dsv4-compress-ratios 0 0 4 128") and "(layer_types / compress_rates 0 0 128 128" in msg


def _refused_dict(hf: dict, *flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        options.preflight_check(_cfg(*flags), hf)
    return str(e.value)
