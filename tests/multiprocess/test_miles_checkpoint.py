"""A checkpoint written in Miles's FSDP layout resumes here; a ``--load`` not written yet is a fresh start.

``test_miles_own_fsdp_checkpoint_resumes_bitwise`` resumes ``tests/fixtures/miles_fsdp_ckpt/``, written by Miles
v0.1.0's own save code (its README says how): weights, AdamW state, LR scheduler, RNG and rollout id.
The older test below writes the layout itself, to check resuming mid-run reaches the uninterrupted parameters.

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
FIXTURE = HERE.parents[1] / "fixtures" / "miles_fsdp_ckpt"


def write_miles_checkpoint(trainer, save: Path, rollout_id: int, global_step: int) -> None:
    """Miles v0.1.0's FSDP ``save`` layout (see the module docstring), written with torch's DCP; no
    ``lr_scheduler/``, so the reader falls back to meta.json's ``global_step`` (as with --no-save-optim)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    step = rollout_id + 1
    path = save / f"iter_{step:07d}"
    # Miles saves the HF model itself: parameter names without our PolicyModel's "lm." prefix
    dcp.save({"model_state": {"model": get_model_state_dict(trainer.model.lm)}}, checkpoint_id=str(path / "model"),
             process_group=trainer.group)
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    optim = {"state": {k.removeprefix("lm."): v for k, v in optim["state"].items()},
             "param_groups": [{**g, "params": [n.removeprefix("lm.") for n in g["params"]]}
                              for g in optim["param_groups"]]}
    dcp.save({"optim_state": {"optim": optim}}, checkpoint_id=str(path / "optimizer"), process_group=trainer.group)
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


def fixture_worker(out: Path, model_dir: Path, ckpt: Path) -> None:
    """One rank resumes the fixture (copied to ``ckpt``) with the flags of the run Miles saved; writes what it got."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from trainer_harness import build, flags

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    # the driver's run: 4 rollouts x 2 optimizer steps, cosine from 3e-3 to 1e-4 after 2 warm-up steps
    tr = build(model_dir, flags("fsdp", "ckpt_run", "cosine", ["--num-rollout", str(NUM_ROLLOUT), "--load", str(ckpt)]))
    extra = tr.resume()
    rng_draw = torch.rand(8)                 # first thing after the resume, as the driver drew after its save
    optim = get_optimizer_state_dict(tr.model, tr.optimizer)["state"]
    torch.save({"extra": extra, "params": tr.state_dict_for_check(), "rng_draw": rng_draw,
                "schedule_step": tr.schedule.step, "lr": tr.schedule.apply(tr.optimizer),
                "optim": {name.removeprefix("lm."): {k: v.detach().clone() for k, v in st.items()}  # PolicyModel.lm
                          for name, st in optim.items()}},
               out / "resumed.pt")
    dist.destroy_process_group()


def _read_dcp(d: Path) -> dict:
    """A DCP directory's whole state dict, read on its own (torch's DCP -> torch.save conversion), flat keys."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(d), str(d.parent / f"{d.name}.pt"))
    flat: dict = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            flat[prefix] = v

    walk("", torch.load(d.parent / f"{d.name}.pt", weights_only=False))
    return flat


def _miles_lr(sched: dict) -> float:
    """The LR radixark/miles@v0.1.0:miles/backends/fsdp_utils/lr_scheduler.py gives at ``last_epoch`` (Megatron's
    shape: warm-up from init_lr, then the decay style), computed here from the saved scheduler state."""
    import math

    s, w, d = sched["last_epoch"], sched["lr_warmup_steps"], sched["lr_decay_steps"]
    lo, hi = sched["min_lr"], sched["max_lr"]
    if w > 0 and s <= w:
        return sched["init_lr"] + (hi - sched["init_lr"]) * float(s) / float(w)
    if sched["lr_decay_style"] == "constant":
        return hi
    if s > d:
        return lo
    ratio = float(s - w) / float(d - w)
    coeff = 1.0 - ratio if sched["lr_decay_style"] == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return lo + coeff * (hi - lo)


def test_miles_own_fsdp_checkpoint_resumes_bitwise(tmp_path, tiny_model_dir):
    import shutil

    import torch

    ckpt = tmp_path / "miles_save"
    shutil.copytree(FIXTURE, ckpt, ignore=shutil.ignore_patterns("README.md", "driver_record.json"))
    record = json.loads((FIXTURE / "driver_record.json").read_text())
    step_dir = FIXTURE / "iter_0000002"
    saved_model = {k.removeprefix("model_state.model."): v for k, v in _read_dcp(ckpt / "iter_0000002" / "model").items()}
    saved_optim = _read_dcp(ckpt / "iter_0000002" / "optimizer")
    sched = {k.removeprefix("lr_scheduler_state.lr_scheduler."): v
             for k, v in _read_dcp(ckpt / "iter_0000002" / "lr_scheduler").items()}
    meta = json.loads((step_dir / "meta.json").read_text())
    assert sched["last_epoch"] == record["optimizer_steps"] == 4 and meta["global_step"] == 0  # v0.1.0: not advanced
    assert _miles_lr(sched) == record["next_lr"]            # the formula above is Miles's, on Miles's own numbers

    res = _launch_fixture(tmp_path / "out", tiny_model_dir, ckpt)
    assert res.returncode == 0, res.stdout[-4000:]
    got = torch.load(tmp_path / "out" / "resumed.pt", weights_only=False)
    assert got["extra"]["rollout_id"] == 1 and got["extra"]["next_rollout_id"] == 2, got["extra"]
    # weights: every tensor Miles saved, bitwise (tied lm_head is the embedding)
    params = got["params"]
    assert set(params) <= set(saved_model) and "model.embed_tokens.weight" in params, sorted(params)[:5]
    for name, t in params.items():
        assert torch.equal(t, saved_model[name]), name
    # AdamW state: exp_avg, exp_avg_sq and step of every parameter
    assert set(got["optim"]) == set(params)
    for name, st in got["optim"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[k].reshape(-1).float() if k == "step" else st[k],
                               saved_optim[f"optim_state.optim.state.{name}.{k}"].reshape(-1).float()
                               if k == "step" else saved_optim[f"optim_state.optim.state.{name}.{k}"]), (name, k)
    # LR schedule: the next optimizer step is Miles's step 4, at the LR Miles's scheduler gives there
    assert got["schedule_step"] == sched["last_epoch"]
    assert got["lr"] == _miles_lr(sched) == record["next_lr"]
    # RNG: the draw right after the resume is the draw Miles's process made right after saving
    assert got["rng_draw"].tolist() == record["rng_draw_after_save"]


def _launch_fixture(out: Path, model_dir: Path, ckpt: Path) -> subprocess.CompletedProcess:
    from _torchrun import torchrun

    from miles.utils.net import find_free_port

    out.mkdir(parents=True, exist_ok=True)
    return torchrun(HERE, 1, find_free_port(), "fixture", str(out), str(model_dir), str(ckpt), timeout=300,
                    env={"PYTHONPATH": str(HERE.parents[2])})


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


if __name__ == "__main__" and sys.argv[1] == "fixture":
    fixture_worker(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
elif __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
