"""Save, SIGKILL mid-save, resume: the resumed run ends with exactly the parameters of an uninterrupted one.

Three torchrun launches of 2 gloo ranks (a trainer group built with new_group), 4 rollouts each,
a checkpoint after every rollout (--save-interval 1, --keep-checkpoints 2). Each rank draws its
samples from the global torch RNG, so the data depends on the RNG state the checkpoint restores.

1. uninterrupted: rollouts 0-3 -> final parameters A;
2. killed: trainer rank 1 SIGKILLs itself inside the save of rollout 2, after writing its shards
   and before the checkpoint is complete; torchrun takes the job down;
3. resumed: picks step_00000001 (ignoring the half-written step 2), runs rollouts 2-3 -> B == A.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
NUM_ROLLOUT = 4


def worker(out: Path, model_dir: Path, save_dir: str, kill_at: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from miles.config import parse_args
    from miles.trainer.fsdp import FSDPTrainer
    from miles.types import Sample

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    rank = dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, device_type="cpu")
    args = ["--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--num-rollout", str(NUM_ROLLOUT),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--lr", "3e-3", "--num-steps-per-rollout", "2",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--min-lr", "1e-4",
            "--use-kl-loss", "--kl-loss-coef", "0.1", "--save-interval", "1", "--keep-checkpoints", "2"]
    if save_dir != "-":
        args += ["--save", save_dir]
    cfg = parse_args(args)
    tr = FSDPTrainer(cfg.train, cfg.algo, cfg.checkpoint, mesh=mesh, group=group, device=torch.device("cpu"),
                     rollout_temperature=1.0, num_rollout=NUM_ROLLOUT, global_batch_size=None,
                     num_steps_per_rollout=2, timeout=60)
    torch.manual_seed(100 + rank)                 # the "data" RNG; restored by resume()
    start = 0
    extra = tr.resume() if save_dir != "-" else None
    if extra is not None:
        start = extra["rollout_id"] + 1
        assert extra["data_position"] == start * 3, extra

    if kill_at >= 0:
        save = tr.save

        def save_then_die(path, extra):
            save(path, extra)
            if rank == 1 and extra["rollout_id"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        tr.save = save_then_die

    metrics = {}
    for rid in range(start, NUM_ROLLOUT):
        samples = []
        for k in range(3):                         # one group of 3 per rank and rollout
            prompt = torch.randint(4, 90, (4,)).tolist()
            n = int(torch.randint(2, 7, (1,)))
            samples.append(Sample(group_index=rank, index=k, tokens=prompt + torch.randint(4, 90, (n,)).tolist(),
                                  response_length=n, reward=float(torch.rand(())), rollout_log_probs=[-1.0] * n))
        metrics[rid] = tr.train(samples, rid)["loss"]
        if tr.should_save(rid):
            tr.checkpoint(rid, extra={"data_position": (rid + 1) * 3})
    params = tr.state_dict_for_check()
    if rank == 0:
        torch.save(params, out / "params.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))
    dist.barrier(group)
    dist.destroy_process_group()


def _launch(out: Path, model_dir: Path, save_dir: str, kill_at: int = -1) -> subprocess.CompletedProcess:
    from miles.utils.net import find_free_port

    out.mkdir(parents=True, exist_ok=True)
    from _torchrun import torchrun

    return torchrun(HERE, 2, find_free_port(), str(out), str(model_dir), save_dir, str(kill_at), timeout=300,
                    env={"PYTHONPATH": str(HERE.parents[2])})


def test_kill_mid_save_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir):
    import torch

    from miles.trainer.checkpoint import latest_checkpoint

    ref = _launch(tmp_path / "ref", tiny_model_dir, "-")
    assert ref.returncode == 0, ref.stdout[-4000:]

    ckpt = tmp_path / "ckpt"
    killed = _launch(tmp_path / "killed", tiny_model_dir, str(ckpt), kill_at=2)
    assert killed.returncode != 0
    assert "SIGKILL" in killed.stdout or "-9" in killed.stdout, killed.stdout[-3000:]
    assert (ckpt / ".tmp.step_00000002").is_dir()               # the half-written save is there ...
    assert latest_checkpoint(ckpt) == ckpt / "step_00000001"     # ... and ignored
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000000", "step_00000001"]

    resumed = _launch(tmp_path / "resumed", tiny_model_dir, str(ckpt))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    a, b = torch.load(tmp_path / "ref" / "params.pt"), torch.load(tmp_path / "resumed" / "params.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ref_metrics = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    res_metrics = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert sorted(res_metrics) == ["2", "3"]
    assert all(res_metrics[k] == ref_metrics[k] for k in res_metrics)
    # pruned to the newest two; the stale temporary dir was replaced by the real step 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000003"]
    meta = json.loads((ckpt / "step_00000003" / "trainer_state.json").read_text())
    assert meta["schedule"]["step"] == NUM_ROLLOUT * 2 and meta["extra"]["rollout_id"] == 3


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
