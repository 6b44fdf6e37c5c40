"""Qwen3-VL on the Megatron backend (miles/trainer/megatron/vlm.py), single process: the interleaved M-RoPE
angles in megatron's rotary format give transformers' cos/sin, and HF -> Megatron -> HF conversion of a
tiny Qwen3-VL (tied and untied) is the identity, names included. Multi-rank forward/backward parity with
transformers: tests/multiprocess/test_megatron_vlm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")


def test_interleaved_mrope_angles_give_hf_cos_sin():
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from miles.trainer.megatron.vlm import rope_freqs

    # Qwen3-VL-8B's rotary: head_dim 128, mrope_section [24, 20, 20], interleaved
    cfg = Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128, num_key_value_heads=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                             "mrope_interleaved": True, "mrope_section": [24, 20, 20]})
    rotary = Qwen3VLTextRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 4000, (3, 2, 37), generator=g)          # t, h, w positions that differ
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, pos.clone())                                 # [b, s, 128]
    freqs = rope_freqs(rotary, pos)                                   # [s, b, 1, 128]
    assert freqs.shape == (37, 2, 1, 128)
    # measured: bit for bit (fp32, CPU, 2026-12-08)
    torch.testing.assert_close(freqs.cos()[:, :, 0].transpose(0, 1), cos, rtol=0, atol=0)
    torch.testing.assert_close(freqs.sin()[:, :, 0].transpose(0, 1), sin, rtol=0, atol=0)
    # equal positions on the three axes (text): plain 1-D RoPE in megatron-core's layout, cat(freqs, freqs)
    same = torch.arange(37).view(1, 1, -1).expand(3, 2, -1)
    inv = 1.0 / (5_000_000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    plain = torch.outer(torch.arange(37, dtype=torch.float32), inv)
    assert torch.equal(rope_freqs(rotary, same)[:, 0, 0], torch.cat([plain, plain], dim=-1))


@pytest.mark.parametrize("tied", [True, False])
def test_hf_megatron_hf_round_trip_is_the_identity(tmp_path: Path, tied: bool, one_rank_group):
    from transformers import AutoConfig

    from miles.trainer.megatron import convert, model
    from miles.trainer.megatron.compat import apply_cpu_compat
    from miles.utils.tiny_vlm import build_tiny_vlm

    apply_cpu_compat()
    d = build_tiny_vlm(tmp_path / "vlm", tie_word_embeddings=tied)
    cfg = AutoConfig.from_pretrained(d)
    shape = model.ModelShape.from_hf_config(cfg)
    assert shape.vision and shape.tie_embeddings == tied and shape.qk_layernorm
    hf = convert.read_hf_state_dict(d)
    assert ("lm_head.weight" in hf) != tied
    assert any(k.startswith("model.visual.") for k in hf) and any(k.startswith("model.language_model.") for k in hf)
    # the megatron parameter names of such a model (vision tower under ``vision.``)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    own_mp = not ps.model_parallel_is_initialized()
    try:
        if own_mp:
            ps.initialize_model_parallel(create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(1)
        padded = model.padded_vocab_size(shape.vocab_size, 128, 1)
        gpt = model.build_gpt_model(shape, model.transformer_config(shape, tp_size=1, device=torch.device("cpu")),
                                    padded_vocab=padded, device=torch.device("cpu"), hf_config=cfg)
    finally:
        if own_mp:
            ps.destroy_model_parallel()
    names = [n for n, _ in gpt.named_parameters()]
    assert any(n.startswith("vision.") for n in names)
    assert all(convert.partition_dim(n) is None for n in names if n.startswith("vision."))   # replicated
    full = convert.hf_to_megatron(hf, shape, padded, names)
    back = dict(p for n in names for p in convert.megatron_to_hf(n, full[n], shape))
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
