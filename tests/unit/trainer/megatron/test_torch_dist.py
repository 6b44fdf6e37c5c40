"""Megatron-LM's checkpoint directories (``torch_dist.py``) and checkpoint flags, in one process: the tracker,
which ``iter_*`` dir ``--load`` / ``--ckpt-step`` picks, atomic publication, pruning, failures as one line."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from miles.config import parse_args
from miles.config.base import ConfigError
from miles.trainer.checkpoint import CheckpointWriteError
from miles.trainer.checkpoint import layout as L
from miles.trainer.megatron import dist_ckpt
from miles.trainer.megatron import torch_dist as td


def _fake_iter(root: Path, it: int) -> Path:
    d = root / L.ITER.name(it)
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return d


def test_tracker_and_candidates(tmp_path: Path) -> None:
    assert L.read_tracker(tmp_path) is None and td.candidates(tmp_path, "--load") == []
    for it in (1, 2, 3, 4):
        _fake_iter(tmp_path, it)
    (tmp_path / L.TRACKER).write_text("3\n")
    # the tracker's first, then older ones (fallbacks); iter 4 (newer than the tracker) was never published
    assert [p.name for p in td.candidates(tmp_path, "--load")] == ["iter_0000003", "iter_0000002", "iter_0000001"]
    assert [p.name for p in td.candidates(tmp_path, "--load", ckpt_step=2)] == ["iter_0000002"]
    assert td.candidates(tmp_path / "iter_0000002", "--load") == [tmp_path / "iter_0000002"]
    with pytest.raises(ValueError) as e:
        td.candidates(tmp_path, "--load", ckpt_step=9)
    assert "--ckpt-step 9" in str(e.value) and "iter_0000003" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / L.TRACKER).write_text("release")
    assert td.candidates(tmp_path, "--load") == [tmp_path / "release"]
    (tmp_path / L.TRACKER).write_text("garbage")
    with pytest.raises(ValueError, match="not an iteration number"):
        td.candidates(tmp_path, "--load")


def test_candidate_errors_name_the_flag_the_user_gave(tmp_path: Path) -> None:
    _fake_iter(tmp_path, 1)
    (tmp_path / L.TRACKER).write_text("1")
    with pytest.raises(ValueError) as e:          # --ref-load's step is --ref-ckpt-step, not --ckpt-step
        td.candidates(tmp_path, "--ref-load", ckpt_step=9)
    assert str(e.value).startswith("--ref-ckpt-step 9: ") and "drop --ref-ckpt-step." in str(e.value), str(e.value)
    assert "--ckpt-step" not in str(e.value).replace("--ref-ckpt-step", "")
    (tmp_path / L.TRACKER).write_text("garbage")
    with pytest.raises(ValueError) as e:
        td.candidates(tmp_path, "--ref-load")
    assert str(e.value).startswith(f"--ref-load {tmp_path}: ") and "not an iteration number" in str(e.value)


def test_save_atomic_publishes_then_prunes(tmp_path: Path) -> None:
    import torch

    def write(d: Path) -> None:
        (d / "payload").write_text("x")

    for it in range(4):
        path = L.save_atomic(tmp_path, L.ITER, it, write, device=torch.device("cpu"), keep=2)
        assert path == tmp_path / L.ITER.name(it) and L.read_tracker(tmp_path) == it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000003", L.TRACKER]
    # a re-save of an iteration (after a resume) replaces it
    L.save_atomic(tmp_path, L.ITER, 3, lambda d: (d / "payload").write_text("y"))
    assert (tmp_path / "iter_0000003" / "payload").read_text() == "y"


def test_failed_save_is_one_line_and_leaves_the_previous(tmp_path: Path) -> None:
    import torch

    L.save_atomic(tmp_path, L.ITER, 0, lambda d: None, device=torch.device("cpu"))

    def full(d: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError) as e:
        L.save_atomic(tmp_path, L.ITER, 1, full, device=torch.device("cpu"))
    msg = str(e.value)
    assert "no space left on device" in msg and "iter_0000001" in msg and "iter_0000000 is intact" in msg and "still names it" in msg and "\n" not in msg
    assert not (tmp_path / ".tmp.iter_0000001").exists() and L.read_tracker(tmp_path) == 0


def test_verify_names_the_problem(tmp_path: Path) -> None:
    miles_fsdp = tmp_path / "iter_0000001"
    (miles_fsdp / "model").mkdir(parents=True)
    assert "--train-backend fsdp" in dist_ckpt.verify(miles_fsdp, False)
    d = _fake_iter(tmp_path, 2)
    assert "common.pt is missing" in dist_ckpt.verify(d, False)
    (tmp_path / "plain").mkdir()
    assert "not a torch_dist checkpoint" in dist_ckpt.verify(tmp_path / "plain", False)


def test_checkpoint_flags() -> None:
    base = ["--hf-checkpoint", "x", "--num-rollout", "1", "--rollout-batch-size", "2"]
    cfg = parse_args(base + ["--train-backend", "megatron", "--ckpt-format", "torch_dist", "--finetune",
                             "--no-load-rng", "--ckpt-step", "0", "--ref-ckpt-step", "3"])
    m = cfg.megatron
    assert (m.ckpt_format, m.finetune, m.no_load_rng, m.ckpt_step, m.ref_ckpt_step) == ("torch_dist", True, True, 0, 3)
    for bad, text in ((["--ckpt-format", "torch"], "--ckpt-format torch is not supported"),
                      (["--ckpt-step", "-1"], "--ckpt-step must be >= 0")):
        with pytest.raises(ConfigError, match=text):
            parse_args(base + ["--train-backend", "megatron"] + bad)
    with pytest.raises(ConfigError, match="--finetune needs --train-backend megatron"):
        parse_args(base + ["--train-backend", "fsdp", "--finetune"])


def test_dry_run_refuses_a_hf_load_dir_unless_bridge(tiny_model_dir: Path) -> None:
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    base = ["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
            "--train-backend", "megatron", "--load", str(tiny_model_dir)]
    with pytest.raises(ConfigError) as e:
        dist_ckpt.preflight_check(parse_args(base), hf_config)
    assert "--megatron-to-hf-mode bridge" in str(e.value) and "\n" not in str(e.value)
    dist_ckpt.preflight_check(parse_args(base + ["--megatron-to-hf-mode", "bridge"]), hf_config)
