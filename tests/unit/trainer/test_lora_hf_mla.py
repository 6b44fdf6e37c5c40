"""The FSDP backend's LoRA on multi-latent attention (``miles/trainer/lora_hf.py``'s ``MLA_GROUPS``) on real
transformers models built locally (``miles.utils.tiny_mla``: DeepSeek-V3 without q LoRA, Kimi-K2 and GLM-4.7-Flash with
it; a dense first layer, DeepSeek-style MoE with shared experts after it), one process.

Each Megatron MLA projection gets one pair on its HF linear, ``A`` drawn from the Megatron name as the Megatron backend
draws it; the merged-weights reference: the adapter forward gives the logits of a plain model whose weights are
``W + (alpha / r) B @ A`` (what the weight export adds), B = 0 the base model bit for bit; Kimi-K2.5's recipe targets
select their linears only. FSDP against the Megatron backend and the weight sync run on real gloo ranks in
``tests/multiprocess/test_fsdp_lora_moe.py`` (``mla`` cases).
"""

from __future__ import annotations

import json

import pytest
import torch
from _lora_hf import hf_model, lora_spec, merged_reference

from miles.config import ConfigError
from miles.trainer import lora, lora_hf

MLA = {"dsv3": dict(model_type="deepseek_v3", q_lora_rank=None, n_group=2, topk_group=1),
       "kimi": dict(model_type="kimi_k2"), "glm": dict(model_type="glm4_moe_lite")}
KIMI_K25 = "q_a_proj,kv_a_proj_with_mqa,o_proj,gate_proj,up_proj,down_proj"      # Kimi-K2.5's LoRA recipe


@pytest.fixture(scope="module", params=sorted(MLA))
def mla_dir(request, tmp_path_factory):
    from miles.utils.tiny_mla import build_tiny_mla_model

    return request.param, build_tiny_mla_model(tmp_path_factory.mktemp(request.param), **MLA[request.param])


def test_mla_adapters_equal_their_merged_weights(mla_dir) -> None:
    family, path = mla_dir
    model, base = hf_model(path), hf_model(path)
    cfg = json.loads((path / "config.json").read_text())
    spec = lora_spec("all-linear")
    lora_hf.check_model(spec, cfg)                       # passes: no refusal
    ad = lora_hf.attach_hf(model, model.model.layers, spec, seed=5)
    n = len(model.model.layers)
    q = ("linear_q_proj",) if family == "dsv3" else ("linear_q_down_proj", "linear_q_up_proj")
    attn = {f"decoder.layers.{i}.self_attention.{t}" for i in range(n)
            for t in (*q, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")}
    mlp = {"decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2"} | {
        f"decoder.layers.{i}.mlp.shared_experts.linear_fc{k}" for i in range(1, n) for k in (1, 2)}
    experts = {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}" for i in range(1, n)
               for e in range(4) for k in (1, 2)}
    assert set(ad.targets) == attn | mlp | experts          # no linear_qkv: MLA has no k_proj / v_proj
    hf_attn = ("q_proj",) if family == "dsv3" else ("q_a_proj", "q_b_proj")
    assert {f"model.layers.1.self_attn.{m}.weight" for m in (*hf_attn, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")} \
        <= set(ad.hf)
    # the Megatron backend's draw: the seed and the Megatron module name, the full input width
    kv_up = ad.groups["decoder/layers/2/self_attention/linear_kv_up_proj"]
    assert torch.equal(kv_up.lora_A.detach(), lora._init_a(4, cfg["kv_lora_rank"], 5,
                                                            "decoder.layers.2.self_attention.linear_kv_up_proj"))
    assert kv_up.lora_B["kv_b_proj"].shape == model.model.layers[2].self_attn.kv_b_proj.weight.shape[:1] + (4,)
    assert not any(p.requires_grad for p in model.parameters())

    r = merged_reference(model, base, ad)
    assert r.base_exact                                                      # B = 0: the base model bit for bit
    err, moved = r.err, r.moved
    print({"family": family, "hooked_vs_merged": err, "moved": moved})
    # fp32 rounding: measured (2026-12, CPU; pytest -s -k merged) dsv3 / glm / kimi 2.1e-6 / 2.2e-6 / 2.2e-6 while the
    # adapters move the logits by 0.80 / 0.73 / 0.73; bounded at about twice the largest
    assert err < 4.5e-6 and moved > 1e-2, (err, moved)

    # a backward reaches the adapters (every attention one), never a base weight
    model(input_ids=r.ids).logits.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(g.lora_A.grad is not None and g.lora_A.grad.abs().sum() > 0 for k, g in ad.groups.items()
               if "self_attention" in k)


def test_kimi_k25_recipe_targets(mla_dir) -> None:
    """Kimi-K2.5's ``--target-modules``: q_a_proj, kv_a_proj_with_mqa, o_proj and the MLPs (experts included);
    q_b_proj / kv_b_proj keep no adapter."""
    family, path = mla_dir
    model = hf_model(path)
    ad = lora_hf.attach_hf(model, model.model.layers, lora_spec(KIMI_K25), seed=0)
    attn = {k.rsplit(".", 1)[-1] for k in ad.targets if ".self_attention." in k}
    assert attn == ({"linear_proj", "linear_kv_down_proj"} | ({"linear_q_down_proj"} if family != "dsv3" else set()))
    assert not any(k.endswith(("q_b_proj.weight", "kv_b_proj.weight")) for k in ad.hf)
    assert len([k for k in ad.targets if ".local_experts." in k]) == 2 * 4 * 2


def test_mla_refusals() -> None:
    lora_hf.check_model(lora_spec("all-linear"), {"model_type": "kimi_k2", "kv_lora_rank": 16, "n_routed_experts": 4})
    # DeepSeek sparse attention adapts as DeepSeek-V3 (tests/unit/trainer/test_lora_hf_dsa.py); an MLA model type
    # not in MLA_MODEL_TYPES is refused
    lora_hf.check_model(lora_spec("q_a_proj"), {"model_type": "glm_moe_dsa", "kv_lora_rank": 512})
    with pytest.raises(ConfigError, match=r"^--lora-rank on the multi-latent-attention model deepseek_v2 is not "
                                          r"supported by the FSDP backend .* add --train-backend megatron\.$"):
        lora_hf.check_model(lora_spec("q_a_proj"), {"model_type": "deepseek_v2", "kv_lora_rank": 512})
