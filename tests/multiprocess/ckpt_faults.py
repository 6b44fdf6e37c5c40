"""Checkpoint faults on real trainer ranks, the same scenario for both backends (``test_checkpoint_resume.py``,
``test_megatron_ckpt.py``): 2 gloo ranks, a trainer built by the test file's ``make_trainer(model_dir, flags,
group)``; the worker writes what it saw to ``<out>.<rank>`` (JSON) and the test checks it.

1. ``full``: a real tmpfs (mounted by rank 0, we are root) with room for one checkpoint and not two: the second
   save fails on every rank with one line ("no space left on device ...") and its ``.tmp`` directory is removed.
2. ``fallback``: checkpoints 0-3 under a directory; 3 has a truncated shard, 2 an unreadable metadata file of the
   backend (``common.pt`` / ``trainer_state.json``), 1 no DCP ``.metadata``: ``--load`` of it resumes from 0 with
   one warning naming 3, 2 and 1.
3. ``untracked`` (layouts with a tracker): the same directory without the tracker, as ``--save``: the run resumes
   from the newest checkpoint that verifies (0, one warning), never writes over the others.
4. ``foreign``: ``--load`` elsewhere and a ``--save`` holding checkpoints: the run resumes from ``--save`` (its
   own history after a relaunch; newest usable, 0) with one warning naming both, so nothing there is overwritten. ``none``: every checkpoint corrupt: one line naming the directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer_harness import flags

FLAGS = flags("ckpt_run", ["--num-rollout", "4", "--save-interval", "1"])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _outcome(fn: Callable[[], Any]) -> dict:
    try:
        return {"ok": fn()}
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"error": type(e).__name__, "message": str(e)}


def worker(make_trainer: Callable[[str, list[str], Any], Any], layout_name: str, model_dir: str, out: str,
           work: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from trainer_harness import random_samples

    from miles.trainer.checkpoint import layout as L

    layout = getattr(L, layout_name)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    rank = dist.get_rank(group)
    work_dir = Path(work)
    res: dict[str, Any] = {}

    # 1. a disk that fills during a save
    probe = work_dir / "probe"
    tr = make_trainer(model_dir, FLAGS + ["--save", str(probe)], group)
    tr.checkpoint(0, extra={})
    size = sum(f.stat().st_size for f in (probe / layout.name(0)).rglob("*") if f.is_file())
    mnt = work_dir / "small"
    mounted = [False]
    if rank == 0:
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5) // 4096 * 4096}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        mounted = [r.returncode == 0]
    dist.broadcast_object_list(mounted, group_src=0, group=group)
    res["mounted"] = mounted[0]
    if mounted[0]:
        small = make_trainer(model_dir, FLAGS + ["--save", str(mnt), "--keep-checkpoints", "1"], group)
        small.checkpoint(0, extra={})
        res["full"] = _outcome(lambda: small.checkpoint(1, extra={}))
        dist.barrier(group)
        res["full_left"] = sorted(p.name for p in mnt.iterdir())
        dist.barrier(group)
        if rank == 0:
            subprocess.run(["umount", str(mnt)], check=False)

    # 2. corrupt newest checkpoints under an explicit --load
    root = work_dir / "ckpt"
    tr = make_trainer(model_dir, FLAGS + ["--save", str(root), "--keep-checkpoints", "0"], group)
    torch.manual_seed(7)
    for rid in range(4):
        tr.train(random_samples(1, 3, first_group=rank), rid)
        tr.checkpoint(rid, extra={"mark": rid})
    dist.barrier(group)
    if rank == 0:
        shard = sorted((root / layout.name(3)).rglob("*.distcp"))[0]
        with open(shard, "r+b") as f:
            f.truncate(100)
        meta = "common.pt" if layout.tracker else "trainer_state.json"
        (next((root / layout.name(2)).rglob(meta))).write_bytes(b"garbage")
        for f in (root / layout.name(1)).rglob(".metadata"):
            f.unlink()
    dist.barrier(group)
    if layout.tracker and rank == 0:                     # the dry run's check of --load takes the same fallback
        from miles.config import parse_args
        from miles.trainer.megatron import dist_ckpt

        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        res["preflight"] = _outcome(lambda: dist_ckpt.preflight_check(
            parse_args(["--hf-checkpoint", model_dir, "--train-backend", "megatron", "--load", str(root),
                        "--tensor-model-parallel-size", "2"] + FLAGS),        # test_megatron_ckpt's trainer: TP 2
            hf_config))
    handler = _Lines()
    logging.getLogger("miles").addHandler(handler)
    res["fallback"] = _outcome(lambda: make_trainer(model_dir, FLAGS + ["--load", str(root)], group).resume()["mark"])
    res["fallback_log"] = [ln for ln in handler.lines if ln.startswith("WARNING")]
    handler.lines.clear()

    # 3. the same directory without its tracker, as --save: resumed from, not overwritten
    if layout.tracker:
        dist.barrier(group)
        if rank == 0:
            (root / L.TRACKER).unlink()
        dist.barrier(group)
        before = sorted(p.name for p in root.iterdir())
        res["untracked"] = _outcome(lambda: make_trainer(model_dir, FLAGS + ["--save", str(root)], group)
                                    .resume()["mark"])
        res["untracked_log"] = [ln for ln in handler.lines if ln.startswith("WARNING")]
        res["untracked_unchanged"] = sorted(p.name for p in root.iterdir()) == before
        handler.lines.clear()

    # 4. a --save that holds checkpoints wins over --load elsewhere (a relaunch continues its own run; nothing
    # there is overwritten by a run that did not resume from it); nothing usable: one line
    res["foreign"] = _outcome(lambda: make_trainer(model_dir, FLAGS + ["--load", str(probe), "--save", str(root)],
                                                   group).resume()["mark"])
    res["foreign_log"] = [ln for ln in handler.lines if ln.startswith("WARNING")]
    handler.lines.clear()
    dist.barrier(group)
    if rank == 0:
        for f in (root / layout.name(0)).rglob(".metadata"):
            f.unlink()
    dist.barrier(group)
    res["none"] = _outcome(lambda: make_trainer(model_dir, FLAGS + ["--load", str(root)], group).resume())
    logging.getLogger("miles").removeHandler(handler)
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    dist.barrier(group)
    dist.destroy_process_group()


def run(script: Path, layout_name: str, model_dir: Path, tmp: Path) -> list[dict]:
    """Launch the scenario; returns each rank's findings."""
    from _torchrun import torchrun

    from miles.utils.net import find_free_port

    proc = torchrun(script, 2, find_free_port(), "ckpt_faults", layout_name, str(model_dir), str(tmp / "out"),
                    str(tmp), timeout=400)
    try:
        assert proc.returncode == 0, proc.stdout[-5000:]
        return [json.loads(Path(f"{tmp / 'out'}.{r}").read_text()) for r in (0, 1)]
    finally:
        if (tmp / "small").is_dir():
            subprocess.run(["umount", str(tmp / "small")], check=False, capture_output=True)
        shutil.rmtree(tmp / "probe", ignore_errors=True)


