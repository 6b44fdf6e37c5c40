"""The kill-mid-save harness both trainer backends' tests use: a real trainer rank is SIGKILLed at a named point of
a checkpoint save (``miles.trainer.checkpoint.faults``: ``MILES_CKPT_KILL_AT``), the job is relaunched, and the
resumed run must end bitwise equal to an uninterrupted one.

A test file provides ``make_trainer(model_dir, flags, group)`` and re-enters through ``worker`` in its ``__main__``
branch:

    if __name__ == "__main__" and sys.argv[1] == "kill_mid_save":
        kill_mid_save.worker(make_trainer, *sys.argv[2:])

Each launch: 2 gloo ranks (a trainer group built with new_group), ``NUM_ROLLOUT`` rollouts of 2 optimizer steps, a
checkpoint after each (``--save-interval 1 --keep-checkpoints 1 --save-retain-interval 2``); each rank draws its
samples from the global torch RNG, so the data depends on the RNG state the checkpoint restores. The reference run
saves nothing; the killed run dies inside the save of rollout ``KILL_STEP``; the relaunch resumes from the previous
complete checkpoint (``shards``, ``rename``, ``tracker``) or from the one just published (``prune``) and must match
the reference: parameters, the losses it computes, the LR schedule, the next RNG draw on every rank and (when the
test gives ``moments``) the Adam moments. The directory then holds rollouts 0, 2, 4 (retained) and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer_harness import flags

NUM_ROLLOUT = 5
KILL_STEP = 2
FLAGS = flags("ckpt_run", "cosine", "kl", ["--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1",
                                            "--keep-checkpoints", "1", "--save-retain-interval", "2"])
# the rank each point is reached on: shards are written by every rank (kill a non-zero one); rank 0 renames,
# updates the tracker and prunes
KILL_RANK = {"shards": 1, "rename": 0, "tracker": 0, "prune": 0}


def worker(make_trainer: Callable[[str, list[str], Any], Any], model_dir: str, out: str, save_dir: str,
           moments: Callable[[Any], dict] | None = None) -> None:
    """One rank of a launch: train ``NUM_ROLLOUT`` rollouts (resuming from ``save_dir`` unless it is ``-``), write
    what the test compares to ``<out>.<rank>``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from trainer_harness import random_samples

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    rank = dist.get_rank(group)
    tr = make_trainer(model_dir, FLAGS + (["--save", save_dir] if save_dir != "-" else []), group)
    torch.manual_seed(100 + rank)                        # the "data" RNG; restored by resume()
    extra = tr.resume() if save_dir != "-" else None
    start = 0 if extra is None else extra["rollout_id"] + 1
    if extra is not None:
        assert extra["data_position"] == start * 3, extra
    losses = {}
    for rid in range(start, NUM_ROLLOUT):
        # one group of 3 per rank and rollout, from the global RNG
        losses[rid] = tr.train(random_samples(1, 3, first_group=rank), rid)["loss"]
        if tr.should_save(rid):
            tr.checkpoint(rid, extra={"data_position": (rid + 1) * 3})
    torch.save({"params": tr.state_dict_for_check(), "losses": losses, "draw": torch.rand(4),
                "schedule": tr.schedule.step, "resumed_from": None if extra is None else extra["rollout_id"],
                "moments": moments(tr) if moments is not None else None}, f"{out}.{rank}")
    dist.barrier(group)
    dist.destroy_process_group()


def launch(script: Path, model_dir: Path, out: Path, save_dir: str, kill: str | None = None, timeout: int = 300):
    """torchrun of ``script kill_mid_save <model_dir> <out> <save_dir>`` on 2 ranks, ``MILES_CKPT_KILL_AT=kill``."""
    from _torchrun import torchrun

    from miles.utils.net import find_free_port

    return torchrun(script, 2, find_free_port(), "kill_mid_save", str(model_dir), str(out), save_dir, timeout=timeout,
                    env={"MILES_CKPT_KILL_AT": kill or ""})


def reference(script: Path, out: Path, model_dir: Path) -> Path:
    """The uninterrupted run (no --save); returns its output prefix."""
    run = launch(script, model_dir, out, "-")
    assert run.returncode == 0, run.stdout[-4000:]
    return out


def _published(root: Path, layout) -> list[int]:
    from miles.trainer.checkpoint.layout import published

    return [s for s, _ in published(root, layout)]


def kill_then_resume(script: Path, tmp: Path, ref: Path, point: str, layout, model_dir: Path) -> None:
    """Kill at ``point`` of the save of rollout ``KILL_STEP``, check what is on disk, relaunch, compare with ``ref``."""
    import torch

    from miles.trainer.checkpoint.layout import read_tracker

    ckpt = tmp / "ckpt"
    killed = launch(script, model_dir, tmp / "killed.pt", str(ckpt), kill=f"{point}:{KILL_STEP}:{KILL_RANK[point]}")
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert "SIGKILL" in killed.stdout or "-9" in killed.stdout, killed.stdout[-3000:]
    name = layout.name(KILL_STEP)
    tmp_dir = ckpt / f".tmp.{name}"
    published_after_kill = point in ("tracker", "prune")
    # what the kill left: the partial save (never read), or the published checkpoint (tracker not updated yet)
    assert tmp_dir.is_dir() == (not published_after_kill), sorted(p.name for p in ckpt.iterdir())
    assert (ckpt / name).is_dir() == published_after_kill, sorted(p.name for p in ckpt.iterdir())
    # --keep-checkpoints 1: rollout 1 would be pruned by this save; rollout 0 is retained (--save-retain-interval 2)
    assert _published(ckpt, layout) == ([0, 1, 2] if published_after_kill else [0, 1])
    tracked_after_kill = KILL_STEP if point == "prune" else KILL_STEP - 1
    if layout.tracker:
        assert read_tracker(ckpt) == tracked_after_kill
    resume_from = tracked_after_kill if layout.tracker else (KILL_STEP if published_after_kill else KILL_STEP - 1)

    resumed = launch(script, model_dir, tmp / "resumed.pt", str(ckpt))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    for rank in (0, 1):
        a = torch.load(f"{ref}.{rank}", weights_only=False)
        b = torch.load(f"{tmp / 'resumed.pt'}.{rank}", weights_only=False)
        assert b["resumed_from"] == resume_from, (point, b["resumed_from"])
        assert sorted(b["losses"]) == list(range(resume_from + 1, NUM_ROLLOUT))
        assert all(b["losses"][k] == a["losses"][k] for k in b["losses"]), (b["losses"], a["losses"])
        assert torch.equal(a["draw"], b["draw"]) and a["schedule"] == b["schedule"] == NUM_ROLLOUT * 2
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), (point, k)
        if a["moments"] is not None:
            assert a["moments"].keys() == b["moments"].keys()
            for k, (m1, v1, s1) in a["moments"].items():
                m2, v2, s2 = b["moments"][k]
                assert torch.equal(m1, m2) and torch.equal(v1, v2) and s1 == s2, (point, k)
    # --keep-checkpoints 1 --save-retain-interval 2 over rollouts 0-4: 0, 2, 4 stay; no partial save is left
    assert _published(ckpt, layout) == [0, 2, 4], sorted(p.name for p in ckpt.iterdir())
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".")], sorted(p.name for p in ckpt.iterdir())
    if layout.tracker:
        assert read_tracker(ckpt) == NUM_ROLLOUT - 1
