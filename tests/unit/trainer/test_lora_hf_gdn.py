"""The FSDP backend's LoRA on the gated DeltaNet's ``in_proj`` / ``out_proj`` (``miles/trainer/lora_hf.py``'s
``GDN_GROUPS``) on real transformers models built locally (``miles.utils.tiny_qwen35``: Qwen3-Next's fused
``in_proj_qkvz`` / ``in_proj_ba``, dense Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``), one
process.

Megatron's ``in_proj`` is one group: one ``A`` (drawn from the Megatron name) shared by the HF linears, a ``B`` each;
the merged-weights reference: the adapter forward gives the logits of a plain model whose weights are
``W + (alpha / r) B @ A`` (what the weight export adds), B = 0 the base model bit for bit. FSDP against the Megatron
backend on real gloo ranks: ``tests/multiprocess/test_fsdp_lora_gdn.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _lora_hf import hf_model, lora_spec, merged_reference

from miles.config import ConfigError
from miles.trainer import lora, lora_hf

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj,out_proj"      # every linear
IN_PROJ = {"qwen3_next": ("in_proj_qkvz", "in_proj_ba"), "qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                      "in_proj_a")}


@pytest.fixture(scope="module", params=sorted(IN_PROJ))
def gdn_dir(request, tmp_path_factory):
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    return request.param, build_tiny_qwen35_model(tmp_path_factory.mktemp(request.param), kind=request.param)


def test_gdn_adapters_equal_their_merged_weights(gdn_dir) -> None:
    kind, path = gdn_dir
    model, base = hf_model(path), hf_model(path)
    cfg = json.loads((path / "config.json").read_text())
    lora_hf.check_model(lora_spec(TARGETS), cfg)                    # passes: no refusal
    ad = lora_hf.attach_hf(model, model.model.layers, lora_spec(TARGETS), seed=5)
    types = cfg["layer_types"]
    linear = [i for i, t in enumerate(types) if t == "linear_attention"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    assert linear and full
    attn = {f"decoder.layers.{i}.self_attention.{t}" for i in linear for t in ("in_proj", "out_proj")} \
        | {f"decoder.layers.{i}.self_attention.{t}" for i in full for t in ("linear_qkv", "linear_proj")}
    mlp = "mlp.shared_experts." if kind == "qwen3_next" else "mlp."          # Qwen3-Next: HF's mlp.shared_expert
    assert {t for t in ad.targets if ".local_experts." not in t} == attn | {
        f"decoder.layers.{i}.{mlp}linear_fc{k}" for i in range(len(types)) for k in (1, 2)}
    assert len(ad.pairs) == (len(types) * 4 * 2 if kind == "qwen3_next" else 0)       # routed experts x fc
    g = ad.groups[f"decoder/layers/{linear[0]}/self_attention/in_proj"]
    assert sorted(g.lora_B) == sorted(IN_PROJ[kind])              # one A, a B per HF linear
    assert torch.equal(g.lora_A.detach(), lora._init_a(4, cfg["hidden_size"], 5,
                                                        f"decoder.layers.{linear[0]}.self_attention.in_proj"))
    attn = model.model.layers[linear[0]].linear_attn
    assert all(g.lora_B[m].shape[0] == getattr(attn, m).weight.shape[0] for m in IN_PROJ[kind])

    r = merged_reference(model, base, ad)
    assert r.base_exact                                                      # B = 0: the base model bit for bit
    err, moved = r.err, r.moved
    print({"kind": kind, "hooked_vs_merged": err, "moved": moved})
    # fp32 rounding: measured (2026-12, CPU; pytest -s -k merged) qwen3_5 / qwen3_next 3.8e-6 / 1.6e-5 while the adapters
    # move the logits by 0.81 / 0.71 (the gated delta rule amplifies the rounding of in_proj's outputs: Qwen3-Next with
    # in_proj alone agrees exactly in float64); bounded at about twice each
    assert err < {"qwen3_5": 7.5e-6, "qwen3_next": 3.3e-5}[kind] and moved > 1e-2, (err, moved)

    model(input_ids=r.ids).logits.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(g.lora_A.grad is not None and g.lora_A.grad.abs().sum() > 0 for g in ad.groups.values())


def test_gdn_refusals() -> None:
    with pytest.raises(ConfigError, match=r"^--target-modules in_proj,out_proj: LoRA on in_proj / out_proj is built "
                                          r"for the gated DeltaNet .* not for nemotron_h; drop them"):
        lora_hf.check_model(lora_spec("in_proj,out_proj"), {"model_type": "nemotron_h"})
    lora_hf.check_model(lora_spec("in_proj_qkvz"), {"model_type": "qwen3_next", "num_experts": 4})   # no expert target
