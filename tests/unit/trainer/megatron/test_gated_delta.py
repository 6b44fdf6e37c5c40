"""The torch chunked gated delta rule (miles/trainer/megatron/gated_delta.py) against the token-by-token recurrence,
transformers' torch fallback (``qwen3_next``'s ``torch_chunk_gated_delta_rule``) and, on a GPU with
flash-linear-attention installed, fla's kernel."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.megatron.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(b=2, t=37, hk=2, h=4, dk=8, dv=6, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 2.0          # log decays in (-2, 0]
    beta = torch.rand(b, t, h, generator=gen)
    return tuple(x.to(device) for x in (q, k, v, g, beta))


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_matches_recurrence(chunk):
    q, k, v, g, beta = _inputs()
    init = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(1))
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=init,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=init, use_qk_l2norm_in_kernel=True)
    # measured max |diff| 2.4e-7 (out) / 8.0e-7 (state), fp32, chunk 4..64 (this test, CPU)
    torch.testing.assert_close(out, ref, atol=5e-7, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=1.6e-6, rtol=0)


def test_chunked_matches_transformers_fallback():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _inputs(t=150)
    ours, our_state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs, their_state = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    # measured max |diff| 0.0 (out and state: the same fp32 operations in the same order; this test, CPU); the bound
    # leaves room for one reordered fp32 sum (the recurrence test's 2.4e-7, twice)
    torch.testing.assert_close(ours, theirs, atol=5e-7, rtol=0)
    torch.testing.assert_close(our_state, their_state, atol=5e-7, rtol=0)


def test_packed_sequences_do_not_share_state():
    q, k, v, g, beta = _inputs(b=1, t=50)
    cu = torch.tensor([0, 13, 13, 50])                     # a 13-token sequence, an empty one, a 37-token one
    out, states = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, cu_seqlens=cu, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    for n, (s, e) in enumerate([(0, 13), (13, 13), (13, 50)]):
        if e == s:
            assert torch.count_nonzero(states[n]) == 0
            continue
        ref, ref_state = recurrent_gated_delta_rule(*(x[:, s:e] for x in (q, k, v, g, beta)),
                                                    use_qk_l2norm_in_kernel=True)
        # measured 6.0e-8 (out) / 1.2e-7 (state) (this test, CPU)
        torch.testing.assert_close(out[:, s:e], ref, atol=1.2e-7, rtol=0)
        torch.testing.assert_close(states[n:n + 1], ref_state, atol=2.4e-7, rtol=0)


def test_gradients_match_recurrence():
    q, k, v, g, beta = (x.requires_grad_() for x in _inputs(b=1, t=21))
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, g, beta))
    ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, g, beta))
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, atol=3e-6, rtol=0)   # measured max |diff| 1.4e-6 of grads up to 2.1 (CPU)


@pytest.mark.gpu
def test_matches_fla_kernel_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError:
        pytest.skip("flash-linear-attention (fla) is not installed: pip install flash-linear-attention")
    q, k, v, g, beta = _inputs(b=2, t=300, hk=4, h=4, dk=64, dv=64, device="cuda")
    init = torch.randn(2, 4, 64, 64, device="cuda")
    ours, our_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    theirs, their_state = fla_rule(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    # not yet measured (no GPU here): fla's kernels use tf32 dots inside, so the bound is tf32's (~1e-3 relative)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(our_state, their_state.float(), atol=1e-3, rtol=1e-3)
    cu = torch.tensor([0, 100, 300], device="cuda")
    flat = [x[:1] for x in (q, k, v, g, beta)]
    ours, _ = chunk_gated_delta_rule(*flat, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    theirs, _ = fla_rule(*flat, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-3, rtol=1e-3)
