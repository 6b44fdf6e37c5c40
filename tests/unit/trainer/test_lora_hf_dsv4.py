"""The FSDP backend's LoRA on DeepSeek-V4 (``deepseek_v4`` in ``miles/trainer/lora_hf.py``'s ``EXPERT_MODEL_TYPES``)
on a real transformers model built locally (``miles.utils.tiny_dsv4``: hyper-connections, sliding / CSA / HCA
attention, hash-routed then sqrtsoftplus MoE layers with the clamped SwiGLU and a shared expert), one process.

V4's LoRA targets on both backends are the MoE layers' MLPs: every routed expert (``mlp.experts``' fused tensors,
``_experts_forward`` with V4's own clamped ``_apply_gate``) and the shared expert (``mlp.shared_experts.gate_proj`` /
``up_proj`` / ``down_proj``). Its attention (``q_a_proj``, ``q_b_proj``, ``kv_proj``, the grouped ``o_a_proj``,
``o_b_proj``; the Megatron backend's ``wq_a`` ... of ``families/dsv4_model.py``) is no target: ``all-linear``'s MLA
names select nothing there on either backend, and attention names alone are refused in one line. The
merged-weights reference: the adapter forward gives the logits of a plain model whose weights are ``W + (alpha / r)
B @ A``; B = 0 the base model bit for bit (transformers' eager experts, the loop the adapters run); a backward
reaches the adapters only. FSDP against the Megatron backend: ``tests/multiprocess/test_fsdp_lora_deepseek.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _lora_hf import merged_reference

from miles.config import ConfigError
from miles.config.lora import resolve
from miles.trainer import lora, lora_hf


def _spec(targets: str, shared: bool = False) -> lora.LoraSpec:
    return lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=resolve(targets).leaves, experts_shared_outer=shared)


@pytest.fixture(scope="module")
def dsv4_dir(tmp_path_factory):
    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    return build_tiny_dsv4_model(tmp_path_factory.mktemp("dsv4"))


def _model(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


@pytest.mark.parametrize("shared", [False, True], ids=["per_expert", "shared_outer"])
def test_dsv4_adapters_equal_their_merged_weights(dsv4_dir, shared: bool) -> None:
    model, base = _model(dsv4_dir), _model(dsv4_dir, experts_implementation="eager")
    cfg = json.loads((dsv4_dir / "config.json").read_text())
    spec = _spec("all-linear", shared)
    lora_hf.check_model(spec, cfg)                        # passes: no refusal
    ad = lora_hf.attach_hf(model, model.model.layers, spec, seed=5)
    n = len(model.model.layers)
    shared_mlp = {f"decoder.layers.{i}.mlp.shared_experts.linear_fc{k}" for i in range(n) for k in (1, 2)}
    experts = {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}" for i in range(n)
               for e in range(4) for k in (1, 2)}
    assert set(ad.targets) == shared_mlp | experts        # every layer is MoE; no attention target
    assert not any(".self_attn." in k for k in ad.hf_targets())
    assert len(ad.shared) == (2 * n if shared else 0)
    # the Megatron backend's draw: the seed and the Megatron module name
    fc2 = ad.groups["decoder/layers/3/mlp/shared_experts/linear_fc2"]
    assert torch.equal(fc2.lora_A.detach(), lora._init_a(4, cfg["moe_intermediate_size"], 5,
                                                         "decoder.layers.3.mlp.shared_experts.linear_fc2"))
    assert not any(p.requires_grad for p in model.parameters())

    r = merged_reference(model, base, ad, seq_len=20)  # longer than the window (8): CSA and HCA entries
    assert r.base_exact                                   # B = 0: the base model bit for bit
    err, moved, ids = r.err, r.moved, r.ids
    print({"shared": shared, "hooked_vs_merged": err, "moved": moved})
    # fp32 rounding: measured (2026-12-07, CPU; pytest -s -k merged) per-expert / shared-outer 1.8e-6 / 3.3e-6 while
    # the adapters move the logits by 0.90; bounded at about twice the largest
    assert err < 7e-6 and moved > 1e-2, (err, moved)

    model(input_ids=ids).logits.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(g.lora_A.grad is not None and g.lora_A.grad.abs().sum() > 0 for g in ad.groups.values())
    assert sum(p.lora_A.grad is not None and p.lora_A.grad.abs().sum() > 0 for p in ad.pairs.values()) > 0


def test_dsv4_peft_export_and_refusal(dsv4_dir) -> None:
    """The PEFT adapter names transformers' shared-expert modules and each routed expert's per-expert linears;
    attention names alone (V4's attention is no LoRA target) are refused in one line naming the flag."""
    model = _model(dsv4_dir)
    ad = lora_hf.attach_hf(model, model.model.layers, _spec("gate_proj,up_proj,down_proj"), seed=0)
    peft = dict(lora_hf.peft_tensors(ad))
    modules = {k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in peft}
    assert modules == {f"model.layers.{i}.mlp.shared_experts.{p}" for i in range(4)
                       for p in ("gate_proj", "up_proj", "down_proj")} | {
        f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(4) for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj")}
    cfg = json.loads((dsv4_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"^--target-modules .*DeepSeek-V4.* gate_proj,up_proj,down_proj"):
        lora_hf.check_model(_spec("q_a_proj,q_b_proj,o_proj"), cfg)
