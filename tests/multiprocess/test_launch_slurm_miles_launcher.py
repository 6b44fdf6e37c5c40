"""A Miles-style Python launcher inside a real Slurm allocation (the private one-node cluster of
tools/slurm-local.sh, shared with test_launch_slurm.py's fixture): ``U.execute_train`` starts the job as one srun
step with one task per rank, and every rank reports the role the plan gives it."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from spmd_helpers import PYTHON, REPO, Job, assert_smoke, roles
from test_launch_slurm import slurm_conf  # noqa: F401  (the session's private cluster)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slurm, pytest.mark.slow]


def test_launcher_in_sbatch_starts_one_srun_step(slurm_conf, tmp_path: Path):  # noqa: F811
    out, name = tmp_path / "job.out", f"miles-test-{uuid.uuid4().hex[:8]}"
    batch = tmp_path / "job.sh"
    batch.write_text(f"#!/bin/bash\nexec {PYTHON} {REPO}/tests/fixtures/miles_launchers/run_smoke.py "
                     f"--smoke-dir {tmp_path}\n")
    env = dict(os.environ, SLURM_CONF=slurm_conf, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = ["sbatch", "--wait", f"--job-name={name}", "--time=3", "--nodes=1", "--ntasks-per-node=2",
           "--cpus-per-task=1", "--gpus-per-node=0", f"--output={out}", str(batch)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", name], env=env, capture_output=True, timeout=30)
        raise AssertionError(f"job {name} did not finish:\n{out.read_text()[-4000:] if out.exists() else ''}") from None
    text = out.read_text() if out.exists() else ""
    job = Job(p.returncode, text, p.stderr + text, 0.0)
    lines = assert_smoke(job, 2, "slurm")
    assert roles(lines) == {0: {"driver", "trainer"}, 1: {"engine_leader"}}
    assert "EXEC: " in text and "srun --kill-on-bad-exit=1 --cpu-bind=none --nodes=1 --ntasks=2 --ntasks-per-node=2" in text
