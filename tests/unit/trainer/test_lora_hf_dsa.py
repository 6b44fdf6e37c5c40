"""The FSDP backend's LoRA on DeepSeek sparse attention (``miles/trainer/lora_hf.py``'s ``DSA_MODEL_TYPES``: GLM-5 /
5.1 ``glm_moe_dsa``, GLM-5.2's shared top-k layers, DeepSeek-V3.2 ``deepseek_v32``) on real transformers models built
locally (``miles.utils.tiny_dsa``: MLA with q LoRA, a dense first layer, DeepSeek-style MoE with a shared expert, the
lightning indexer), one process.

Miles's GLM-5.1 / 5.2 LoRA recipes' ``--target-modules`` (radixark/miles@v0.1.0:scripts/run_glm5_1_744b_a40b_lora.py
and run_glm5_2_744b_a40b_lora.py: ``q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,q_a_proj,
kv_a_proj_with_mqa,q_b_proj,kv_b_proj``, "excluding the DSA indexer (wq_b/wk/weights_proj)", with
``--experts-shared-outer-loras``) map on transformers' modules: every MLA projection (``q_a_proj``, ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``), the dense layer's and the shared experts' MLP, every routed
expert; q/k/v select nothing (MLA has no ``k_proj``), the indexer's linears nothing. The merged-weights reference:
the adapter forward gives the logits of a plain model whose weights are ``W + (alpha / r) B @ A`` (what the weight
export adds; the indexer's top-k reads the adapted q latent in both), B = 0 the base model bit for bit; a backward
reaches the adapters only (the indexer is under ``no_grad`` in transformers, frozen as on the Megatron backend); the
PEFT export names transformers' modules. FSDP against the Megatron backend on real gloo ranks:
``tests/multiprocess/test_fsdp_lora_dsa.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _lora_hf import merged_reference

from miles.config.lora import resolve
from miles.trainer import lora, lora_hf

# radixark/miles@v0.1.0:scripts/run_glm5_2_744b_a40b_lora.py's _DEFAULT_TARGET_MODULES (run_glm5_1_744b_a40b_lora.py's)
GLM5_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,q_a_proj,kv_a_proj_with_mqa,q_b_proj,kv_b_proj"
DSA = {"glm5": dict(), "glm52": dict(indexer_types=["full", "shared", "full"]),
       "dsv32": dict(model_type="deepseek_v32", n_group=2, topk_group=1)}


def _spec(targets: str, shared: bool = False) -> lora.LoraSpec:
    return lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=resolve(targets).leaves, experts_shared_outer=shared)


@pytest.fixture(scope="module", params=sorted(DSA))
def dsa_dir(request, tmp_path_factory):
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    return request.param, build_tiny_dsa_model(tmp_path_factory.mktemp(request.param), index_n_heads=8,
                                               **DSA[request.param])


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("shared", [False, True], ids=["per_expert", "shared_outer"])
def test_dsa_adapters_equal_their_merged_weights(dsa_dir, shared: bool) -> None:
    family, path = dsa_dir
    model, base = _model(path), _model(path)
    cfg = json.loads((path / "config.json").read_text())
    spec = _spec(GLM5_TARGETS, shared)
    lora_hf.check_model(spec, cfg)                        # passes: no refusal
    ad = lora_hf.attach_hf(model, model.model.layers, spec, seed=5)
    n = len(model.model.layers)
    attn = {f"decoder.layers.{i}.self_attention.{t}" for i in range(n) for t in
            ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")}
    mlp = {"decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2"} | {
        f"decoder.layers.{i}.mlp.shared_experts.linear_fc{k}" for i in range(1, n) for k in (1, 2)}
    experts = {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}" for i in range(1, n)
               for e in range(4) for k in (1, 2)}
    assert set(ad.targets) == attn | mlp | experts        # no linear_qkv (MLA), nothing of the indexer
    assert not any(".indexer." in k for k in ad.hf_targets())
    assert len(ad.shared) == (2 * (n - 1) if shared else 0)
    if family == "glm52":                                 # the shared top-k layer has no indexer, its MLA adapted
        assert model.model.layers[1].self_attn.indexer is None
        assert "model.layers.1.self_attn.q_a_proj.weight" in ad.hf
    # the Megatron backend's draw: the seed and the Megatron module name, the full input width
    q_up = ad.groups["decoder/layers/2/self_attention/linear_q_up_proj"]
    assert torch.equal(q_up.lora_A.detach(), lora._init_a(4, cfg["q_lora_rank"], 5,
                                                          "decoder.layers.2.self_attention.linear_q_up_proj"))
    assert not any(p.requires_grad for p in model.parameters())

    r = merged_reference(model, base, ad, seq_len=12)  # longer than index_topk (4): sparse from the fifth token
    assert r.base_exact                                   # B = 0: the base model bit for bit
    err, moved, ids = r.err, r.moved, r.ids
    print({"family": family, "shared": shared, "hooked_vs_merged": err, "moved": moved})
    # fp32 rounding: measured (2026-12-07, CPU; pytest -s -k merged) per-expert glm5 / glm52 / dsv32 2.1e-6 / 2.3e-6 /
    # 4.4e-6, shared-outer 3.4e-6 / 1.2e-6 / 3.4e-6, while the adapters move the logits by 0.73 .. 1.21 (a top-k key
    # flipped by the rounding would show as ~0.1); bounded at about twice the largest
    assert err < 9e-6 and moved > 1e-2, (err, moved)

    # a backward reaches the adapters (every attention one), never a base weight (the indexer's included)
    model(input_ids=ids).logits.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(g.lora_A.grad is not None and g.lora_A.grad.abs().sum() > 0 for k, g in ad.groups.items()
               if "self_attention" in k)


def test_dsa_peft_export_names_transformers_modules(dsa_dir) -> None:
    """The PEFT adapter (``--save-hf``'s ``adapter/``, ``--sglang-enable-lora``'s sync) names transformers' modules:
    ``base_model.model.<module>.lora_A/B.weight`` for every MLA projection, and each routed expert as its checkpoint's
    per-expert linears (``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj``) with the Megatron backend's
    shapes; nothing of the indexer."""
    family, path = dsa_dir
    model = _model(path)
    ad = lora_hf.attach_hf(model, model.model.layers, _spec(GLM5_TARGETS, True), seed=0)
    peft = dict(lora_hf.peft_tensors(ad))
    modules = {n for n, _ in model.named_modules()}
    cfg = json.loads((path / "config.json").read_text())
    for name in peft:
        module = name.removeprefix("base_model.model.").rsplit(".", 2)[0]
        assert name.endswith((".lora_A.weight", ".lora_B.weight")) and ".indexer." not in name, name
        if ".mlp.experts." in module:                     # the checkpoint's per-expert linear
            layer, e, m = module.split(".")[2], module.split(".")[5], module.split(".")[6]
            assert int(layer) >= 1 and int(e) < 4 and m in ("gate_proj", "up_proj", "down_proj"), name
        else:
            assert module in modules, name
    a = peft["base_model.model.model.layers.1.self_attn.kv_a_proj_with_mqa.lora_A.weight"]
    b = peft["base_model.model.model.layers.1.self_attn.kv_a_proj_with_mqa.lora_B.weight"]
    assert a.shape == (4, cfg["hidden_size"]) and b.shape == (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], 4)
    up = peft["base_model.model.model.layers.2.mlp.experts.3.up_proj.lora_A.weight"]
    gate = peft["base_model.model.model.layers.2.mlp.experts.3.gate_proj.lora_A.weight"]
    assert torch.equal(up, gate) and up.shape == (4, cfg["hidden_size"])
    # shared-outer: every expert of a layer exports the same fc1 A (and fc2 B)
    assert torch.equal(up, peft["base_model.model.model.layers.2.mlp.experts.0.up_proj.lora_A.weight"])
    n_attn = sum(1 for k in peft if ".self_attn." in k)
    assert n_attn == 2 * 5 * cfg["num_hidden_layers"], n_attn
