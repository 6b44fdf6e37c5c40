"""DeepSeek sparse attention's own pieces (miles/trainer/megatron/families/dsa.py): the torch Hadamard transform that stands in
for megatron-core's CUDA-only kernel (and, on a GPU with ``fast_hadamard_transform``, agrees with it), the indexer's
weight permutation between transformers' and megatron-core's head layouts (exact both ways), and the indexer shape
read from config.json with its one-line refusals."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.megatron.families import dsa


def _closed_form(dim: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix by its closed form, H[i, j] = (-1)^popcount(i & j) / sqrt(dim): the natural order
    fast_hadamard_transform computes."""
    i = torch.arange(dim)
    bits = torch.tensor([bin(int(v)).count("1") for v in (i[:, None] & i[None, :]).flatten()]).reshape(dim, dim)
    return (1 - 2 * (bits % 2)).double() / dim ** 0.5


@pytest.mark.parametrize("dim", [1, 2, 16, 128])
def test_hadamard_is_sylvester_and_orthonormal(dim: int) -> None:
    x = torch.randn(3, 5, dim, dtype=torch.float64)
    y = dsa.hadamard_rotate(x)
    assert torch.allclose(y, x @ _closed_form(dim), rtol=0, atol=1e-14)          # float64: measured 0
    # orthonormal: dot products (the indexer's q . k) are unchanged, which is why transformers may leave it out
    q, k = torch.randn(4, dim, dtype=torch.float64), torch.randn(4, dim, dtype=torch.float64)
    # float64: measured 1.4e-14 with one thread, 2.4e-14 with two (CPU, 2026-12-07)
    assert torch.allclose(dsa.hadamard_rotate(q) @ dsa.hadamard_rotate(k).T, q @ k.T, rtol=0, atol=5e-14)


def test_hadamard_refuses_other_widths() -> None:
    with pytest.raises(ValueError, match="not a power of two"):
        dsa.hadamard_rotate(torch.zeros(2, 24))


def test_megatron_core_calls_our_rotation() -> None:
    from megatron.core.transformer.experimental_attention_variant import dsa as core

    dsa.apply_compat()
    x = torch.randn(2, 3, 16)               # fp32 on CPU: megatron-core's own asserts bf16 and the CUDA kernel
    assert torch.equal(core.rotate_activation(x), dsa.hadamard_rotate(x))


@pytest.mark.gpu
def test_torch_hadamard_matches_the_kernel_on_gpu() -> None:
    """On a GPU: megatron-core's kernel (``fast_hadamard_transform``, bf16) and ``hadamard_rotate`` agree within
    bf16 rounding; ``rotate_activation`` picks the kernel there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    kernel = pytest.importorskip("fast_hadamard_transform", reason="the kernel package fast_hadamard_transform is "
                                 "not installed (pip install fast-hadamard-transform): nothing to compare with")
    x = torch.randn(4, 7, 8, 128, device="cuda", dtype=torch.bfloat16)
    ref = dsa.hadamard_rotate(x.double()).float()
    got = kernel.hadamard_transform(x, scale=128 ** -0.5).float()
    ours = dsa.hadamard_rotate(x).float()
    # bf16 rounding of values of about 3 (unit entries, orthonormal transform): 2 ** -8 * 4 with room
    assert (got - ref).abs().max() < 0.05 and (ours - ref).abs().max() < 0.05
    assert torch.equal(dsa.rotate_activation(x), kernel.hadamard_transform(x, scale=128 ** -0.5))


def _dsa(interleaved: bool, dim: int = 16, rope: int = 8) -> dsa.DsaShape:
    return dsa.DsaShape(index_n_heads=4, index_head_dim=dim, index_topk=4, rope_dim=rope, rope_interleaved=interleaved,
                        full_layers=(True,))


@pytest.mark.parametrize("interleaved", [True, False])
def test_indexer_permutation_round_trip_is_exact(interleaved: bool) -> None:
    shape = _dsa(interleaved)
    p = "model.layers.1."
    hf = {p + "self_attn.indexer.wq_b.weight": torch.randn(4 * 16, 24),
          p + "self_attn.indexer.wk.weight": torch.randn(16, 64),
          p + "self_attn.indexer.k_norm.weight": torch.randn(16),
          p + "self_attn.indexer.k_norm.bias": torch.randn(16),
          p + "self_attn.indexer.weights_proj.weight": torch.randn(4, 64)}
    for own in dsa._NAMES:
        suffix = dsa.INDEXER_PREFIX + own
        meg = dsa.hf_to_megatron(suffix, p, hf, shape)
        ((name, back),) = dsa.megatron_to_hf(suffix, p, meg, shape)
        assert torch.equal(back, hf[name]), own
    assert dsa.hf_to_megatron("self_attention.linear_proj.weight", p, hf, shape) is None


def test_indexer_permutation_layout() -> None:
    """megatron-core's head is [nope; rope]; GLM-5's rope dims keep their (interleaved) order, DeepSeek-V3.2's are
    interleaved so that megatron-core's de-interleave gives transformers' half-split order back."""
    assert dsa._perm(_dsa(True, 8, 4)).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    perm = dsa._perm(_dsa(False, 8, 4))
    assert perm.tolist() == [4, 5, 6, 7, 0, 2, 1, 3]
    rope = perm[4:]
    assert torch.cat([rope[0::2], rope[1::2]]).tolist() == [0, 1, 2, 3]      # megatron-core's de-interleave


class _Cfg:
    model_type = "glm_moe_dsa"
    index_n_heads, index_head_dim, index_topk, qk_rope_head_dim = 32, 128, 2048, 64
    q_lora_rank, num_hidden_layers, indexer_types = 2048, 4, None


def test_dsa_fields_of_glm5() -> None:
    f = dsa.dsa_fields(_Cfg())
    assert (f.index_n_heads, f.index_head_dim, f.index_topk, f.rope_dim, f.rope_interleaved) == (32, 128, 2048, 64,
                                                                                                   True)
    assert f.full_layers == (True,) * 4
    c = _Cfg()
    c.indexer_types = ["full", "shared", "shared", "full"]
    assert dsa.dsa_fields(c).full_layers == (True, False, False, True)
    c.model_type = "deepseek_v32"
    assert not dsa.dsa_fields(c).rope_interleaved


@pytest.mark.parametrize("key,value,match", [
    ("index_head_dim", 96, "index_head_dim 96 must be a power of two"),
    ("index_head_dim", 64, "larger than qk_rope_head_dim 64"),
    ("indexer_types", ["shared", "full", "full", "full"], "the first 'full'"),
    ("q_lora_rank", None, "q_lora_rank is not set"),
])
def test_dsa_fields_refusals(key: str, value, match: str) -> None:
    c = _Cfg()
    setattr(c, key, value)
    with pytest.raises(ValueError, match=match):
        dsa.dsa_fields(c)
