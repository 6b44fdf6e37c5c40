"""``--target-modules`` as Miles and Megatron-Bridge read it (``miles/config/lora.py``, ``miles.trainer.lora``): leaf
names, Megatron-Bridge module paths with wildcards, the gated DeltaNet's ``in_proj`` / ``out_proj``; one process.

Training LoRA on the DeltaNet and its merged export run on real gloo ranks in
``tests/multiprocess/test_megatron_lora_gdn.py``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from miles.config import ConfigError, parse_args
from miles.config.lora import path_matches, resolve
from miles.trainer import lora

# radixark/miles@v0.1.0:scripts/run_qwen3_5_35b_a3b_lora.py's default --target-modules
_L = "language_model.decoder.layers.*"
QWEN35 = ",".join(f"{_L}.{m}" for m in (
    "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.experts.linear_fc1", "mlp.experts.linear_fc2",
    "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2", "self_attention.in_proj",
    "self_attention.out_proj"))


def test_module_paths_resolve_as_megatron_bridge_matches_them():
    t = resolve(QWEN35)
    assert t.leaves == () and len(t.paths) == 8 and t.exclude_paths == ()
    assert t.names == ("in_proj", "linear_fc1", "linear_fc2", "linear_proj", "linear_qkv", "out_proj")
    # Megatron-Bridge's own examples (megatron.bridge.peft.utils.wildcard_match): * is any run, dots included
    assert path_matches("*.layers.0.*.linear_qkv", "decoder.layers.0.self_attention.linear_qkv")
    assert not path_matches("*.layers.0.*.linear_qkv", "decoder.layers.1.self_attention.linear_qkv")
    assert path_matches(f"{_L}.mlp.experts.linear_fc1", "language_model.decoder.layers.12.mlp.experts.linear_fc1")
    assert not path_matches(f"{_L}.mlp.experts.linear_fc1", "decoder.layers.12.mlp.experts.linear_fc1")
    assert not path_matches("decoder.layers.1.mlp.linear_fc1", "decoder.layers.11.mlp.linear_fc1")
    # HF and Megatron names mix with paths; all-linear is Miles's (no DeltaNet projection); Qwen3-Next's HF names
    assert resolve("q_proj,decoder.layers.0.mlp.linear_fc2").leaves == ("linear_q_proj", "linear_qkv")
    assert "in_proj" not in resolve("all-linear").names and "out_proj" not in resolve("all-linear").names
    assert resolve("in_proj_qkvz,in_proj_ba,out_proj").leaves == ("in_proj", "out_proj")
    for bad, msg in (("decoder.layers.*.mlp.*", "must end in a Megatron linear's name"),
                     ("decoder.layers.*.mlp.gate", "must end in a Megatron linear's name"),
                     ("lm_head", "'lm_head' is not a LoRA target")):
        with pytest.raises(ConfigError, match=msg):
            resolve(bad)
    with pytest.raises(ConfigError, match="leaves no LoRA target"):
        resolve("decoder.layers.*.mlp.linear_fc1", "linear_fc1")


def test_bridge_names_and_selection():
    spec = lora.LoraSpec.from_config(parse_args(["--hf-checkpoint", "x", "--lora-rank", "4", "--target-modules",
                                                 QWEN35], validate=False).train)
    assert spec.paths and spec.targets == ()
    # the text model under language_model. (Megatron-Bridge's Qwen3.5 VL model); SequentialMLP's local experts also
    # answer to the grouped experts' name the recipe uses
    assert lora.bridge_names("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1", "language_model.") == [
        "language_model.decoder.layers.3.mlp.experts.local_experts.7.linear_fc1",
        "language_model.decoder.layers.3.mlp.experts.linear_fc1"]
    pre = "language_model."
    assert spec.selects("decoder.layers.3.self_attention.linear_qkv", pre)
    assert spec.selects("decoder.layers.0.self_attention.in_proj", pre)
    assert spec.selects("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2", pre)
    assert spec.selects("decoder.layers.3.mlp.shared_experts.linear_fc1", pre)
    assert not spec.selects("decoder.layers.3.self_attention.linear_qkv", "")          # a GPT model's names
    assert not spec.selects("mtp.layers.0.transformer_layer.self_attention.linear_qkv", pre)
    ex = lora.LoraSpec(rank=2, alpha=4, dropout=0.0, targets=("linear_qkv",), exclude_paths=("*.layers.0.*",))
    assert ex.selects("decoder.layers.1.self_attention.linear_qkv") and not ex.selects(
        "decoder.layers.0.self_attention.linear_qkv")


class _Layer(nn.Module):
    def __init__(self, h: int = 8):
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.in_proj = nn.Linear(h, 3 * h, bias=False)
        self.self_attention.out_proj = nn.Linear(h, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(h, 2 * h, bias=False)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(), _Layer()])
        self.mtp = nn.Module()
        self.mtp.layers = nn.ModuleList([_Layer()])


def test_attach_follows_paths_and_leaves_the_mtp_block():
    spec = lora.LoraSpec(rank=2, alpha=4, dropout=0.0, targets=("linear_fc1",),
                         paths=("language_model.decoder.layers.1.self_attention.in_proj", "*.out_proj"))
    ad = lora.attach(_Model(), spec, seed=1, path_prefix="language_model.", family_targets=("in_proj", "out_proj"))
    assert sorted(ad.targets) == ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.self_attention.out_proj",
                                  "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.self_attention.in_proj",
                                  "decoder.layers.1.self_attention.out_proj"]
    assert ad.pairs["decoder/layers/1/self_attention/in_proj"].kind == "column"
    assert ad.pairs["decoder/layers/0/self_attention/out_proj"].kind == "row"
    with pytest.raises(ConfigError, match="whose family builds no (in|out)_proj LoRA target"):   # e.g. Mamba
        lora.attach(_Model(), spec, seed=1, path_prefix="language_model.")
    with pytest.raises(ConfigError, match="no module of the model matches"):
        lora.attach(_Model(), lora.LoraSpec(rank=2, alpha=4, dropout=0.0, targets=(),
                                            paths=("decoder.layers.*.mlp.linear_fc1",)), seed=1,
                    path_prefix="language_model.")


def test_preflight_of_deltanet_targets(tiny_model_dir, tmp_path):
    """Miles's Qwen3.5 recipe's targets pass the Megatron preflight on a Qwen3.5 checkpoint (its MTP layer carried
    frozen); the DeltaNet's names on another family, --enable-mtp-training with LoRA, and paths on FSDP are one line
    each."""
    pytest.importorskip("megatron.core")
    from miles.trainer.lora_hf import check_model
    from miles.trainer.megatron import options
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    q35 = build_tiny_qwen35_model(tmp_path / "q35", vlm=True, mtp=True)
    hf = json.loads((q35 / "config.json").read_text())
    base = ["--hf-checkpoint", str(q35), "--train-backend", "megatron", "--num-rollout", "1", "--rollout-batch-size",
            "2", "--lora-rank", "4", "--target-modules", QWEN35, "--experts-shared-outer-loras", "--mtp-num-layers", "1"]
    options.preflight_check(parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                               "--expert-model-parallel-size", "2"]), hf)
    with pytest.raises(ConfigError, match=r"^--enable-mtp-training with --lora-rank"):
        options.preflight_check(parse_args(base + ["--enable-mtp-training"]), hf)
    dense = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"^--target-modules in_proj: LoRA on in_proj is built for Qwen3-Next / "
                                          r"Qwen3.5 only, not for"):
        options.preflight_check(parse_args(["--hf-checkpoint", str(tiny_model_dir), "--train-backend", "megatron",
                                            "--num-rollout", "1", "--rollout-batch-size", "2", "--lora-rank", "4",
                                            "--target-modules", "q_proj,in_proj"]), dense)
    for targets, msg in ((QWEN35, "module paths"), ("q_proj,out_proj", "^--target-modules out_proj: LoRA on out_proj is built for the gated DeltaNet")):
        with pytest.raises(ConfigError, match=msg):
            check_model(lora.LoraSpec.from_config(parse_args(["--hf-checkpoint", "x", "--lora-rank", "4",
                                                              "--target-modules", targets], validate=False).train),
                        dense)
