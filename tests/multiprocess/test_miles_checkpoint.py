"""A checkpoint written in Miles's FSDP layout resumes here; a ``--load`` not written yet is a fresh start.

Miles v0.1.0 (``radixark/miles@v0.1.0:miles/backends/fsdp_utils/checkpoint.py``) saves ``iter_000000N/{model,optimizer}`` as
DCP with the state dicts under ``model_state.model`` / ``optim_state.optim``, ``rng.pt`` and ``meta.json``
(``rollout_id``, ``next_rollout_id``, ``global_step``), then ``latest_checkpointed_iteration.txt``.
``write_miles_checkpoint`` below writes exactly that layout with torch's DCP (Miles's own code needs Ray
and SGLang, which do not install here). Two torchrun launches of 2 gloo ranks, 4 rollouts:

1. reference: rollouts 0-3, a Miles-layout checkpoint written after rollout 1 -> final parameters A;
2. resumed with ``--load`` of that directory: starts at rollout 2 with the model, AdamW state and LR step
   of the checkpoint, runs rollouts 2-3 -> B == A bitwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
NUM_ROLLOUT = 4


def write_miles_checkpoint(trainer, save: Path, rollout_id: int, global_step: int) -> None:
    """Miles v0.1.0's FSDP ``save`` layout (see the module docstring), written with torch's DCP."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    step = rollout_id + 1
    path = save / f"iter_{step:07d}"
    dcp.save({"model_state": {"model": get_model_state_dict(trainer.model)}}, checkpoint_id=str(path / "model"),
             process_group=trainer.group)
    dcp.save({"optim_state": {"optim": get_optimizer_state_dict(trainer.model, trainer.optimizer)}},
             checkpoint_id=str(path / "optimizer"), process_group=trainer.group)
    if dist.get_rank(trainer.group) == 0:
        torch.save({"torch": torch.get_rng_state()}, path / "rng.pt")
        meta = {"iteration": step, "rollout_id": rollout_id, "next_rollout_id": rollout_id + 1,
                "global_step": global_step, "micro_step": 0, "world_size": dist.get_world_size(trainer.group)}
        (path / "meta.json").write_text(json.dumps(meta))
        (save / "latest_checkpointed_iteration.txt").write_text(str(step))
    dist.barrier(trainer.group)


def worker(out: Path, model_dir: Path, mode: str, ckpt: Path) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from trainer_harness import build, flags, random_samples

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    rank = dist.get_rank(group)
    args = flags("fsdp", "ckpt_run", "cosine", ["--num-rollout", str(NUM_ROLLOUT)])
    if mode == "resume":
        args += ["--load", str(ckpt)]
    tr = build(model_dir, args, group=group)
    start = 0
    if mode == "resume":
        extra = tr.resume()
        assert extra is not None and extra["rollout_id"] == 1 and extra["next_rollout_id"] == 2, extra
        assert tr.schedule.step == 4, tr.schedule.step
        start = extra["next_rollout_id"]
    for rid in range(start, NUM_ROLLOUT):
        # the data of (rollout, rank), RNG-state free
        tr.train(random_samples(1, 3, seed=1000 * rid + rank, first_group=rank), rid)
        if mode == "reference" and rid == 1:
            write_miles_checkpoint(tr, ckpt, rid, tr.schedule.step)
    params = tr.state_dict_for_check()
    if rank == 0:
        torch.save(params, out / "params.pt")
    dist.barrier(group)
    dist.destroy_process_group()


def _launch(out: Path, model_dir: Path, mode: str, ckpt: Path) -> subprocess.CompletedProcess:
    from miles.utils.net import find_free_port

    out.mkdir(parents=True, exist_ok=True)
    from _torchrun import torchrun

    return torchrun(HERE, 2, find_free_port(), str(out), str(model_dir), mode, str(ckpt), timeout=300,
                    env={"PYTHONPATH": str(HERE.parents[2])})


def test_miles_fsdp_checkpoint_resumes_to_the_uninterrupted_parameters(tmp_path, tiny_model_dir):
    import torch

    ckpt = tmp_path / "miles_ckpt"
    ref = _launch(tmp_path / "ref", tiny_model_dir, "reference", ckpt)
    assert ref.returncode == 0, ref.stdout[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2" and (ckpt / "iter_0000002").is_dir()
    resumed = _launch(tmp_path / "resumed", tiny_model_dir, "resume", ckpt)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "loaded Miles FSDP checkpoint" in resumed.stderr + resumed.stdout
    a, b = torch.load(tmp_path / "ref" / "params.pt"), torch.load(tmp_path / "resumed" / "params.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_tracker_naming_a_missing_step_is_one_line(tmp_path):
    from miles.trainer.checkpoint import miles_fsdp

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")
    with pytest.raises(ValueError, match=r"names iter_0000003, which is missing"):
        miles_fsdp.find(tmp_path)
    (tmp_path / "iter_0000003").mkdir()  # a Megatron torch_dist step has no model/ directory
    with pytest.raises(ValueError, match="a Megatron checkpoint"):
        miles_fsdp.find(tmp_path)
    assert miles_fsdp.find(tmp_path / "nothing_here") is None


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
