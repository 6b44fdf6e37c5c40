"""MoE on the Megatron backend (miles/trainer/megatron/moe.py): the shape read from a Qwen3-MoE config.json, the
HF <-> megatron-core converter for router and experts (bitwise, under any EP split), and Megatron's MoE flags
(accepted with Megatron-LM's meaning and checked against config.json, or refused by name in one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import moe, options
from miles.trainer.megatron.convert import hf_to_megatron, megatron_to_hf
from miles.trainer.megatron.model import ModelShape, padded_vocab_size


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_model import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"), mlp_only_layers=(1,), num_layers=3)


def _hf_config(d: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(d)


def test_shape_from_qwen3_moe_config(tiny_moe_dir: Path) -> None:
    shape = ModelShape.from_hf_config(_hf_config(tiny_moe_dir))
    assert (shape.num_experts, shape.moe_router_topk, shape.moe_ffn_hidden_size, shape.moe_norm_topk_prob) == (
        4, 2, 32, True)
    assert shape.moe_layer_pattern == (1, 0, 1) and shape.qk_layernorm and not shape.tie_embeddings
    kw = moe.config_kwargs(shape, moe.MoeOptions(), ep=2, etp=1, te=False)
    assert kw["moe_layer_freq"] == [1, 0, 1] and kw["moe_token_dispatcher_type"] == "alltoall"
    assert kw["moe_router_pre_softmax"] is False and kw["moe_aux_loss_coeff"] == 0.0
    assert moe.config_kwargs(shape, moe.MoeOptions(), ep=1, etp=1, te=False)["moe_token_dispatcher_type"] == "allgather"


def _megatron_names(shape: ModelShape, ep: int, ep_rank: int, grouped: bool = False) -> list[str]:
    """This EP rank's megatron-core parameter names (local spec, or TE grouped experts)."""
    names = ["embedding.word_embeddings.weight"]
    for i, sparse in enumerate(shape.moe_layer_pattern):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight", p + "self_attention.q_layernorm.weight",
                  p + "self_attention.k_layernorm.weight", p + "pre_mlp_layernorm.weight"]
        if not sparse:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
            continue
        names.append(p + "mlp.router.weight")
        local = shape.num_experts // ep
        if grouped:
            names += [f"{p}mlp.experts.linear_fc{k}.weight{e}" for k in (1, 2) for e in range(local)]
        else:
            names += [f"{p}mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(local) for k in (1, 2)]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]


@pytest.mark.parametrize("ep,grouped", [(1, False), (2, False), (4, False), (2, True)],
                         ids=["ep1", "ep2", "ep4", "ep2_te_grouped"])
def test_round_trip_is_bitwise_under_any_ep_split(tiny_moe_dir: Path, ep: int, grouped: bool) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(tiny_moe_dir / "model.safetensors"))
    shape = ModelShape.from_hf_config(_hf_config(tiny_moe_dir))
    padded = padded_vocab_size(shape.vocab_size, 128, 1)
    back: dict[str, torch.Tensor] = {}
    for rank in range(ep):
        local = _megatron_names(shape, ep, rank, grouped)
        names = [moe.global_name(n, rank, shape.num_experts // ep) for n in local]
        full = hf_to_megatron(hf, shape, padded, names)
        fc1 = next(n for n in names if "experts" in n and "fc1" in n)
        assert full[fc1].shape == (2 * 32, 64)                     # [gate; up] of one expert
        for name in names:
            for k, t in megatron_to_hf(name, full[name], shape):
                assert k not in back or torch.equal(back[k], t), k
                back[k] = t.clone()
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_global_expert_names() -> None:
    assert moe.global_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight", 2, 4) == \
        "decoder.layers.3.mlp.experts.local_experts.9.linear_fc2.weight"
    assert moe.global_name("decoder.layers.0.mlp.experts.linear_fc1.weight3", 1, 8) == \
        "decoder.layers.0.mlp.experts.linear_fc1.weight11"
    assert moe.global_name("decoder.layers.0.mlp.router.weight", 1, 8) == "decoder.layers.0.mlp.router.weight"
    assert moe.is_expert("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
    assert not moe.is_expert("decoder.layers.0.mlp.router.weight")


# ------------------------------------------------------------------------------------------- flags
QWEN3_MOE_SCRIPT = [  # the MoE flags of Miles's run_qwen3_30b_a3b.py, with the tiny model's values
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-router-score-function",
    "softmax", "--moe-token-dispatcher-type", "alltoall", "--moe-layer-freq", "[1,0,1]", "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion", "--moe-aux-loss-coeff",
    "0", "--moe-router-load-balancing-type", "aux_loss", "--moe-router-bias-update-rate", "0.001",
    "--moe-router-topk-scaling-factor", "1.0", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
    "1"]


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def _hf(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def test_miles_moe_flags_accepted_with_megatron_meaning(tiny_moe_dir: Path) -> None:
    cfg = _cfg(tiny_moe_dir, *QWEN3_MOE_SCRIPT)
    options.preflight_check(cfg, _hf(tiny_moe_dir))
    o = options.resolve(cfg.megatron, cfg.train)
    assert (o.ep, o.etp, o.moe.dispatcher, o.moe.router_dtype, o.moe.grouped_gemm) == (2, 1, "alltoall", "fp32", True)
    assert cfg.megatron.moe_aux_loss_coeff == [0.0] and cfg.megatron.moe_layer_freq == "[1,0,1]"


def test_moe_flags_need_the_megatron_backend(tiny_moe_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--num-experts needs --train-backend megatron"):
        parse_args(["--hf-checkpoint", str(tiny_moe_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
                    "--train-backend", "fsdp",
                    "--num-experts", "4"])


@pytest.mark.parametrize("flags,message", [
    (["--num-experts", "8"], "--num-experts 8 does not match --hf-checkpoint's config.json (num_experts 4)"),
    (["--moe-router-topk", "1"], "--moe-router-topk 1 does not match --hf-checkpoint's config.json "
                                 "(num_experts_per_tok 2)"),
    (["--moe-ffn-hidden-size", "64"], "--moe-ffn-hidden-size 64 does not match --hf-checkpoint's config.json "
                                      "(moe_intermediate_size 32)"),
    (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function sigmoid does not match"),
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias (given) does not match"),
    (["--moe-shared-expert-intermediate-size", "64"], "--moe-shared-expert-intermediate-size 64 does not match"),
    (["--moe-router-topk-scaling-factor", "2.5"], "--moe-router-topk-scaling-factor 2.5 does not match"),
    (["--moe-router-pre-softmax"], "--moe-router-pre-softmax (given) does not match --hf-checkpoint's config.json "
                                   "(norm_topk_prob True)"),
    (["--moe-layer-freq", "1"], "--moe-layer-freq 1 does not match --hf-checkpoint's config.json (MoE layers"),
    (["--moe-layer-freq", "([1]*2+[0])"], "--moe-layer-freq ([1]*2+[0]) does not match"),
    (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq \"__import__('os')\" is neither a positive int"),
    (["--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff 0.01 is not supported: neither training backend"),
    (["--moe-router-load-balancing-type", "sinkhorn"], "--moe-router-load-balancing-type sinkhorn is not supported"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex needs DeepEP"),
    (["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3 does not divide config.json's "
                                            "num_experts 4"),
    (["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
     "--moe-token-dispatcher-type allgather with --expert-model-parallel-size 2 needs the same number of tokens"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2 is not supported"),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2 with MoE layers needs --sequence-parallel"),
], ids=["num_experts", "topk", "ffn", "score_function", "expert_bias", "shared_expert", "topk_scaling", "pre_softmax",
        "layer_freq_int", "layer_freq_list", "layer_freq_code", "aux_loss", "sinkhorn", "flex", "ep_divides", "allgather_ep",
        "etp", "tp_without_sp"])
def test_moe_flags_checked_against_config_json(tiny_moe_dir: Path, flags: list[str], message: str) -> None:
    cfg = _cfg(tiny_moe_dir, *flags)
    with pytest.raises(ConfigError) as e:
        options.preflight_check(cfg, _hf(tiny_moe_dir))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("flags", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
    ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
    ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"],
    ["--expert-model-parallel-size", "2", "--context-parallel-size", "2"],
], ids=["tp_cp", "distopt_ep", "ep_pp", "ep_cp"])
def test_moe_parallel_layouts_pass_the_checks(tiny_moe_dir: Path, flags: list[str]) -> None:
    """The layouts tests/multiprocess/test_megatron_moe.py::test_moe_parallel_layouts_match_fsdp trains."""
    options.preflight_check(_cfg(tiny_moe_dir, *flags), _hf(tiny_moe_dir))
    assert options.resolve(_cfg(tiny_moe_dir, *flags).megatron).distributed_optimizer     # Miles's default


def test_moe_flags_on_a_dense_model_are_refused(tiny_model_dir: Path) -> None:
    for flags, message in ((["--num-experts", "4"], "--num-experts is given but --hf-checkpoint's config.json "
                                                    "describes a dense model"),
                           (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs an MoE model")):
        with pytest.raises(ConfigError) as e:
            options.preflight_check(_cfg(tiny_model_dir, *flags), _hf(tiny_model_dir))
        assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("value,pattern", [("2", (1, 0, 1, 0)), ("[1,1,0,1]", (1, 1, 0, 1)),
                                           ("([0]*1+[1]*3)", (0, 1, 1, 1))])
def test_layer_freq_forms(value: str, pattern: tuple[int, ...]) -> None:
    assert moe.layer_pattern(moe.parse_layer_freq(int(value) if value.isdigit() else value), 4) == pattern


def test_engine_param_index_resolves_per_expert_names(tiny_moe_dir: Path) -> None:
    """The embedded engine's parameter index: transformers' fused experts under the checkpoint's per-expert
    names, as views (a write through a name reaches the fused weight); iteration covers the live tensors only."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.engine.model_runner import ParamIndex

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    index = ParamIndex(model.state_dict(keep_vars=True))
    hf = load_file(str(tiny_moe_dir / "model.safetensors"))
    assert all(k in index and torch.equal(index[k], hf[k]) and torch.equal(index.get(k), hf[k]) for k in hf)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in list(index)
    up = index.get("model.layers.2.mlp.experts.3.up_proj.weight")
    up.data.copy_(torch.full_like(up, 7.0))
    fused = model.model.layers[2].mlp.experts.gate_up_proj
    assert bool((fused[3, 32:] == 7.0).all()) and not bool((fused[3, :32] == 7.0).any())
    assert index.get("model.layers.0.mlp.experts.9.up_proj.weight") is None
