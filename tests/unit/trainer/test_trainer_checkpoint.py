"""Checkpoint directory protocol, RNG state, LR schedule, weight-bucket planning and HF export (single process)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from miles.trainer import checkpoint as C
from miles.trainer.checkpoint import rng
from miles.trainer.hf_export import checkpoint_dtype, write_hf_dir
from miles.trainer.optim import LRSchedule
from miles.weight_sync.buckets import plan_buckets


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

    with pytest.raises(C.CheckpointWriteError, match="cannot write checkpoint step_00000003"):
        C.save_checkpoint(root, 3, crash, keep=2)
    assert not (root / ".tmp.step_00000003").exists()   # a failed save cleans up after itself
    assert C.latest_checkpoint(root) == root / "step_00000002"
    (root / ".tmp.step_00000003").mkdir()              # what a killed save leaves: ignored
    (root / "step_00000009").mkdir()                  # a final-looking dir without COMPLETE is ignored too
    (root / "step_00000009" / "payload.txt").write_text("junk")
    assert C.latest_checkpoint(root) == root / "step_00000002"
    C.save_checkpoint(root, 3, _write("s3 again"), keep=0)   # retry replaces the stale temporary dir
    assert not (root / ".tmp.step_00000003").exists()
    assert (C.latest_checkpoint(root) / "payload.txt").read_text() == "s3 again"
    C.save_checkpoint(root, 3, _write("s3 third"))     # re-saving an existing step swaps it atomically
    assert (root / "step_00000003" / "payload.txt").read_text() == "s3 third"


def test_rng_round_trip():
    state = rng.rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(())))
    rng.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == a


def test_lr_schedule_shapes():
    # warm-up as Megatron's / Miles's (radixark/miles@v0.1.0:miles/backends/fsdp_utils/lr_scheduler.py):
    # init + (lr - init) * s / W, so the first step runs at --lr-warmup-init (0 by default)
    const = LRSchedule(lr=1.0, min_lr=0.1, style="constant", warmup=2, decay_iters=10)
    assert [const.lr_at(s) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    warm = LRSchedule(lr=1.0, min_lr=0.1, style="constant", warmup=4, decay_iters=10, init=0.2)
    assert [warm.lr_at(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    lin = LRSchedule(lr=1.0, min_lr=0.0, style="linear", warmup=2, decay_iters=6)
    assert [lin.lr_at(s) for s in range(8)] == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
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


# ---------------------------------------------------------------- real FSDP checkpoints (1 gloo rank)

@pytest.fixture
def trainer_factory(one_rank_group, tiny_model_dir):
    """Build FSDP trainers on a real 1-rank gloo group."""
    from trainer_harness import build, flags

    def make(*extra: str):
        return build(tiny_model_dir, flags("fsdp", ["--num-rollout", "4", "--save-interval", "1"], list(extra)),
                     group=one_rank_group)

    return make


class _Lines:
    def __init__(self):
        import logging

        self.records: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda r: self.records.append(f"{r.levelname} {r.getMessage()}")

    def __enter__(self):
        import logging

        logging.getLogger("miles").addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        import logging

        logging.getLogger("miles").removeHandler(self.handler)


def test_resume_skips_corrupt_newest_checkpoint(tmp_path, trainer_factory):
    """The newest complete checkpoint's shard is truncated: resume loads the previous one, one warning line;
    when every one is corrupt: one error naming the directory."""
    root = tmp_path / "ckpt"
    tr = trainer_factory("--save", str(root))
    tr.checkpoint(0, extra={"mark": 0})
    tr.checkpoint(1, extra={"mark": 1})
    shard = next((root / "step_00000001" / "actor").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(1000)
    with _Lines() as lines:
        extra = trainer_factory("--save", str(root)).resume()
    assert extra["rollout_id"] == 0 and extra["mark"] == 0
    warnings = [ln for ln in lines if ln.startswith("WARNING")]
    assert len(warnings) == 1 and "step_00000001" in warnings[0] and "truncated" in warnings[0], lines
    assert "resumed from step_00000000" in warnings[0]
    (root / "step_00000000" / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"--save {root}: no usable checkpoint") as e:
        trainer_factory("--save", str(root)).resume()
    assert "\n" not in str(e.value) and "step_00000000: trainer_state.json is unreadable" in str(e.value)


def _mount_tmpfs(path, size: str, ro: bool = False):
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")


def _umount(path):
    import subprocess

    subprocess.run(["umount", str(path)], check=False)


def test_full_disk_mid_save_says_so_and_cleans_up(tmp_path, trainer_factory):
    """A real 2 MB tmpfs holds one checkpoint of the tiny model (about 1.5 MB), not two."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "2M")
    try:
        tr = trainer_factory("--save", str(mnt), "--keep-checkpoints", "1")
        tr.checkpoint(0, extra={})
        with pytest.raises(C.CheckpointWriteError) as e:
            tr.checkpoint(1, extra={})
        msg = str(e.value)
        assert msg.startswith(f"no space left on device writing checkpoint step_00000001 under {mnt}"), msg
        assert "\n" not in msg
        assert not (mnt / ".tmp.step_00000001").exists()
        assert C.latest_checkpoint(mnt) == mnt / "step_00000000"
    finally:
        _umount(mnt)


def test_read_only_save_dir_fails_on_every_rank_with_one_line(tmp_path, trainer_factory):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "1M", ro=True)
    try:
        tr = trainer_factory("--save", str(mnt))
        with pytest.raises(C.CheckpointWriteError, match=f"cannot write checkpoint step_00000000 under {mnt}.*Read-only"):
            tr.checkpoint(0, extra={})
    finally:
        _umount(mnt)


def test_cadence_and_retention_are_one_rule_for_both_layouts(tmp_path):
    """--save-interval 1 --keep-checkpoints 1 --save-retain-interval 2 over 5 rollouts keeps 0, 2, 4 in either layout
    (Megatron-LM's meaning of --save-retain-interval, which Miles's Megatron backend uses)."""
    from types import SimpleNamespace

    from miles.trainer.checkpoint import cadence, layout

    ck = SimpleNamespace(save="x", save_interval=3, keep_checkpoints=1, save_retain_interval=2)
    assert [r for r in range(7) if cadence.should_save(ck, r, 7)] == [2, 5, 6]        # every 3rd and the last
    assert not cadence.should_save(SimpleNamespace(**{**vars(ck), "save": None}), 2, 7)
    assert cadence.to_prune([0, 1, 2, 3, 4], 1, 2) == [1, 3] and cadence.to_prune([0, 1, 2], 0, None) == []
    assert cadence.to_prune([3, 0, 1, 2], 2, None) == [0, 1]
    for lay in (layout.STEP, layout.ITER):
        root = tmp_path / lay.prefix
        for step in range(5):
            layout.save_atomic(root, lay, step, _write(str(step)), keep=1, retain_interval=2)
        assert [s for s, _ in layout.published(root, lay)] == [0, 2, 4], lay
