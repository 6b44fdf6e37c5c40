"""The weight sync sends in the dtype the engines serve (``weight_sync_dtype``): ``--sglang-dtype`` when given, else
the checkpoint's. Miles's gpt-oss-20b command serves bf16 (``--sglang-dtype bfloat16``) from a checkpoint whose
config names another dtype; sent in the checkpoint's fp32, a small update was rounded away by the engine's bf16 copy
and ``--check-weight-update-equal`` found 'model.embed_tokens.weight' 1 ulp apart (the replay of
tests/fixtures/miles_scripts/megatron_moe_gpt_oss_20b.flags)."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.hf_export import checkpoint_dtype, weight_sync_dtype
from miles.weight_sync.base import WeightSyncError
from miles.weight_sync.check import compare


def test_sync_dtype_is_the_engines(tiny_model_dir) -> None:
    assert checkpoint_dtype(tiny_model_dir) == torch.float32
    assert weight_sync_dtype(tiny_model_dir, None) == torch.float32
    assert weight_sync_dtype(tiny_model_dir, "auto") == torch.float32
    assert weight_sync_dtype(tiny_model_dir, "bfloat16") == torch.bfloat16
    assert weight_sync_dtype(tiny_model_dir, "half") == torch.float16
    assert weight_sync_dtype(tiny_model_dir, "float16") == torch.float16
    assert weight_sync_dtype(tiny_model_dir, "float") == torch.float32
    with pytest.raises(ValueError, match="--sglang-dtype 'fp8'"):
        weight_sync_dtype(tiny_model_dir, "fp8")


def test_update_sent_in_the_served_dtype_equals_the_engine(tiny_model_dir) -> None:
    """An fp32 trainer's AdamW weight-decay step (lr 1e-6 x 0.1) moves bf16-valued weights by about 1 fp32 ulp: the
    engine's bf16 copy (``p.data.copy_(t.to(p.dtype))``, as the embedded engine and SGLang load) rounds it away."""
    torch.manual_seed(0)
    trained = torch.randn(101, 64).to(torch.bfloat16).float() * (1 - 1e-7)
    assert not torch.equal(trained.to(torch.bfloat16).float(), trained)
    engine = torch.empty(101, 64, dtype=torch.bfloat16)

    old = trained.to(checkpoint_dtype(tiny_model_dir))          # before: the checkpoint's dtype
    engine.copy_(old.to(engine.dtype))
    with pytest.raises(WeightSyncError, match="differs from the trainer's"):
        compare("model.embed_tokens.weight", old, engine.float().tolist(), "http://engine")

    sent = trained.to(weight_sync_dtype(tiny_model_dir, "bfloat16"))
    engine.copy_(sent.to(engine.dtype))
    compare("model.embed_tokens.weight", sent, engine.float().tolist(), "http://engine")
