"""A Miles-style Python launcher trains for real: ``python tests/fixtures/miles_launchers/run_tiny.py`` (written
against Miles's launcher API) builds a tiny model and data, skips the torch_dist conversion, and starts its
``train.py`` command under torchrun (1 trainer rank of the Megatron backend + 1 embedded engine, 2 rollouts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _miles_e2e import REPO, check_ok, check_run_dir, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]


def test_miles_launcher_trains_under_torchrun(tmp_path: Path):
    out, log = tmp_path / "out", tmp_path / "launcher.log"
    cmd = [sys.executable, str(REPO / "tests/fixtures/miles_launchers/run_tiny.py"), "--work-dir", str(tmp_path),
           "--output-dir", str(out), "--num-rollout", "2"]
    check_ok(run(cmd, log, timeout=600, PYTHONPATH=str(REPO)), log)
    check_run_dir(out, num_rollout=2, num_ranks=2)
    text = log.read_text()
    exec_line = next(ln for ln in text.splitlines() if ln.startswith("EXEC: ") and "train.py" in ln)
    assert "torchrun --standalone --nnodes 1 --nproc-per-node 2 " in exec_line
    # the model script's shape flags reached the job (and its backend check accepted them against config.json)
    assert "--num-layers 2 --hidden-size 64 --ffn-hidden-size 192" in exec_line
    assert f"--ref-load {tmp_path}/Tiny " in exec_line  # the skipped conversion's --ref-load is the HF directory
    assert "convert_checkpoint(Tiny): skipped" in text
    assert "Megatron trainer ready" in text and "rollout 1/2 | reward" in text
