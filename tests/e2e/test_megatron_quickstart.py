"""The quickstart's GRPO phase with ``--train-backend megatron --tensor-model-parallel-size 2`` under torchrun
(disaggregated: 2 Megatron trainer ranks, one TP group, + 2 embedded engines; and colocated), with
``--check-weight-update-equal`` after every sync (the engines hold exactly the trainer's weights), a
Megatron checkpoint at rollout 20 and 40, then a resumed run continuing from the last checkpoint.
Learning criterion as the FSDP quickstart's: the last 3 rollouts' mean reward at least 0.3 above the
first 3 and at least 0.8. The SFT warm start is run_sft.sh's (the default backend), as in the quickstart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, check_ok, check_run_dir, run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1500)]

MEGATRON = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--check-weight-update-equal"]


@pytest.fixture(scope="module")
def quickstart(quickstart_sft: Path) -> Path:
    """run_sft.sh's warm start, built once per session (tests/conftest.py's ``quickstart_sft``)."""
    return quickstart_sft


def test_megatron_tp2_quickstart_learns_and_resumes(quickstart: Path, tmp_path: Path) -> None:
    out, log, ckpt = tmp_path / "run", tmp_path / "run.log", tmp_path / "ckpt"
    check_ok(run(["bash", str(QUICKSTART / "run_grpo.sh"), *MEGATRON, "--save", str(ckpt), "--save-interval", "20",
                  "--output-dir", str(out)], log, timeout=600, QUICKSTART_DIR=str(quickstart)), log)
    text = log.read_text()
    assert "Megatron trainer ready" in text and "TP 2 x PP 1 x DP 1" in text
    assert "is not installed. Falling back" not in text and "are not installed. Falling back" not in text
    from miles.trainer.megatron import optional_kernels_line

    assert text.count("megatron-core optional kernels absent") == (1 if optional_kernels_line() else 0)  # rank 0
    assert text.count("--check-weight-update-equal: ") >= 41, text[-3000:]   # initial sync + one per rollout
    recs = check_run_dir(out, num_rollout=40, num_ranks=4)
    rewards = [r["rollout/raw_reward"] for r in recs]
    first3, last3 = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last3 >= first3 + 0.3 and last3 >= 0.8, f"first3 {first3:.3f} last3 {last3:.3f}: {rewards}"

    from miles.trainer.megatron import torch_dist  # Megatron-LM's layout: iter_*, tracker, common.pt

    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000019", "iter_0000039"]
    assert torch_dist.read_tracker(ckpt) == 39
    common = torch_dist.read_common(ckpt / "iter_0000039")
    meta = common["miles"]
    assert meta["backend"] == "megatron" and common["args"].tensor_model_parallel_size == 2
    assert meta["schedule"]["step"] == 40 and meta["extra"]["rollout_id"] == 39

    out2, log2 = tmp_path / "resumed", tmp_path / "resumed.log"
    check_ok(run(["bash", str(QUICKSTART / "run_grpo.sh"), *MEGATRON, "--load", str(ckpt), "--num-rollout", "42",
                  "--output-dir", str(out2)], log2, timeout=600, QUICKSTART_DIR=str(quickstart)), log2)
    assert "resuming at rollout 40" in log2.read_text()
    recs2 = check_run_dir(out2, num_rollout=2, num_ranks=4, first=40)
    assert min(r["rollout/raw_reward"] for r in recs2) >= 0.6, recs2      # continues from the trained policy


def test_megatron_tp2_colocated(quickstart: Path, tmp_path: Path) -> None:
    """Colocated (2 ranks: one TP group that also hosts the 2 engines; weights hand over in place)."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    check_ok(run(["bash", str(QUICKSTART / "run_grpo_colocated.sh"), *MEGATRON, "--num-rollout", "3",
                  "--output-dir", str(out)], log, timeout=600, QUICKSTART_DIR=str(quickstart)), log)
    check_run_dir(out, num_rollout=3, num_ranks=2)
    text = log.read_text()
    assert "(tensor) to 2 engine(s)" in text and "TP 2 x PP 1 x DP 1" in text
    assert text.count("--check-weight-update-equal: ") >= 4
