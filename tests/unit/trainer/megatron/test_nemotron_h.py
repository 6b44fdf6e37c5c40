"""Nemotron-H on the Megatron backend without ranks: the shape of a config.json, the HF <-> Megatron conversion
(bitwise round trip under TP, Mamba's in_proj / conv1d split by sections), Miles's Nemotron-3 Super flags checked
against config.json (``--moe-latent-size``), one line for what is not built. Parity with transformers:
tests/multiprocess/test_megatron_nemotron_h.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from _tp_round_trip import round_trip_under_tp

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options
from miles.trainer.megatron.convert import shard
from miles.trainer.megatron.model import ModelShape

pytest.importorskip("megatron.core")

# A config.json of Nemotron-3 Super's sizes (radixark/miles@v0.1.0:scripts/models/nemotron-3-super-120b-a12b.py:
# 88 layers, hidden 4096, 32 heads / 2 KV groups of 128, 512 experts top-22 of 2688, shared 5376, latent 1024,
# sigmoid router scaled by 5.0). The layer pattern and the Mamba sizes are not in Miles's script: illustrative.
SUPER = {"model_type": "nemotron_h", "hidden_size": 4096, "hybrid_override_pattern": "MEM*EMEMEM" * 8 + "MEMEMEM*",
         "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 2688,
         "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
         "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 512,
         "num_experts_per_tok": 22, "moe_intermediate_size": 2688, "moe_shared_expert_intermediate_size": 5376,
         "moe_latent_size": 1024, "routed_scaling_factor": 5.0, "n_group": 1, "topk_group": 1, "vocab_size": 131072,
         "max_position_embeddings": 262144, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5}
SCRIPT = [  # Miles's model flags of Nemotron-3 Super (the recorded command); its layout with TP 2 and PP 1 (below)
    "--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "32", "--num-query-groups", "2",
    "--kv-channels", "128", "--num-layers", "88", "--hidden-size", "4096", "--ffn-hidden-size", "2688",
    "--normalization", "RMSNorm", "--position-embedding-type", "none", "--vocab-size", "131072",
    "--make-vocab-size-divisible-by", "128", "--untie-embeddings-and-output-weights", "--num-experts", "512",
    "--moe-router-topk", "22", "--moe-ffn-hidden-size", "2688", "--moe-shared-expert-intermediate-size", "5376",
    "--moe-latent-size", "1024", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-grouped-gemm", "--moe-router-dtype", "fp32", "--moe-router-num-groups", "1", "--moe-router-group-topk",
    "1", "--moe-router-topk-scaling-factor", "5.0", "--moe-router-pre-softmax", "--moe-router-load-balancing-type",
    "seq_aux_loss", "--moe-router-bias-update-rate", "0", "--moe-aux-loss-coeff", "0",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "8",
    "--expert-tensor-parallel-size", "1"]


@pytest.fixture(scope="module")
def tiny_nemotron_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    return build_tiny_nemotron_model(tmp_path_factory.mktemp("tiny_nemotron"))


def _shape(config: dict) -> ModelShape:
    from transformers import AutoConfig, PretrainedConfig

    d = PretrainedConfig._decode_special_floats(dict(config))     # config.json's {"__float__": "Infinity"}
    return ModelShape.from_hf_config(AutoConfig.for_model(d.pop("model_type"), **d))


def test_shape_of_a_super_config_and_its_megatron_config() -> None:
    from miles.trainer.megatron.families import nemotron_h

    shape = _shape(SUPER)
    v = nemotron_h.own(shape)
    assert shape.num_layers == 88 and v.pattern == SUPER["hybrid_override_pattern"] and v.latent_size == 1024
    assert (shape.num_experts, shape.moe_router_topk, shape.moe_shared_ffn_hidden_size) == (512, 22, 5376)
    assert shape.moe_score_function == "sigmoid" and shape.moe_topk_scaling == 5.0 and shape.moe_expert_bias
    kw = shape.family.config_kwargs(shape)
    assert kw["moe_latent_size"] == 1024 and kw["gated_linear_unit"] is False
    assert (kw["mamba_num_heads"], kw["mamba_head_dim"], kw["mamba_num_groups"], kw["mamba_state_dim"]) == \
        (128, 64, 8, 128)


def _megatron_names(net_shape: ModelShape, kv_replicated: bool = False) -> list[str]:
    from miles.trainer.megatron.families import nemotron_h

    qkv = ["self_attention.linear_q.weight", "self_attention.linear_kv.weight"] if kv_replicated else [
        "self_attention.linear_qkv.weight"]

    names = ["embedding.word_embeddings.weight"]
    for i, kind in enumerate(nemotron_h.own(net_shape).pattern):
        p = f"decoder.layers.{i}."
        if kind == "M":
            names += [p + "norm.weight"] + [p + "mixer." + n for n in (
                "in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                "out_proj.weight")]
        elif kind == "*":
            names += [p + n for n in ("input_layernorm.weight", *qkv, "self_attention.linear_proj.weight")]
        elif kind == "-":
            names += [p + n for n in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
        else:
            names += [p + n for n in ("pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.router.expert_bias",
                                      "mlp.fc1_latent_proj.weight", "mlp.fc2_latent_proj.weight",
                                      "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight")]
            names += [f"{p}mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(net_shape.num_experts)
                      for k in (1, 2)]
    return names + ["decoder.final_norm.weight", "output_layer.weight"]


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bitwise_under_tp(tiny_nemotron_dir: Path, tp: int) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(tiny_nemotron_dir / "model.safetensors"))
    shape = _shape(json.loads((tiny_nemotron_dir / "config.json").read_text()))
    full = round_trip_under_tp(hf, shape, _megatron_names(shape), tp)
    if tp == 2:   # rank 1's in_proj: the second half of each of z, x, B, C, dt (megatron-core's per-rank layout)
        w = hf["backbone.layers.0.mixer.in_proj.weight"]
        d, gn, h = 64, 32, 8
        sections = w.split([d, d, gn, gn, h])
        want = torch.cat([s.chunk(2)[1] for s in sections])
        name = "decoder.layers.0.mixer.in_proj.weight"
        assert torch.equal(shard(name, full[name], 0, 1, 2, shape), want)


@pytest.fixture(scope="module")
def tiny_nemotron_one_kv_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    return build_tiny_nemotron_model(tmp_path_factory.mktemp("tiny_nemotron_one_kv"), num_kv_heads=1)


def test_round_trip_is_bitwise_with_kv_heads_replicated(tiny_nemotron_one_kv_dir: Path) -> None:
    """TP 2 over one KV head (``kv_replicate.py``): ``linear_q`` = ``q_proj`` split over TP by heads, ``linear_kv`` =
    [k_proj; v_proj] of the head, whole on every rank; the round trip is bitwise."""
    from safetensors.torch import load_file

    from miles.trainer.megatron.convert import partition_dim

    hf = load_file(str(tiny_nemotron_one_kv_dir / "model.safetensors"))
    shape = _shape(json.loads((tiny_nemotron_one_kv_dir / "config.json").read_text()))
    assert shape.num_query_groups == 1
    full = round_trip_under_tp(hf, shape, _megatron_names(shape, kv_replicated=True), 2)
    layer = "decoder.layers.2.self_attention."                    # the pattern's '*'
    k, v = hf["backbone.layers.2.mixer.k_proj.weight"], hf["backbone.layers.2.mixer.v_proj.weight"]
    assert torch.equal(full[layer + "linear_kv.weight"], torch.cat([k, v]))
    assert partition_dim(layer + "linear_kv.weight") is None and partition_dim(layer + "linear_q.weight") == 0
    q = hf["backbone.layers.2.mixer.q_proj.weight"]
    assert torch.equal(shard(layer + "linear_q.weight", full[layer + "linear_q.weight"], 0, 1, 2, shape),
                       q.chunk(2)[1])                              # rank 1: the second half of the query heads


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def test_super_flags_accepted(tiny_model_dir: Path) -> None:
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT), SUPER)


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",        # the recorded layout:
     "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8"],                         # 16 ranks, 8 a stage
    ["--tensor-model-parallel-size", "4"],                   # 2 KV heads replicated over TP 4 (kv_replicate.py)
    ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "1"],
], ids=["tp4_pp2_ep8", "tp4", "pp2"])
def test_recorded_layouts_accepted(tiny_model_dir: Path, extra: list[str]) -> None:
    """The recorded Super command runs TP 4 (over 2 KV heads), PP 2 (MoE layers on both stages) and EP 8."""
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT, *extra), SUPER)


@pytest.mark.parametrize("config,extra,message", [
    ({}, ["--context-parallel-size", "2", "--expert-model-parallel-size", "1", "--tensor-model-parallel-size", "1"],
     "scan state is not passed between context-parallel ranks"),
    ({"num_attention_heads": 24, "num_key_value_heads": 3}, ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
     r"--tensor-model-parallel-size 2 does not divide config.json's num_key_value_heads 3; .*or, for this family, a "
     "multiple of them"),
    ({"num_nextn_predict_layers": 1}, ["--mtp-num-layers", "1"], "--mtp-num-layers 1 with Nemotron-H: its MTP layers"),
])
def test_layouts_not_built_are_one_line(tiny_model_dir: Path, config: dict, extra: list[str], message: str) -> None:
    """CP, a TP size that neither divides the KV heads nor is a multiple of them, and the MTP layers: one line each
    naming what is not built."""
    base = [] if config else SCRIPT
    with pytest.raises(ConfigError, match=message) as e:
        options.preflight_check(_cfg(tiny_model_dir, *base, *extra), SUPER | config)
    assert "\n" not in str(e.value)


def test_mtp_layers_of_the_checkpoint_are_not_built(tiny_model_dir: Path) -> None:
    """Nemotron-3 Super's config.json has one MTP layer (num_nextn_predict_layers 1): as Miles's bridge, the main model
    is built and trained without it."""
    shape = _shape(SUPER | {"num_nextn_predict_layers": 1})
    assert shape.nextn_layers == 1 and shape.mtp_num_layers == 0
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT), SUPER | {"num_nextn_predict_layers": 1})


def test_moe_latent_size_checked_against_config_json(tiny_model_dir: Path) -> None:
    flags = list(SCRIPT)
    flags[flags.index("--moe-latent-size") + 1] = "512"
    with pytest.raises(ConfigError, match=r"--moe-latent-size 512 does not match .*moe_latent_size 1024"):
        options.preflight_check(_cfg(tiny_model_dir, *flags), SUPER)
    qwen = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="--moe-latent-size 1024 does not match .*no latent MoE"):
        options.preflight_check(_cfg(tiny_model_dir, "--moe-latent-size", "1024"), qwen)
    with pytest.raises(ConfigError, match="--position-embedding-type rope does not match"):
        options.preflight_check(_cfg(tiny_model_dir, *SCRIPT, "--position-embedding-type", "rope"), SUPER)


@pytest.mark.parametrize("change,message", [
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias true is not supported"),
])
def test_unsupported_configs_are_one_line(tiny_model_dir: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        options.preflight_check(_cfg(tiny_model_dir), SUPER | change)


# ------------------------------------------------------------------------------------------- the recorded Ultra command
# radixark/miles@v0.1.0:tests/snapshots/launch_scripts/py/scripts/run_nemotron_3_ultra_550b_a55b.py/train.txt, after
# train.py, with {MODEL}, {DATA}, {OUT} for its paths
ULTRA_COMMAND = """--disable-bias-linear --group-query-attention --num-attention-heads 64 --num-query-groups 2 --kv-channels 128
--num-layers 4 --hidden-size 8192 --ffn-hidden-size 5120 --normalization RMSNorm --position-embedding-type none
--vocab-size 131072 --make-vocab-size-divisible-by 128 --untie-embeddings-and-output-weights --num-experts 512
--moe-router-topk 22 --moe-ffn-hidden-size 5120 --moe-shared-expert-intermediate-size 10240 --moe-latent-size 2048
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-grouped-gemm --moe-router-dtype fp32
--moe-router-num-groups 1 --moe-router-group-topk 1 --moe-router-topk-scaling-factor 5.0 --moe-router-pre-softmax
--moe-router-load-balancing-type seq_aux_loss --moe-router-bias-update-rate 0 --moe-aux-loss-coeff 0
--hf-checkpoint {MODEL} --ref-load {MODEL} --megatron-to-hf-mode bridge --save {OUT}/checkpoints --save-interval 50
--no-save-optim --prompt-data {DATA} --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
--rm-type deepscaler --num-rollout 30 --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 8192
--rollout-temperature 1 --global-batch-size 128 --balance-data --optimizer adam --lr 1e-6 --lr-decay-style constant
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
--use-precision-aware-optimizer --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl
--entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --use-wandb --wandb-project miles-run_nemotron_3_ultra_550b_a55b
--wandb-group 260101-000000-000 --wandb-key frozen-wandb-api-key --disable-wandb-random-suffix
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 --expert-model-parallel-size 8
--expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--use-dynamic-batch-size --max-tokens-per-gpu 1024 --log-probs-chunk-size 128 --rollout-num-gpus-per-engine 8
--sglang-ep-size 8 --sglang-dp-size 2 --sglang-enable-dp-attention --sglang-mem-fraction-static 0.6
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend auto --colocate --actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8
--dump-details {OUT}/dump_details"""
# Nemotron-3 Ultra's 4-layer cut at the sizes of Miles's model flags (scripts/models/nemotron-3-ultra-550b-a55b-4layer.py);
# its layer pattern and Mamba sizes are not in Miles's script: illustrative
ULTRA_4LAYER = SUPER | {"architectures": ["NemotronHForCausalLM"], "hidden_size": 8192, "hybrid_override_pattern": "MEM*",
                        "num_attention_heads": 64, "intermediate_size": 5120, "mamba_num_heads": 256,
                        "moe_intermediate_size": 5120, "moe_shared_expert_intermediate_size": 10240,
                        "moe_latent_size": 2048, "torch_dtype": "bfloat16"}


def _drop(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
    return argv[:i] + argv[i + 1 + takes_value:]


def test_recorded_ultra_command_dry_run(tmp_path: Path) -> None:
    """The recorded Nemotron-3 Ultra command against a full-size (sparse) Ultra-shaped checkpoint: every model and
    Megatron check passes (``--moe-latent-size``, ``--position-embedding-type none``, EP 8 at TP 1). The flags that
    need a package absent here (``--moe-grouped-gemm``: transformer-engine; ``--sglang-ep-size``, ``--sglang-dp-size``,
    ``--sglang-enable-dp-attention``: SGLang, the embedded engine has no expert-parallel serving) are refused in one
    line naming the first of them, and the dry run passes without them."""
    import importlib.util

    from miles_fixtures import write_workdir

    from miles.run.entry import dry_run
    from miles.run.preflight import checkpoint_bytes
    from miles.utils.sparse_model import build_sparse_model

    model = build_sparse_model(tmp_path / "ultra", ULTRA_4LAYER)
    work = write_workdir(tmp_path / "work")
    argv = ULTRA_COMMAND.format(MODEL=model, DATA=work / "data.jsonl", OUT=tmp_path / "out").split() + ["--dry-run"]
    absent = ([] if importlib.util.find_spec("transformer_engine") else ["--moe-grouped-gemm"]) + \
        ([] if importlib.util.find_spec("sglang") else ["--sglang-ep-size", "--sglang-dp-size",
                                                          "--sglang-enable-dp-attention"])
    # the Ultra checkpoint (fp32 weights + Adam moments, ~52 GiB) may not fit this machine's /tmp: then --save is
    # refused as well, by the same preflight, and the passing run goes without it
    need = checkpoint_bytes(parse_args(argv))
    if need and shutil.disk_usage(tmp_path).free < need:
        absent.append("--save")
    if absent:
        with pytest.raises(ConfigError) as e:
            dry_run(parse_args(argv))
        msg = str(e.value)
        assert "\n" not in msg, msg
        firsts = ([p.split(" ", 1)[0] for p in re.split(r" ?\(\d+\) ", msg)[1:]] if "problems found before" in msg
                  else [msg.split(" ", 1)[0]])
        assert firsts and all(f in absent for f in firsts), msg
    for flag in absent:
        argv = _drop(argv, flag)
    assert "role plan" in dry_run(parse_args(argv))


# ------------------------------------------------------------------------------------------- the recorded Nano command
# radixark/miles@v0.1.0:tests/snapshots/launch_scripts/py/scripts/run_nemotron_3_nano.py/execute.txt (the dense
# Nemotron-3-Nano-4B at TP 2 + SP x PP 2), after train.py, with {MODEL}, {DATA}, {OUT} for its paths
NANO_COMMAND = """--disable-bias-linear --group-query-attention --num-attention-heads 40 --num-query-groups 8 --kv-channels 128
--num-layers 42 --hidden-size 3136 --ffn-hidden-size 12544 --normalization RMSNorm --position-embedding-type none
--vocab-size 131072 --make-vocab-size-divisible-by 128 --untie-embeddings-and-output-weights --hf-checkpoint {MODEL}
--ref-load {MODEL} --save {OUT}/checkpoints --save-interval 20 --megatron-to-hf-mode bridge --prompt-data {DATA}
--input-key prompt --label-key label --apply-chat-template --rollout-shuffle --rm-type deepscaler --num-rollout 10
--rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 4096 --rollout-temperature 1
--global-batch-size 256 --balance-data --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.98 --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
--entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --use-wandb --wandb-project miles-run_nemotron_3_nano
--wandb-group 260101-000000-000 --wandb-key frozen-wandb-api-key --disable-wandb-random-suffix
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 --attention-dropout 0.0 --hidden-dropout 0.0
--accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend auto --colocate
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --num-gpus-per-node 8 --rollout-num-gpus 8"""
# Nemotron-3-Nano-4B at the sizes of Miles's model flags (radixark/miles@v0.1.0:scripts/models/nemotron-3-nano-4b.py:
# 42 layers, hidden 3136, FFN 12544, 40 heads / 8 KV groups of 128, vocab 131072, untied); its layer pattern (dense:
# Mamba, attention, MLP) and Mamba sizes are not in Miles's script: illustrative (the FSDP Nano fixture's model,
# tests/fixtures/miles_scripts/models/README.md)
NANO_4B = json.loads((Path(__file__).resolve().parents[3] / "fixtures/miles_scripts/models/NVIDIA-Nemotron-3-Nano-4B.json")
                     .read_text())


def test_recorded_nano_command_dry_run(tmp_path: Path) -> None:
    """The recorded Nemotron-3-Nano-4B command (TP 2 + SP with PP 2 on the dense hybrid) passes ``--dry-run`` against
    a full-size (sparse) Nano-4B-shaped checkpoint; its PP 2 splits the 42 layers 21 + 21."""
    from miles_fixtures import write_workdir

    from miles.run.entry import dry_run
    from miles.trainer.megatron.pipeline import stage_layer_counts
    from miles.utils.sparse_model import build_sparse_model

    shape = _shape(NANO_4B)
    assert (shape.num_layers, shape.num_experts, shape.hidden_size) == (42, 0, 3136)
    assert stage_layer_counts(shape.num_layers, 2) == [21, 21]
    model = build_sparse_model(tmp_path / "nano", NANO_4B)
    work = write_workdir(tmp_path / "work")
    argv = NANO_COMMAND.format(MODEL=model, DATA=work / "data.jsonl", OUT=tmp_path / "out").split() + ["--dry-run"]
    assert "role plan" in dry_run(parse_args(argv))
