"""The smoke test under real torchrun: one node of 4 ranks, and two nodes simulated by two agents."""

from __future__ import annotations

import os
import signal
import time

import pytest
from spmd_helpers import PYTHON, REPO, SMOKE, assert_smoke, finish, job_env, roles, run, start

from miles.utils.net import find_free_port

pytestmark = pytest.mark.multiprocess
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]


def test_torchrun_disaggregated_engine_killed_and_restarted(tmp_path):
    job = run(TORCHRUN + ["--standalone", "--nproc-per-node", "4"] + SMOKE + [
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
        "--smoke-engine-argv", "builtin", "--smoke-kill-engine", "--smoke-dir", str(tmp_path)])
    lines = assert_smoke(job, 4, "torchrun")
    assert roles(lines) == {0: {"driver", "trainer"}, 1: {"trainer"}, 2: {"engine_leader"}, 3: {"engine_leader"}}
    assert [lines[r]["engine"] for r in range(4)] == ["-", "-", "0", "1"]
    # each leader's child was SIGKILLed, came back under a new pid, and the rank carried on
    for r in (2, 3):
        assert lines[r]["engine_restarts"] == "1"
    assert "exited with code -9; restarting" in job.stderr
    assert "role plan: disaggregated, 4 rank(s)" in job.stderr


def test_torchrun_colocated_through_the_single_node_template():
    job = run(["bash", str(REPO / "launch/torchrun_single_node.sh"), "--colocate", "--actor-num-gpus-per-node", "4",
               "--rollout-num-gpus-per-engine", "2"], env=job_env(NPROC="4", ENTRY=" ".join(SMOKE), PYTHON=PYTHON))
    lines = assert_smoke(job, 4, "torchrun")
    assert roles(lines) == {0: {"driver", "trainer", "engine_leader"}, 1: {"trainer", "engine_worker"},
                            2: {"trainer", "engine_leader"}, 3: {"trainer", "engine_worker"}}
    assert [lines[r]["engine"] for r in range(4)] == ["0", "0", "1", "1"]
    assert "(4 GPU slots per node)" in job.stderr  # the template passes --num-gpus-per-node NPROC


def _two_agents(flags: list[str], timeout: float = 240):
    """Two torchrun agents on this machine, as two nodes of 2 ranks (launch/torchrun_multi_node.sh)."""
    port = find_free_port()
    env = job_env(NNODES="2", NPROC="2", RDZV_HOST="127.0.0.1", RDZV_PORT=str(port), RUN_ID=f"miles-{port}",
                  ENTRY=" ".join(SMOKE), PYTHON=PYTHON)
    t0 = time.monotonic()
    procs = [start(["bash", str(REPO / "launch/torchrun_multi_node.sh"), *flags], env=env) for _ in range(2)]
    jobs = []
    try:
        for p in procs:
            jobs.append(finish(p, timeout, t0))
    finally:
        for p in procs:
            if p.poll() is None:  # the other agent timed out: end this one's session too
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)
    merged = jobs[0]
    merged.stdout, merged.stderr = jobs[0].stdout + jobs[1].stdout, jobs[0].stderr + jobs[1].stderr
    merged.returncode = max(j.returncode for j in jobs)
    return merged


@pytest.mark.slow
def test_two_nodes_engine_spanning_both_nodes_has_a_leader_per_node(tmp_path):
    job = _two_agents(["--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2",
                       "--rollout-num-gpus-per-engine", "4", "--smoke-engine-argv", "builtin",
                       "--smoke-dir", str(tmp_path)])
    lines = assert_smoke(job, 4, "torchrun")
    assert roles(lines) == {0: {"driver", "trainer", "engine_leader"}, 1: {"trainer", "engine_worker"},
                            2: {"trainer", "engine_leader"}, 3: {"trainer", "engine_worker"}}
    assert {lines[r]["engine"] for r in range(4)} == {"0"}
    assert [lines[r]["node"] for r in range(4)] == ["0", "0", "1", "1"]
    assert [lines[r]["local_rank"] for r in range(4)] == ["0", "1", "0", "1"]
    # both node leaders (ranks 0 and 2, one per node) supervise a child; the workers do not
    assert "engine_pid" in lines[0] and "engine_pid" in lines[2]
    assert "engine_pid" not in lines[1] and "engine_pid" not in lines[3]
    assert "node leaders [0, 2]" in job.stderr


def test_torchrun_world_size_mismatch_fails_fast_on_every_rank():
    job = run(TORCHRUN + ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "1"] + SMOKE + [
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"], timeout=120)
    assert job.returncode != 0
    for r in range(2):
        line = next(ln for ln in job.stderr.splitlines() if ln.startswith(f"[miles r{r}] error:"))
        assert "world size mismatch: the plan needs 4 rank(s)" in line and "launcher started 2" in line
        assert "--nproc-per-node" in line
    assert "SMOKE OK" not in job.stdout
    # the message reaches torchrun's own failure report through the elastic error file
    assert "traceback : [miles r0] error: world size mismatch" in job.stderr
    assert job.seconds < 60, f"took {job.seconds:.0f}s"


HOLD = ["--smoke-engine-argv", "builtin", "--smoke-hold", "300"]  # ranks and engine children stay up
ORPHAN_BOUND_S = 5.0  # the watch polls every 0.2 s and gives engines 1 s after SIGTERM (miles/spmd/lifeline.py)


def test_sigkill_of_the_torchrun_agent_takes_every_rank_and_engine_down(tmp_path):
    from launcher_kill import children_of, kill_and_time_orphans, kill_tagged, launch, new_tag, tagged, wait_until

    tag = new_tag()
    job = launch(TORCHRUN + ["--standalone", "--nproc-per-node", "3"] + SMOKE + [
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--smoke-dir", str(tmp_path), *HOLD],
        job_env(), tag, tmp_path)
    try:
        wait_until(job, lambda: job.stdout.read_text().count("SMOKE OK") == 3, 180, "3 SMOKE OK lines")
        procs = tagged(tag)
        ranks = children_of(procs, job.proc.pid)
        engines = [p for r in ranks for p in children_of(procs, r.pid)]
        assert len(ranks) == 3 and len(engines) == 2, procs  # the agent's 3 ranks; 2 engine leaders' children
        seconds, _ = kill_and_time_orphans(job, job.proc.pid, ORPHAN_BOUND_S)
        job.proc.wait(timeout=10)
    finally:
        kill_tagged(tag)
    err = job.stderr.read_text()
    for r in range(3):
        assert f"[miles r{r}] error: the launcher process that started this rank (torchrun: " in err, err[-3000:]
    print(f"every rank and engine gone {seconds:.2f}s after the agent's SIGKILL")
