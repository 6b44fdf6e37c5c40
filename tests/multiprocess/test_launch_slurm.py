"""slurm/grpo.sh under ``sbatch --wait`` on a real one-node Slurm cluster (tools/slurm-local.sh).

The cluster is private to this test session: its own folder, munge socket and ports; it is stopped
(and its folder removed) at the end. Every job has a Slurm time limit and a client-side timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from spmd_helpers import PYTHON, REPO, Job, assert_smoke, roles

from miles.spmd.lifeline import process_name
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


SMALL_NODE = ["--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]  # what the header tells a small cluster


def _fresh_shell(conf: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    """A login shell's environment: no venv activated, no PYTHON/MILES_HOME, `python` on PATH being a plain
    interpreter without torch or miles (the venv's base python)."""
    venv_python = REPO / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip(f"no {venv_python}: the checkout's .venv (make setup) is what this test is about")
    base = Path(sys.base_prefix) / "bin" / "python3"
    probe = subprocess.run([str(base), "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    if probe.stdout.strip() != "True":
        pytest.skip(f"{base} has torch: no python without miles's dependencies to put on PATH")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").symlink_to(base)
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": os.environ.get("HOME", "/root"),
            "SLURM_CONF": conf, "OMP_NUM_THREADS": "1", **extra}


def _sbatch_fresh(env: dict[str, str], out: Path, script_args: list[str], timeout: float = 120) -> Job:
    name = f"miles-test-{uuid.uuid4().hex[:8]}"
    cmd = ["sbatch", "--wait", f"--job-name={name}", "--time=3", *SMALL_NODE, f"--output={out}", "slurm/grpo.sh",
           *script_args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", name], env=env, capture_output=True, timeout=30)
        raise AssertionError(f"job {name} did not finish in {timeout}s:\n"
                             f"{out.read_text()[-4000:] if out.exists() else '(no output)'}") from None
    text = out.read_text() if out.exists() else ""
    return Job(p.returncode, text, p.stderr + text, time.monotonic() - t0)


def test_sbatch_from_a_fresh_shell_uses_the_checkouts_venv(slurm_conf, tmp_path):
    """`sbatch slurm/grpo.sh` from the checkout with nothing activated (`python` on PATH lacks torch and
    miles): the job runs the checkout's .venv python, on the header's small-node overrides."""
    env = _fresh_shell(slurm_conf, tmp_path, ENTRY="-m miles.spmd.smoke")
    job = _sbatch_fresh(env, tmp_path / "job.out", ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                                                     "--smoke-dir", str(tmp_path)])
    lines = assert_smoke(job, 2, "slurm")
    assert roles(lines) == {0: {"driver", "trainer"}, 1: {"engine_leader"}}
    assert "No module named" not in job.stdout


def test_sbatch_with_a_python_without_miles_fails_in_one_line(slurm_conf, tmp_path):
    env = _fresh_shell(slurm_conf, tmp_path, ENTRY="-m miles.spmd.smoke", PYTHON="python")
    job = _sbatch_fresh(env, tmp_path / "job.out", [], timeout=60)
    assert job.returncode == 2, job.stdout[-3000:]
    err = [x for x in job.stdout.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("[grpo.sh] error: PYTHON=python cannot import: torch miles. Fix: make "
                                               "setup (creates "), job.stdout[-3000:]


def test_sbatch_header_shows_overrides_that_fit_a_small_node(slurm_conf):
    """The #SBATCH defaults (8 tasks x 8 CPUs, 8 GPUs) do not fit the test node (8 CPUs, no GPU): Slurm says so
    to --test-only (a real submission would pend); the override the header documents fits."""
    env = dict(os.environ, SLURM_CONF=slurm_conf)
    header = (REPO / "slurm/grpo.sh").read_text().split("\nset -euo pipefail", 1)[0]
    shown = [ln.removeprefix("#").split() for ln in header.splitlines() if ln.startswith("#   sbatch --test-only ")]
    assert shown, "the header documents no `sbatch --test-only ...` small-cluster line"
    fits = subprocess.run(shown[0], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert fits.returncode == 0 and "to start at" in fits.stderr, fits.stderr
    assert [a for a in shown[0] if a.startswith("--")] == ["--test-only", *SMALL_NODE]
    defaults = subprocess.run(["sbatch", "--test-only", "--gpus-per-node=0", "slurm/grpo.sh"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
    assert defaults.returncode != 0 and "Requested node configuration is not available" in defaults.stderr, \
        defaults.stderr


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


ROLLOUTS = 40    # the requeue test's job: long enough (~6 s of rollouts) to be requeued mid-run


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
           str(REPO / "slurm/grpo.sh"), "--train-backend", "fsdp", "--num-rollout", str(ROLLOUTS), "--save", str(ckpt),
           "--save-interval", "1", "--output-dir", str(out_dir), "--eval-interval", "100", "--no-progress"]
    sub = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 300
        # rollouts 0 and 1 are checkpointed (the newest two are kept, so step 1's may be pruned already); a rollout
        # takes ~0.15 s here, so the job is polled often and runs ROLLOUTS of them to stay up until the requeue
        while not any(int(d.name.split("_")[1]) >= 1 for d in ckpt.glob("step_*") if (d / "COMPLETE").exists()):
            state = _job_field(slurm_conf, job_id, "JobState")
            assert state in ("PENDING", "CONFIGURING", "RUNNING") and time.monotonic() < deadline, \
                f"job {job_id} {state}:\n{log.read_text()[-4000:] if log.exists() else ''}"
            time.sleep(0.1)
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
    assert [r["rollout_id"] for r in recs] == list(range(ROLLOUTS))  # each rollout once, in order
    assert (ckpt / f"step_{ROLLOUTS - 1:08d}" / "COMPLETE").exists()


# --- every rank and child dies with its launcher (miles/spmd/lifeline.py) ---------------------------------
HOLD = ["--smoke-engine-argv", "builtin", "--smoke-hold", "300"]  # ranks and engine children stay up
PLAN3 = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"]  # 1 trainer + 2 engine leaders
ORPHAN_BOUND_S = 5.0  # the watch polls every 0.2 s and gives engines 1 s after SIGTERM (as for torchrun and MPI)


def _srun(conf: str, tmp_path: Path, tag: str, argv: list[str]):
    from launcher_kill import launch

    name = f"miles-test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, SLURM_CONF=conf, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    job = launch(["srun", f"--job-name={name}", "--time=3", "--cpus-per-task=1", "--kill-on-bad-exit=1", *argv],
                 env, tag, tmp_path)
    return job, name, env


def _kill_and_time(job, victim: int, keep: set[int]) -> tuple[float, dict]:
    """SIGKILL ``victim`` (maybe not one of the job's tagged processes, e.g. slurmstepd); seconds until every
    tagged process but ``keep`` is gone, failing with the survivors after ORPHAN_BOUND_S."""
    import signal

    from launcher_kill import tagged

    before = tagged(job.tag)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while True:
        left = {pid: p for pid, p in tagged(job.tag).items() if pid not in keep}
        elapsed = time.monotonic() - t0
        if not left:
            return elapsed, before
        if elapsed > ORPHAN_BOUND_S:
            listing = "\n".join(f"  pid {p.pid} ppid {p.ppid} {p.comm}: {p.cmdline}" for p in left.values())
            raise AssertionError(f"{len(left)} process(es) still alive {ORPHAN_BOUND_S:g}s after SIGKILL of pid "
                                 f"{victim}:\n{listing}\n{job.tail()}")
        time.sleep(0.05)


def _cleanup(job, name: str, env: dict[str, str]) -> None:
    from launcher_kill import kill_tagged

    subprocess.run(["scancel", "--name", name], env=env, capture_output=True, timeout=30)
    kill_tagged(job.tag)


@pytest.mark.parametrize("victim", ["srun", "slurmstepd"])
def test_sigkill_of_the_steps_launcher_takes_every_rank_and_engine_down(slurm_conf, tmp_path, victim):
    """`srun -n 3` (one task per rank): SIGKILL of srun, or of the node's slurmstepd (the ranks' parent)."""
    from launcher_kill import children_of, new_tag, tagged, wait_until

    tag = new_tag()
    job, name, env = _srun(slurm_conf, tmp_path, tag, ["--ntasks=3", PYTHON, "-m", "miles.spmd.smoke", *PLAN3,
                                                        "--smoke-dir", str(tmp_path), *HOLD])
    try:
        wait_until(job, lambda: job.stdout.read_text().count("SMOKE OK") == 3, 180, "3 SMOKE OK lines")
        procs = tagged(tag)
        sruns = {p.pid for p in procs.values() if p.comm == "srun"}
        ranks = [p for p in procs.values() if p.comm != "srun" and p.ppid not in procs]  # slurmstepd's children
        engines = [p for r in ranks for p in children_of(procs, r.pid)]
        assert job.proc.pid in sruns and len(ranks) == 3 and len(engines) == 2, procs
        assert {process_name(r.ppid) for r in ranks} == {"slurmstepd"}, ranks
        pid = job.proc.pid if victim == "srun" else ranks[0].ppid
        seconds, _ = _kill_and_time(job, pid, keep=sruns if victim == "slurmstepd" else set())
    finally:
        _cleanup(job, name, env)
    print(f"every rank and engine gone {seconds:.2f}s after SIGKILL of {victim}")


def test_sigkill_of_slurmstepd_under_srun_torchrun_stops_the_agent_and_its_ranks(slurm_conf, tmp_path):
    """slurm/grpo.sh's LAUNCH=torchrun: srun starts a torchrun agent, whose 3 workers are the ranks. SIGKILL of
    slurmstepd (the agent's parent) re-parents the agent, not the ranks: the ranks watch the agent's parent too."""
    from launcher_kill import children_of, new_tag, tagged, wait_until

    tag = new_tag()
    job, name, env = _srun(slurm_conf, tmp_path, tag, [
        "--ntasks=1", PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
        "--max-restarts", "2", "-m", "miles.spmd.smoke", *PLAN3, "--smoke-dir", str(tmp_path), *HOLD])
    try:
        wait_until(job, lambda: job.stdout.read_text().count("SMOKE OK") == 3, 180, "3 SMOKE OK lines")
        procs = tagged(tag)
        sruns = {p.pid for p in procs.values() if p.comm == "srun"}
        agents = [p for p in procs.values() if p.comm != "srun" and p.ppid not in procs]
        assert len(agents) == 1 and process_name(agents[0].ppid) == "slurmstepd", procs
        ranks = [p for p in children_of(procs, agents[0].pid) if "miles.spmd.smoke" in p.cmdline]
        assert len(ranks) == 3, procs
        seconds, _ = _kill_and_time(job, agents[0].ppid, keep=sruns)  # --max-restarts: no worker comes back
    finally:
        _cleanup(job, name, env)
    print(f"the agent, every rank and engine gone {seconds:.2f}s after SIGKILL of slurmstepd")
