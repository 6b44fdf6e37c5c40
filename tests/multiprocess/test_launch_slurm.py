"""slurm/grpo.sh under ``sbatch --wait`` on a real one-node Slurm cluster (tools/slurm-local.sh).

The cluster is private to this test session: its own folder, munge socket and ports; it is stopped
(and its folder removed) at the end. Every job has a Slurm time limit and a client-side timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from spmd_helpers import PYTHON, REPO, Job, assert_smoke, roles

from miles.utils.net import find_free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slurm, pytest.mark.slow]
BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


@pytest.fixture(scope="session")
def slurm_conf():
    if os.geteuid() != 0:
        pytest.skip("the private Slurm cluster needs root (slurmd setuids to job owners)")
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        pytest.skip(f"Slurm/munge binaries missing: {missing} (tools/install-system-deps.sh installs them)")
    base = Path(tempfile.mkdtemp(prefix="miles-slurm-", dir="/tmp"))
    env = dict(os.environ, SLURM_LOCAL_DIR=str(base), SLURM_LOCAL_CTLD_PORT=str(find_free_port()),
               SLURM_LOCAL_SLURMD_PORT=str(find_free_port()))
    start = subprocess.run(["bash", str(REPO / "tools/slurm-local.sh")], env=env, capture_output=True, text=True,
                           timeout=180)
    try:
        assert start.returncode == 0, f"tools/slurm-local.sh failed:\n{start.stderr[-4000:]}"
        conf = start.stdout.strip().rsplit("=", 1)[-1]
        assert Path(conf).exists(), start.stdout
        yield conf
    finally:
        subprocess.run(["bash", str(REPO / "tools/slurm-stop.sh"), "--purge"], env=env, capture_output=True,
                       timeout=180)


def sbatch(conf: str, out: Path, sbatch_args: list[str], script_args: list[str], timeout: float = 240, **env: str):
    name = f"miles-test-{uuid.uuid4().hex[:8]}"
    job_env = dict(os.environ, SLURM_CONF=conf, OMP_NUM_THREADS="1", PYTHON=PYTHON, MILES_HOME=str(REPO), **env)
    cmd = ["sbatch", "--wait", f"--job-name={name}", "--time=4", "--gpus-per-node=0", "--cpus-per-task=1",
           f"--output={out}", *sbatch_args, str(REPO / "slurm/grpo.sh"), *script_args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", name], env=job_env, capture_output=True, timeout=30)
        raise AssertionError(f"job {name} did not finish in {timeout}s:\n"
                             f"{out.read_text()[-4000:] if out.exists() else '(no output)'}") from None
    text = out.read_text() if out.exists() else ""
    return Job(p.returncode, text, p.stderr + text, time.monotonic() - t0)


def test_sbatch_one_task_per_gpu_disaggregated(slurm_conf, tmp_path):
    job = sbatch(slurm_conf, tmp_path / "job.out", ["--ntasks-per-node=4"],
                 ["--smoke-engine-argv", "builtin", "--smoke-dir", str(tmp_path)], ENTRY="-m miles.spmd.smoke")
    lines = assert_smoke(job, 4, "slurm")
    assert roles(lines) == {0: {"driver", "trainer"}, 1: {"trainer"}, 2: {"engine_leader"}, 3: {"engine_leader"}}
    assert "trainer 2, rollout 2 (engines of 1), launch srun" in job.stdout
    assert "engine_pid" in lines[2] and "engine_pid" in lines[3]


def test_sbatch_torchrun_per_node_colocated(slurm_conf, tmp_path):
    job = sbatch(slurm_conf, tmp_path / "job.out", ["--ntasks-per-node=4"], [], ENTRY="-m miles.spmd.smoke",
                 LAUNCH="torchrun", COLOCATE="1", GPUS_PER_ENGINE="2")
    lines = assert_smoke(job, 4, "torchrun")
    assert roles(lines) == {0: {"driver", "trainer", "engine_leader"}, 1: {"trainer", "engine_worker"},
                            2: {"trainer", "engine_leader"}, 3: {"trainer", "engine_worker"}}
    assert "role plan: colocated" in job.stdout


def test_sbatch_bad_plan_fails_on_every_rank(slurm_conf, tmp_path):
    job = sbatch(slurm_conf, tmp_path / "job.out", ["--ntasks-per-node=2"], ["--rollout-num-gpus", "3"],
                 timeout=120, ENTRY="-m miles.spmd.smoke", ACTOR_GPUS="1",
                 SRUN_ARGS="--kill-on-bad-exit=0")  # let each rank fail by itself rather than be killed first
    assert job.returncode != 0
    for r in range(2):
        assert f"[miles r{r}] error: world size mismatch: the plan needs 4 rank(s)" in job.stdout, job.stdout[-3000:]
    assert "Traceback" not in job.stdout


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """The quickstart's model and data (examples/quickstart/prepare.sh), shared by the train.py jobs."""
    qs = tmp_path_factory.mktemp("quickstart")
    prep = subprocess.run(["bash", str(REPO / "examples/quickstart/prepare.sh"), str(qs)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHON=PYTHON))
    assert prep.returncode == 0, prep.stderr[-3000:]
    return qs


