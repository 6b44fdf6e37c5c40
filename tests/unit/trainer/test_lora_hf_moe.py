"""The FSDP backend's LoRA on MoE experts (``miles/trainer/lora_hf.py``) on real transformers models built locally
(tiny Qwen3-MoE; tiny GLM-4.5-MoE with a dense first layer and a shared expert), one process.

The merged-weights reference: the adapter forward (each routed expert's linear plus its adapter, inside the fused
experts' loop) gives the logits of a plain model whose weights are ``W + (alpha / r) B @ A`` (``HFLoraAdapters.delta``,
what the weight export adds); B = 0 gives the base model bit for bit. The adapters are drawn as the Megatron
backend draws them; shared-outer holds one fc1 ``A`` and one fc2 ``B`` per layer. FSDP against the Megatron backend,
DP 2 against one rank and the weight sync run on real gloo ranks in ``tests/multiprocess/test_fsdp_lora_moe.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _lora_hf import hf_model, lora_spec, merged_reference

from miles.config import ConfigError, parse_args
from miles.trainer import lora, lora_hf

ALL = ("linear_fc1", "linear_fc2", "linear_proj", "linear_qkv")


@pytest.fixture(scope="module")
def glm_moe_dir(tmp_path_factory):
    from miles.utils.tiny_glm4_moe import build_tiny_glm4_moe

    return build_tiny_glm4_moe(tmp_path_factory.mktemp("glm4_moe"))


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    from miles.utils.tiny_gpt_oss import build_tiny_gpt_oss_model

    return build_tiny_gpt_oss_model(tmp_path_factory.mktemp("gpt_oss"))


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "gpt_oss"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_expert", "shared_outer"])
def test_expert_adapters_equal_their_merged_weights(request, family: str, shared: bool) -> None:
    path = request.getfixturevalue({"qwen3_moe": "tiny_moe_dir", "glm4_moe": "glm_moe_dir",
                                    "gpt_oss": "gpt_oss_dir"}[family])
    model, base = hf_model(path), hf_model(path)
    cfg = json.loads((path / "config.json").read_text())
    lora_hf.check_model(lora_spec(ALL, shared), cfg)            # passes: no refusal
    ad = lora_hf.attach_hf(model, model.model.layers, lora_spec(ALL, shared), seed=5)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    experts = model.model.layers[moe_layers[0]].mlp.experts
    n = experts.gate_up_proj.shape[0]
    assert len(ad.pairs) == 2 * n * len(moe_layers) and len(ad.shared) == (2 * len(moe_layers) if shared else 0)
    assert {f"model.layers.{i}.mlp.experts.{w}" for i in moe_layers for w in ("gate_up_proj", "down_proj")} \
        <= ad.hf_targets()
    if family == "glm4_moe":          # the dense first layer's MLP and the shared experts' linears: dense targets
        assert "model.layers.0.mlp.gate_proj.weight" in ad.hf
        assert f"model.layers.{moe_layers[0]}.mlp.shared_experts.down_proj.weight" in ad.hf
    if family == "gpt_oss":           # [E, H, 2I], gate and up interleaved: delta's column 2j is B's gate row j
        f = ad.fused[f"model.layers.{moe_layers[0]}.mlp.experts.gate_up_proj"]
        with torch.no_grad():
            f.pairs[1].lora_B.normal_()
        d, half = ad.delta(f"model.layers.{moe_layers[0]}.mlp.experts.gate_up_proj")[1], f.pairs[1].lora_B.shape[0] // 2
        want = (f.pairs[1].lora_B @ f.pairs[1].lora_A).detach() * 2.0
        assert d.shape == experts.gate_up_proj.shape[1:]
        torch.testing.assert_close(d[:, 0::2], want[:half].t(), rtol=0, atol=0)    # measured: bit for bit (CPU)
        torch.testing.assert_close(d[:, 1::2], want[half:].t(), rtol=0, atol=0)
        with torch.no_grad():
            f.pairs[1].lora_B.zero_()
    # the Megatron backend's draw: the seed and the expert's Megatron name (the layer's for a shared outer factor)
    layer = moe_layers[0]
    fc1 = ad.pairs[f"decoder/layers/{layer}/mlp/experts/local_experts/1/linear_fc1"]
    name = f"decoder.layers.{layer}.mlp.experts" + ("" if shared else ".local_experts.1") + ".linear_fc1"
    assert torch.equal(fc1.lora_A.detach(), lora._init_a(4, fc1.lora_A.shape[1], 5, name))
    a1 = [ad.pairs[f"decoder/layers/{layer}/mlp/experts/local_experts/{e}/linear_fc1"].lora_A for e in range(n)]
    b2 = [ad.pairs[f"decoder/layers/{layer}/mlp/experts/local_experts/{e}/linear_fc2"].lora_B for e in range(n)]
    assert all(x is a1[0] for x in a1) == shared and all(x is b2[0] for x in b2) == shared
    assert not any(p.requires_grad for p in model.parameters())

    r = merged_reference(model, base, ad)
    assert r.base_exact                                                      # B = 0: the base model bit for bit
    # fp32 rounding: measured (2026-12) per-expert / shared-outer 3.2e-6 / 2.1e-6 (qwen3_moe), 1.1e-6 / 7.4e-7
    # (glm4_moe), 9.0e-6 / 8.6e-6 (gpt_oss: x @ W + b, clamped SwiGLU) while the adapters move the logits by ~0.7;
    # bounded at about twice the family's largest
    bound = {"qwen3_moe": 6.5e-6, "glm4_moe": 2.5e-6, "gpt_oss": 2e-5}[family]
    assert r.err < bound and r.moved > 1e-2, (r.err, r.moved)

    # a backward reaches every hit expert's adapters, never a base weight
    model(input_ids=r.ids).logits.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    grads = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in ad.parameters()]
    assert sum(grads) > 0.9 * len(grads), (sum(grads), len(grads))


def test_peft_names_and_the_merged_export_of_the_experts(tiny_moe_dir) -> None:
    model = hf_model(tiny_moe_dir)
    ad = lora_hf.attach_hf(model, model.model.layers, lora_spec(("linear_fc1", "linear_fc2")), seed=1)
    with torch.no_grad():
        for p in ad.parameters():
            p.normal_()
    peft = dict(lora_hf.peft_tensors(ad))
    pre = "base_model.model.model.layers.1.mlp.experts.2"
    pair = ad.pairs["decoder/layers/1/mlp/experts/local_experts/2/linear_fc1"]
    rows = pair.lora_B.shape[0] // 2
    assert torch.equal(peft[f"{pre}.gate_proj.lora_A.weight"], pair.lora_A.detach())
    assert torch.equal(peft[f"{pre}.up_proj.lora_B.weight"], pair.lora_B.detach()[rows:])
    assert f"{pre}.down_proj.lora_B.weight" in peft and len(peft) == 2 * 4 * 3 * 2     # layers x E x linears x A/B
    live = {p.untyped_storage().data_ptr() for p in ad.parameters()}      # copies, never views of the live adapters
    assert not live & {t.untyped_storage().data_ptr() for t in peft.values()}
    w = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    (bucket,) = lora_hf.merge_buckets(ad, iter([[("model.layers.1.mlp.experts.gate_up_proj", w.detach())]]),
                                      torch.bfloat16)
    want = (w[2].float() + (pair.lora_B @ pair.lora_A) * 2.0).to(torch.bfloat16)
    assert bucket[0][1].dtype == torch.bfloat16 and torch.equal(bucket[0][1][2], want)


def test_refusals(tiny_moe_dir, tiny_model_dir, tmp_path) -> None:
    from miles.utils.tiny_gpt_oss import build_tiny_gpt_oss_model

    moe = json.loads((tiny_moe_dir / "config.json").read_text())
    dense = json.loads((tiny_model_dir / "config.json").read_text())
    gpt_oss = json.loads((build_tiny_gpt_oss_model(tmp_path / "gpt_oss") / "config.json").read_text())
    lora_hf.check_model(lora_spec(ALL, True), moe)
    lora_hf.check_model(lora_spec(ALL, True), gpt_oss)
    qwen2_moe = {"model_type": "qwen2_moe", "num_experts": 4}                  # a layout not built here
    lora_hf.check_model(lora_spec(("linear_proj", "linear_qkv")), qwen2_moe)   # attention only: fine
    with pytest.raises(ConfigError, match=r"^--target-modules .* LoRA on the MoE experts of qwen2_moe"):
        lora_hf.check_model(lora_spec(ALL), qwen2_moe)
    with pytest.raises(ConfigError, match=r"^--experts-shared-outer-loras .* the model has no MoE experts"):
        lora_hf.check_model(lora_spec(ALL, True), dense)
    with pytest.raises(ConfigError, match=r"^--experts-shared-outer-loras .* selects no expert linear"):
        lora_hf.check_model(lora_spec(("linear_qkv",), True), moe)
    cfg = parse_args(["--hf-checkpoint", str(tiny_moe_dir), "--train-backend", "fsdp", "--num-rollout", "1",
                      "--rollout-batch-size", "2", "--lora-rank", "4", "--target-modules", "all-linear",
                      "--experts-shared-outer-loras"])
    lora_hf.check_fsdp(cfg, moe)
