"""``miles.trainer.hf_fusions``: the fused RMSNorm / SwiGLU / RoPE forwards compute what transformers' modules
compute (fp32 and bf16, eager on CPU; compiled on a GPU: the ``gpu`` test), which classes get patched per family, and
that a class whose code is not the verified form keeps its forward."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.qwen3 import modeling_qwen3

from miles.trainer import hf_fusions, modeling

_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _model(config, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    for p in model.parameters():
        if p.dim() == 1:                      # norm weights off 1, so a mistake in how the weight enters shows
            p.data.normal_(1.0, 0.3)
    return model


def _run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids).logits
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(logits.device)
    (logits.float() * g).sum().backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest gradient difference relative to that gradient's largest entry."""
    return max(float((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-30)) for n in a)


@pytest.fixture
def counted(monkeypatch):
    """Calls of each fused function (eager: ``fused`` reads ``_FUNCTIONS`` at call time)."""
    calls: Counter = Counter()
    for name, fn in list(hf_fusions._FUNCTIONS.items()):
        def wrapped(*args, _fn=fn, _name=name):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setitem(hf_fusions._FUNCTIONS, name, wrapped)
    return calls


# ------------------------------------------------------------------ the math, module by module
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["rms_norm", "rms_norm_weight_first"])
def test_rms_norm_matches_transformers(form, dtype):
    """Qwen3's norm (the weight multiplies after the cast back) and GPT-OSS's (before it)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    torch.manual_seed(0)
    norm = (modeling_qwen3.Qwen3RMSNorm if form == "rms_norm" else GptOssRMSNorm)(48, eps=1e-5).to(dtype)
    norm.weight.data.normal_(1.0, 0.3)
    assert hf_fusions._rms_kind(norm) == form
    x = (3 * torch.randn(5, 7, 48)).to(dtype).requires_grad_()
    g = torch.randn(5, 7, 48).to(dtype)
    ref = norm(x)
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, norm.weight), g)
    out = getattr(hf_fusions, form)(x.reshape(-1, 48), norm.weight, norm.variance_epsilon).view(5, 7, 48)
    gx, gw = torch.autograd.grad(out, (x, norm.weight), g)
    assert out.dtype == ref.dtype == dtype
    # the same ops: measured identical (output and both gradients, fp32 and bf16)
    assert torch.equal(out, ref) and torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_rope_match_transformers(dtype):
    torch.manual_seed(0)
    gate, up = (torch.randn(2, 9, 32).to(dtype).requires_grad_() for _ in range(2))
    g = torch.randn(2, 9, 32).to(dtype)
    ref = nn.functional.silu(gate) * up                              # Qwen3MLP: act_fn(gate_proj(x)) * up_proj(x)
    out = hf_fusions.silu_mul(gate, up)
    assert torch.equal(out, ref)                                     # measured: identical
    for a, b in zip(torch.autograd.grad(out, (gate, up), g), torch.autograd.grad(ref, (gate, up), g)):
        assert torch.equal(a, b)
    q = torch.randn(2, 4, 9, 16).to(dtype).requires_grad_()           # [B, H, T, D]
    k = torch.randn(2, 2, 9, 16).to(dtype).requires_grad_()
    rot = modeling_qwen3.Qwen3RotaryEmbedding(Qwen3Config(**_SMALL))
    cos, sin = rot(q, torch.arange(9).repeat(2, 1))
    ref = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    out = hf_fusions.rope(q, k, cos, sin)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    for a, b in zip(out + torch.autograd.grad(out, (q, k), (gq, gk)), ref + torch.autograd.grad(ref, (q, k), (gq, gk))):
        assert torch.equal(a, b)                                     # measured: identical


# ------------------------------------------------------------------ whole models, and which classes
_FAMILIES = {
    "qwen3": (Qwen3Config(**_SMALL), {"rms_norm": ["Qwen3RMSNorm"], "mlp": ["Qwen3MLP"], "rope": ["Qwen3Attention"]}),
    "qwen3_moe": (Qwen3MoeConfig(**_SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                 mlp_only_layers=[0]),       # layer 0 dense (Qwen3MoeMLP), layer 1 routed experts
                  {"rms_norm": ["Qwen3MoeRMSNorm"], "mlp": ["Qwen3MoeMLP"], "rope": ["Qwen3MoeAttention"]}),
    "llama": (LlamaConfig(**_SMALL), {"rms_norm": ["LlamaRMSNorm"], "mlp": ["LlamaMLP"], "rope": ["LlamaAttention"]}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(_FAMILIES))
def test_patched_model_matches_transformers(family, dtype, counted):
    config, classes = _FAMILIES[family]
    ref = _model(config, dtype)
    fused = copy.deepcopy(ref)
    assert hf_fusions.apply(fused, compiled=False) == classes
    assert hf_fusions.apply(fused, compiled=False) == {"rms_norm": [], "mlp": [], "rope": []}     # idempotent
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(2))
    logits_ref, grads_ref = _run(ref, ids)
    assert not counted                                                # the unpatched copy: transformers' code only
    logits, grads = _run(fused, ids)
    layers, dense = config.num_hidden_layers, (1 if family == "qwen3_moe" else config.num_hidden_layers)
    qk_norms = 2 * layers if family != "llama" else 0
    assert counted == {"rms_norm": 2 * layers + 1 + qk_norms, "silu_mul": dense, "rope": layers}
    # the same ops: logits identical; fp32 gradients differ in the last bits (the norms' weight gradients sum the
    # flattened rows in another order): measured at most 6.1e-7 of a gradient's largest entry (qwen3; qwen3_moe
    # 5.2e-7, llama 3.9e-7); bf16 gradients identical
    assert torch.equal(logits, logits_ref)
    assert _worst(grads_ref, grads) <= (1.2e-6 if dtype == torch.float32 else 0.0)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in fused.named_parameters()]
    assert type(fused.model.norm).__name__ == type(ref.model.norm).__name__


def test_unverified_classes_keep_their_forward(counted):
    """Gemma's RMSNorm (``x * (1 + w)``) and GELU MLP are left alone (its attention's RoPE is the standard one); a
    subclass that changes the norm's math is left alone too; the RoPE dispatcher runs transformers' function for a
    model that was not patched."""
    gemma = _model(GemmaConfig(**_SMALL), torch.float32)
    assert hf_fusions.apply(gemma, compiled=False) == {"rms_norm": [], "mlp": [], "rope": ["GemmaAttention"]}

    class ShiftedRMSNorm(modeling_qwen3.Qwen3RMSNorm):
        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return (1.0 + self.weight) * hidden_states.to(input_dtype)

    qwen = _model(Qwen3Config(**_SMALL), torch.float32)
    qwen.model.norm.__class__ = ShiftedRMSNorm
    plain = copy.deepcopy(qwen)
    patched = hf_fusions.apply(qwen, compiled=False)
    assert patched["rms_norm"] == ["Qwen3RMSNorm"] and type(qwen.model.norm) is ShiftedRMSNorm
    assert hasattr(modeling_qwen3.apply_rotary_pos_emb, "_miles_original")            # the dispatcher is installed
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(3))
    counted.clear()
    plain(input_ids=ids)
    assert not counted                                   # another model of the process: transformers' functions
    qwen(input_ids=ids)
    assert counted["rms_norm"] == 2 * 2 + 2 * 2 and counted["rope"] == 2      # the shifted final norm unfused


def test_load_hf_model_patches_on_cuda_only(tmp_path):
    """The FSDP backend's loader: a CUDA device gets the compiled forwards (nothing runs here), CPU the model as
    transformers builds it."""
    _model(Qwen3Config(**_SMALL), torch.float32).save_pretrained(tmp_path)
    cpu = modeling.load_hf_model(tmp_path, torch.device("cpu"))
    assert not any(hasattr(type(m), "_miles_fused") for m in cpu.modules())
    gpu = modeling.load_hf_model(tmp_path, torch.device("cuda"))   # loaded on CPU; only the classes differ
    kinds = Counter(type(m)._miles_fused for m in gpu.modules() if hasattr(type(m), "_miles_fused"))
    assert kinds == {"rms_norm": 2 * 2 + 2 * 2 + 1, "mlp": 2, "rope": 2}
    assert all(type(m)._miles_compiled for m in gpu.modules() if hasattr(type(m), "_miles_fused"))


# ------------------------------------------------------------------ compiled, on a GPU
def compiled_vs_transformers(device: torch.device, lengths=(37, 53, 64, 129)) -> dict[str, float]:
    """A tiny bf16 Qwen3, forward + backward through the compiled forwards and through transformers' own, for each
    sequence length: the largest differences (logits: absolute; gradients: relative to each gradient's largest
    entry), the same between transformers' bf16 model and its fp32 original (bf16's own error, ``bf16_*``), and
    how many graphs dynamo compiled after the first two lengths."""
    from torch._dynamo.utils import counters

    fp32 = _model(Qwen3Config(**_SMALL), torch.float32).to(device)
    ref = _model(Qwen3Config(**_SMALL), torch.bfloat16).to(device)
    fused = copy.deepcopy(ref)
    hf_fusions.apply(fused, compiled=True)
    out = dict.fromkeys(("logits", "grads", "bf16_logits", "bf16_grads"), 0.0)
    for i, t in enumerate(lengths):
        if i == 2:
            graphs = counters["stats"]["unique_graphs"]
        ids = torch.randint(0, 96, (2, t), generator=torch.Generator().manual_seed(t)).to(device)
        for m in (fp32, ref, fused):
            m.zero_grad(set_to_none=True)
        (l32, g32), (la, ga), (lb, gb) = _run(fp32, ids), _run(ref, ids), _run(fused, ids)
        out["logits"] = max(out["logits"], float((la - lb).abs().max()))
        out["grads"] = max(out["grads"], _worst(ga, gb))
        out["bf16_logits"] = max(out["bf16_logits"], float((l32 - la).abs().max()))
        out["bf16_grads"] = max(out["bf16_grads"], _worst(g32, ga))
    out["graphs_after_two_lengths"] = counters["stats"]["unique_graphs"] - graphs
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


@pytest.mark.gpu
def test_compiled_fusions_on_gpu_match_transformers():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    d = compiled_vs_transformers(torch.device("cuda"))
    print("hf_fusions on", torch.cuda.get_device_name(), d)
    # the fused path's difference from transformers' bf16 path, as a fraction of bf16's own error (bf16 vs fp32).
    # Measured with inductor on CPU (this function on device cpu): lengths 37, 53, 64 identical; 129 one bf16 ulp of
    # the logits, 1.95e-3 = 0.36 of bf16's 5.5e-3, gradients 7.1e-3 of their largest entry = 0.25 of bf16's 2.87e-2
    # (a reduction's order flips a bf16 rounding that later layers carry). PROVISIONAL bounds, 2x those CPU
    # ratios, until measured on an H100 (the print above)
    assert d["logits"] <= 0.72 * d["bf16_logits"], d
    assert d["grads"] <= 0.5 * d["bf16_grads"], d
    assert d["graphs"] > 0 and d["graphs_after_two_lengths"] == 0, d   # dynamic shapes: no recompile per length


def test_lora_adapters_on_the_fused_mlp_and_attention():
    """The trainer's order: load, patch, attach LoRA (its hooks on the projections the fused forwards call): the
    same logits and adapter gradients as LoRA on transformers' own modules."""
    from miles.config.lora import resolve
    from miles.trainer import lora, lora_hf

    targets = resolve("linear_qkv,linear_proj,linear_fc1,linear_fc2").leaves
    spec = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=targets)
    ref = _model(Qwen3Config(**_SMALL), torch.float32)
    fused = copy.deepcopy(ref)
    hf_fusions.apply(fused, compiled=False)
    out = []
    for m in (ref, fused):
        ad = lora_hf.attach_hf_model(m, spec, seed=5)
        torch.manual_seed(4)
        for p in ad.parameters():                      # B = 0 at init: move every adapter off zero, the same way
            p.data.normal_(0.0, 0.2)
        ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
        logits = m(input_ids=ids).logits
        (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        out.append((logits.detach(), {n: p.grad for n, p in ad.named_parameters()}))
    assert out[0][1] and all(g is not None and g.abs().max() > 0 for g in out[0][1].values())
    # measured: logits identical, adapter gradients at most 7.5e-7 of their largest entry (fp32 last bits, as in
    # test_patched_model_matches_transformers)
    assert torch.equal(out[0][0], out[1][0])
    assert _worst(out[0][1], out[1][1]) <= 1.5e-6


def test_fsdp2_sharded_patched_model_matches(tmp_path, counted):
    """FSDP2 (one gloo rank, the backend's ``shard_model``: blocks then the root, bf16 mixed precision) over the patched
    model: FSDP2's own class swap of the blocks and its parameter unsharding leave the fused forwards working, with
    the unpatched sharded model's log-probs and gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        ref = _model(Qwen3Config(**_SMALL), torch.float32)
        fused = copy.deepcopy(ref)
        hf_fusions.apply(fused, compiled=False)
        ids = torch.randint(0, 96, (1, 13), generator=torch.Generator().manual_seed(2))
        out = []
        for hf in (ref, fused):
            model = modeling.shard_model(modeling.PolicyModel(hf), modeling.decoder_blocks(hf), mesh,
                                         mp_policy=modeling.mixed_precision(torch.device("cpu"), True), recompute=True)
            lp, _ = model(ids, torch.arange(13)[None], torch.arange(12), ids[0, 1:], torch.tensor([0, 13]), 13)
            (lp * torch.linspace(-1, 1, 12)).sum().backward()
            out.append((lp.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
        assert modeling.is_fsdp(fused.model.layers[0]) and type(fused.model.layers[0].mlp)._miles_fused == "mlp"
        # the blocks run twice (recompute in the backward), the final norm once
        assert counted == {"rms_norm": 9 + 8, "silu_mul": 2 * 2, "rope": 2 * 2}
        # bf16 compute, fp32 gradients: measured identical log-probs and gradients
        assert torch.equal(out[0][0], out[1][0])
        assert _worst(out[0][1], out[1][1]) == 0.0
    finally:
        dist.destroy_process_group()


def test_a_compile_failure_falls_back_to_the_same_math_once(monkeypatch, caplog):
    """A node whose inductor / Triton cannot compile: the fused function warns once and runs eagerly (same result)."""
    from torch._dynamo.exc import BackendCompilerFailed

    calls = []

    def broken_compile(fn, **kwargs):
        def compiled(*args):
            calls.append(1)
            raise BackendCompilerFailed(lambda *a: None, RuntimeError("no Triton toolchain"), None)
        return compiled

    monkeypatch.setattr(hf_fusions, "_compiled", {})
    monkeypatch.setattr(hf_fusions, "_failed", set())
    monkeypatch.setattr(torch, "compile", broken_compile)
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    with caplog.at_level("WARNING"):
        first = hf_fusions.fused("silu_mul", True)(gate, up)
        second = hf_fusions.fused("silu_mul", True)(gate, up)
    assert torch.equal(first, hf_fusions.silu_mul(gate, up)) and torch.equal(second, first)
    assert len(calls) == 1 and "silu_mul" in hf_fusions._failed
    assert sum("runs unfused" in r.getMessage() for r in caplog.records) == 1