def test_sbatch_quickstart_grpo_runs_train_py(slurm_conf, quickstart, tmp_path):
    """The default slurm/grpo.sh job: the quickstart's train.py, 4 tasks (2 trainer + 2 engine ranks)."""
    import json

    qs = quickstart
    out_dir = tmp_path / "run"
    # QUICKSTART_MODEL skips the SFT warm start (learning is asserted in tests/e2e/test_quickstart.py)
    job = sbatch(slurm_conf, tmp_path / "job.out", ["--ntasks-per-node=4"],
                 ["--num-rollout", "2", "--output-dir", str(out_dir), "--eval-interval", "100"], timeout=420,
                 QUICKSTART_DIR=str(qs), QUICKSTART_MODEL=str(qs / "model"), HF_HUB_OFFLINE="1")
    assert job.returncode == 0, job.stdout[-4000:]
    assert "launch srun, entry train.py" in job.stdout
    recs = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["rollout_id"] for r in recs] == [0, 1]
    assert all("rollout/raw_reward" in r and r["perf/update_weights_time"] > 0 for r in recs)
    assert "launcher slurm" in job.stdout and (out_dir / "logs" / "rank3.log").is_file()


def _job_field(conf: str, job_id: str, field: str) -> str:
    p = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=dict(os.environ, SLURM_CONF=conf),
                       capture_output=True, text=True, timeout=30)
    m = re.search(rf"\b{field}=(\S+)", p.stdout)
    return m.group(1) if m else ""


def test_sbatch_requeue_resumes_from_the_last_checkpoint(slurm_conf, quickstart, tmp_path):
    """`sbatch --requeue`: the job is requeued mid-run (what a node failure or preemption does); Slurm runs
    the same script again and train.py resumes from the newest complete checkpoint (--load defaults to
    --save), continuing the rollout ids, with one metrics record per rollout."""
    import json

    qs, out_dir, ckpt, log = quickstart, tmp_path / "run", tmp_path / "ckpt", tmp_path / "job.out"
    env = dict(os.environ, SLURM_CONF=slurm_conf, OMP_NUM_THREADS="1", PYTHON=PYTHON, MILES_HOME=str(REPO),
               QUICKSTART_DIR=str(qs), QUICKSTART_MODEL=str(qs / "model"), HF_HUB_OFFLINE="1", COLOCATE="1")
    name = f"miles-test-{uuid.uuid4().hex[:8]}"
    cmd = ["sbatch", "--parsable", "--requeue", "--open-mode=append", f"--job-name={name}", "--time=8",
           "--gpus-per-node=0", "--cpus-per-task=1", "--ntasks-per-node=2", f"--output={log}",
           str(REPO / "slurm/grpo.sh"), "--num-rollout", "4", "--save", str(ckpt), "--save-interval", "1",
           "--output-dir", str(out_dir), "--eval-interval", "100", "--no-progress"]
    sub = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 300
        while not (ckpt / "step_00000001" / "COMPLETE").exists():  # rollouts 0 and 1 are checkpointed
            state = _job_field(slurm_conf, job_id, "JobState")
            assert state in ("PENDING", "CONFIGURING", "RUNNING") and time.monotonic() < deadline, \
                f"job {job_id} {state}:\n{log.read_text()[-4000:] if log.exists() else ''}"
            time.sleep(0.5)
        req = subprocess.run(["scontrol", "requeue", job_id], env=env, capture_output=True, text=True, timeout=30)
        assert req.returncode == 0, req.stderr
        deadline = time.monotonic() + 420
        while (state := _job_field(slurm_conf, job_id, "JobState")) not in ("COMPLETED", "FAILED", "CANCELLED",
                                                                              "TIMEOUT", "NODE_FAIL"):
            assert time.monotonic() < deadline, f"job {job_id} {state} after the requeue:\n{log.read_text()[-4000:]}"
            if state == "PENDING" and _job_field(slurm_conf, job_id, "Reason") == "BeginTime":
                # slurmctld holds a requeued job back for a while; a test has no time to wait for that
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env,
                               capture_output=True, timeout=30)
            time.sleep(1)
        text = log.read_text(errors="replace")
        assert state == "COMPLETED", f"job {job_id} ended {state}:\n{text[-4000:]}"
        assert _job_field(slurm_conf, job_id, "Restarts") == "1"
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=30)
    m = re.findall(r"resuming at rollout (\d+)", text)
    assert len(m) == 1 and int(m[0]) >= 2, text[-4000:]  # the second run started from a checkpoint
    recs = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["rollout_id"] for r in recs] == [0, 1, 2, 3]  # each rollout once, in order
    assert (ckpt / "step_00000003" / "COMPLETE").exists()
