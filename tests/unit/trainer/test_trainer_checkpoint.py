"""Checkpoint directory protocol, RNG state, LR schedule, weight-bucket planning and HF export (single process)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from miles.trainer import checkpoint as C
from miles.trainer.hf_export import checkpoint_dtype, write_hf_dir
from miles.trainer.optim import LRSchedule
from miles.trainer.weights import plan_buckets


def _write(tag):
    def fn(d):
        (d / "payload.txt").write_text(tag)
    return fn


def test_save_latest_prune_and_crash(tmp_path):
    root = tmp_path / "ckpt"
    assert C.latest_checkpoint(root) is None and C.latest_checkpoint(None) is None
    for step in range(3):
        C.save_checkpoint(root, step, _write(f"s{step}"), keep=2)
    assert [s for s, _ in C.list_checkpoints(root)] == [1, 2]
    assert (C.latest_checkpoint(root) / "payload.txt").read_text() == "s2"
    assert json.loads((root / "step_00000002" / C.COMPLETE).read_text())["step"] == 2

    def crash(d):
        (d / "payload.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        C.save_checkpoint(root, 3, crash, keep=2)
    assert (root / ".tmp.step_00000003").is_dir()
    assert C.latest_checkpoint(root) == root / "step_00000002"
    (root / "step_00000009").mkdir()                  # a final-looking dir without COMPLETE is ignored too
    (root / "step_00000009" / "payload.txt").write_text("junk")
    assert C.latest_checkpoint(root) == root / "step_00000002"
    C.save_checkpoint(root, 3, _write("s3 again"), keep=0)   # retry replaces the stale temporary dir
    assert not (root / ".tmp.step_00000003").exists()
    assert (C.latest_checkpoint(root) / "payload.txt").read_text() == "s3 again"
    C.save_checkpoint(root, 3, _write("s3 third"))     # re-saving an existing step swaps it atomically
    assert (root / "step_00000003" / "payload.txt").read_text() == "s3 third"


def test_rng_round_trip():
    state = C.rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(())))
    C.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == a


def test_lr_schedule_shapes():
    const = LRSchedule(lr=1.0, min_lr=0.1, style="constant", warmup=2, decay_iters=10)
    assert [const.lr_at(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    lin = LRSchedule(lr=1.0, min_lr=0.0, style="linear", warmup=2, decay_iters=6)
    assert [lin.lr_at(s) for s in range(8)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    cos = LRSchedule(lr=1.0, min_lr=0.2, style="cosine", warmup=0, decay_iters=4)
    assert cos.lr_at(2) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.lr_at(4) == pytest.approx(0.2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    lin.load_state_dict({"step": 3})
    assert lin.apply(opt) == pytest.approx(0.75) and opt.param_groups[0]["lr"] == pytest.approx(0.75)
    for bad in (dict(style="exp"), dict(warmup=-1), dict(style="linear", warmup=5, decay_iters=5)):
        kw = dict(lr=1.0, min_lr=0.0, style="constant", warmup=0, decay_iters=None) | bad
        with pytest.raises(ValueError, match="--lr"):
            LRSchedule(**kw)


def test_plan_buckets():
    named = [("a", torch.zeros(10)), ("b", torch.zeros(30)), ("c", torch.zeros(5)), ("d", torch.zeros(2, dtype=torch.int64))]
    buckets = plan_buckets(named, bucket_bytes=160, dtype=None)   # 40 + 120 | 20 | (int64 never mixed in)
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    bf = plan_buckets(named[:3], bucket_bytes=80, dtype=torch.bfloat16)
    assert [[n for n, _ in b] for b in bf] == [["a", "b"], ["c"]]
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets(named, 0, None)


def test_sharded_hf_export_loads_in_transformers(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert checkpoint_dtype(tiny_model_dir) == torch.float32
    sd = load_file(str(tiny_model_dir / "model.safetensors"))
    sd = {k: v + 0.5 for k, v in sd.items()}                       # "trained" weights
    out = write_hf_dir(tmp_path / "hf", sorted(sd.items()), tiny_model_dir, max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), sd[name]), name
    assert AutoTokenizer.from_pretrained(str(out)).eos_token == "<|endoftext|>"