def check(results: list[dict], layout, tmp: Path) -> None:
    """What both backends must show (see the module docstring)."""
    root = tmp / "ckpt"
    for rank, res in enumerate(results):
        if res["mounted"]:
            full = res["full"]
            assert full.get("error") == "CheckpointWriteError", (rank, full)
            msg = full["message"]
            assert msg.startswith(f"no space left on device writing checkpoint {layout.name(1)} under {tmp / 'small'}"), msg
            assert "\n" not in msg and f"the partial .tmp.{layout.name(1)} was removed" in msg, msg
            assert res["full_left"] == [layout.name(0)] + (["latest_checkpointed_iteration.txt"] if layout.tracker
                                                            else []), res["full_left"]
        assert res["fallback"] == {"ok": 0}, (rank, res["fallback"])
        if layout.tracker and rank == 0:
            assert res["preflight"] == {"ok": None}, res["preflight"]
        if rank == 0:
            assert len(res["fallback_log"]) == 1, res["fallback_log"]
            line = res["fallback_log"][0]
            assert f"--load {root}: skipped corrupt checkpoint(s)" in line and f"resumed from {layout.name(0)}" in line
            assert f"{layout.name(3)}: " in line and "truncated" in line and f"{layout.name(2)}: " in line, line
            assert f"{layout.name(1)}: " in line and ".metadata is missing" in line, line
        if layout.tracker:
            assert res["untracked"] == {"ok": 0} and res["untracked_unchanged"], (rank, res["untracked"])
            if rank == 0:
                assert any("no latest_checkpointed_iteration.txt" in ln for ln in res["untracked_log"]), res["untracked_log"]
        assert res["foreign"] == {"ok": 0}, (rank, res["foreign"])    # the newest usable of --save (2. corrupted 1-3)
        if rank == 0:
            assert any(ln.startswith("WARNING") and f"--save {root} already holds checkpoints" in ln
                       and f"rather than from --load {tmp / 'probe'}" in ln for ln in res["foreign_log"]), res["foreign_log"]
        none = res["none"]
        assert none.get("error") == "ValueError" and none["message"].startswith(f"--load {root}: no usable checkpoint")
        assert "\n" not in none["message"], none
    if not results[0].get("mounted"):
        import pytest

        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): the full-disk case did not run")
