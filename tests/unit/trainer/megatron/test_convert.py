"""HF -> megatron-core -> HF round trip (full tensors and TP shards), bitwise, for each supported family."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from miles.trainer.megatron.convert import (  # noqa: E402
    hf_to_megatron,
    megatron_to_hf,
    partition_dim,
    shard,
    unshard,
)
from miles.trainer.megatron.model import ModelShape, padded_vocab_size  # noqa: E402


def tp_round_trip(hf: dict, shape: ModelShape, names: list[str], tp: int) -> tuple[dict, list]:
    """HF -> megatron-core (``hf_to_megatron`` of ``names``, vocabulary padded for ``tp``) -> ``tp`` shards of each
    tensor, each exactly 1/``tp`` of its partition dim -> unsharded -> HF: the full megatron tensors and the HF
    (name, tensor) pairs back, in order."""
    full = hf_to_megatron(hf, shape, padded_vocab_size(shape.vocab_size, 128, tp), names)
    pairs = []
    for name in names:
        dim = partition_dim(name)
        pieces = [shard(name, full[name], dim, r, tp) for r in range(tp)]
        if dim is not None and tp > 1:
            assert all(p.shape[dim] * tp == full[name].shape[dim] for p in pieces), name
        pairs += megatron_to_hf(name, unshard(name, pieces, dim), shape)
    return full, pairs


def _hf_model(family: str, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    kw = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    if family != "qwen2":
        kw["head_dim"] = 8
    torch.manual_seed(0)
    return cls[1](cls[0](**kw))


def _megatron_names(shape: ModelShape) -> list[tuple[str, int | None]]:
    """Megatron parameter names of the local spec with their TP partition dim."""
    names = [("embedding.word_embeddings.weight", 0)]
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        names += [(p + "input_layernorm.weight", None), (p + "self_attention.linear_qkv.weight", 0),
                  (p + "self_attention.linear_proj.weight", 1), (p + "pre_mlp_layernorm.weight", None),
                  (p + "mlp.linear_fc1.weight", 0), (p + "mlp.linear_fc2.weight", 1)]
        if shape.qkv_bias:
            names.append((p + "self_attention.linear_qkv.bias", 0))
        if shape.qk_layernorm:
            names += [(p + "self_attention.q_layernorm.weight", None), (p + "self_attention.k_layernorm.weight", None)]
    names.append(("decoder.final_layernorm.weight", None))
    if not shape.tie_embeddings:
        names.append(("output_layer.weight", 0))
    return names


@pytest.mark.parametrize("family,tie", [("qwen3", True), ("qwen3", False), ("qwen2", False), ("llama", True)])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_bitwise(family: str, tie: bool, tp: int) -> None:
    hf_model = _hf_model(family, tie)
    shape = ModelShape.from_hf_config(hf_model.config)
    hf = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if tie:
        hf.pop("lm_head.weight", None)
    names = _megatron_names(shape)
    for name, dim in names:
        assert partition_dim(name) == dim, name
    _, pairs = tp_round_trip(hf, shape, [n for n, _ in names], tp)
    back = dict(pairs)
    assert sorted(back) == sorted(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_qkv_layout_groups_heads() -> None:
    """linear_qkv rows of query group 0: its 2 query heads, then its key head, then its value head."""
    hf_model = _hf_model("qwen3", True)
    shape = ModelShape.from_hf_config(hf_model.config)
    sd = hf_model.state_dict()
    full = hf_to_megatron(sd, shape, 128, ["decoder.layers.0.self_attention.linear_qkv.weight"])
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    p, d = "model.layers.0.self_attn.", shape.kv_channels
    assert torch.equal(qkv[:2 * d], sd[p + "q_proj.weight"][:2 * d])
    assert torch.equal(qkv[2 * d:3 * d], sd[p + "k_proj.weight"][:d])
    assert torch.equal(qkv[3 * d:4 * d], sd[p + "v_proj.weight"][:d])


def test_unsupported_family_is_one_line() -> None:
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="--train-backend fsdp"):
        ModelShape.from_hf_config(GPT2Config())


def test_cpu_compat_refuses_other_versions(monkeypatch) -> None:
    from miles.trainer.megatron import compat

    monkeypatch.setattr(compat, "megatron_version", lambda: "0.19.2")
    with pytest.raises(RuntimeError, match="megatron-core==0.16.1"):
        compat.check_version()


def test_missing_shard_is_one_config_line(tiny_model_dir, tmp_path):
    """A model dir whose index names a shard that is not there: one ConfigError naming --hf-checkpoint."""
    import json
    import shutil

    from miles.config import ConfigError
    from miles.trainer.megatron.convert import read_hf_state_dict

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint .* has no gone\.safetensors"):
        read_hf_state_dict(d)
