"""SIGKILL of a Miles-style Python launcher (tests/fixtures/miles_launchers/run_smoke.py, its job under torchrun)
takes the whole job down: the torchrun agent gets SIGTERM (PR_SET_PDEATHSIG) and stops its ranks, whose
engines go with them."""

from __future__ import annotations

import os

import pytest
from launcher_kill import kill_and_time_orphans, kill_tagged, launch, new_tag, tagged, wait_until
from spmd_helpers import PYTHON, REPO

pytestmark = [pytest.mark.multiprocess]

ORPHAN_BOUND_S = 5.0  # as test_launch_torchrun.py's: the ranks' watch polls every 0.2 s, engines get 1 s


def test_sigkill_of_the_launcher_takes_its_job_down(tmp_path):
    tag = new_tag()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("SLURM_JOB_ID", None)
    job = launch([PYTHON, str(REPO / "tests/fixtures/miles_launchers/run_smoke.py"), "--smoke-dir", str(tmp_path),
                  "--extra-args", "--smoke-hold 300"], env, tag, tmp_path)
    try:
        wait_until(job, lambda: job.stdout.read_text().count("SMOKE OK") == 2, 180, "2 SMOKE OK lines")
        procs = tagged(tag)
        assert any("torchrun" in p.cmdline for p in procs.values() if p.ppid == job.proc.pid), procs
        seconds, _ = kill_and_time_orphans(job, job.proc.pid, ORPHAN_BOUND_S)
        job.proc.wait(timeout=10)
    finally:
        kill_tagged(tag)
    print(f"the launcher's torchrun, ranks and engine gone {seconds:.2f}s after its SIGKILL")
