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


def _held_smoke_job(tmp_path, tag: str):
    """The torchrun agent's 3 smoke ranks (1 trainer, 2 engine leaders), tagged ``tag``, held up once each said SMOKE
    OK: the job and its 2 engine processes (the 3 ranks are the agent's children; each leader's engine its child)."""
    from launcher_kill import children_of, launch, tagged, wait_until

    job = launch(TORCHRUN + ["--standalone", "--nproc-per-node", "3"] + SMOKE + [
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--smoke-dir", str(tmp_path), *HOLD],
        job_env(), tag, tmp_path)
    wait_until(job, lambda: job.stdout.read_text().count("SMOKE OK") == 3, 180, "3 SMOKE OK lines")
    procs = tagged(tag)
    ranks = children_of(procs, job.proc.pid)
    engines = [p for r in ranks for p in children_of(procs, r.pid)]
    assert len(ranks) == 3 and len(engines) == 2, procs  # the agent's 3 ranks; 2 engine leaders' children
    return job, engines


def test_sigkill_of_the_torchrun_agent_takes_every_rank_and_engine_down(tmp_path):
    from launcher_kill import kill_and_time_orphans, kill_tagged, new_tag

    tag = new_tag()
    try:
        job, _ = _held_smoke_job(tmp_path, tag)
        seconds, _ = kill_and_time_orphans(job, job.proc.pid, ORPHAN_BOUND_S)
        job.proc.wait(timeout=10)
    finally:
        kill_tagged(tag)
    err = job.stderr.read_text()
    for r in range(3):
        assert f"[miles r{r}] error: the launcher process that started this rank (torchrun: " in err, err[-3000:]
    print(f"every rank and engine gone {seconds:.2f}s after the agent's SIGKILL")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_the_agent_ending_the_job_takes_stopped_engines_down(tmp_path, sig):
    """The torchrun agent told to end the job (SIGTERM: ``kill``, ``scancel``; SIGINT: Ctrl-C) while both engine
    children are stopped (SIGSTOP): every rank and engine is gone within seconds, and each rank says why in one
    line. Before, the agent's SIGTERM killed the ranks outright and the engines' parent-death SIGTERM stayed pending
    in the stopped processes: they outlived the job (parent PID 1, state T)."""
    from launcher_kill import kill_and_time_orphans, kill_tagged, new_tag

    tag = new_tag()
    try:
        job, engines = _held_smoke_job(tmp_path, tag)
        for e in engines:
            os.kill(e.pid, signal.SIGSTOP)
        # SIGINT: the ranks stop their engines (SIGTERM, SIGKILL after 2 s): a stopped one takes the 2 s
        seconds, _ = kill_and_time_orphans(job, job.proc.pid, ORPHAN_BOUND_S, sig=getattr(signal, sig))
        job.proc.wait(timeout=10)
    finally:
        kill_tagged(tag)
    err = job.stderr.read_text()
    expected = ("stopped by SIGTERM: the launcher is ending the job" if sig == "SIGTERM"
                else "interrupted (SIGINT); the run stopped")
    for r in range(3):
        lines = [ln for ln in err.splitlines() if ln.startswith(f"[miles r{r}] error: ")]
        assert len(lines) == 1 and expected in lines[0], err[-3000:]
    assert "Traceback" not in err.split("torchrun")[0] and "CancelledError" not in err, err[-3000:]
    print(f"{sig}: every rank and stopped engine gone {seconds:.2f}s after the agent's signal")


@pytest.mark.slow
def test_sigkill_of_the_torchrun_agent_stops_a_training_run_and_its_checkpoints(tmp_path, tiny_model_dir):
    """train.py (2 colocated ranks: FSDP2 + an embedded engine each, the router on rank 0) saving after every
    rollout: once a checkpoint is complete the agent is SIGKILLed. Every rank, engine and the router are gone
    within seconds, nothing is written into --save afterwards, and what is there is complete or a .tmp."""
    import json

    from launcher_kill import kill_and_time_orphans, kill_tagged, launch, new_tag, tagged, wait_until

    from miles.trainer.checkpoint import COMPLETE, latest_checkpoint

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    tag = new_tag()
    job = launch(TORCHRUN + ["--standalone", "--nproc-per-node", "2", "train.py", "--train-backend", "fsdp", "--colocate",
                             "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2",
                             "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "input",
                             "--label-key", "label", "--rm-type", "math", "--num-rollout", "1000",
                             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len",
                             "2", "--save", str(ckpt), "--save-interval", "1", "--output-dir", str(out),
                             "--no-progress"],
                 job_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline"), tag, tmp_path)
    try:
        wait_until(job, lambda: (ckpt / "step_00000000" / COMPLETE).exists() or job.proc.poll() is not None, 420,
                   "the first complete checkpoint")
        assert job.proc.poll() is None, f"train.py ended (exit {job.proc.returncode}) before the kill:\n{job.tail()}"
        procs = tagged(tag)
        ranks = [p for p in procs.values() if p.ppid == job.proc.pid]
        engines = [p for p in procs.values() if " -m miles.engine " in p.cmdline]
        assert len(ranks) == 2 and len(engines) == 2, procs
        # torch's torch_shm_manager helper leaves by itself a few seconds after its clients are gone
        seconds, _ = kill_and_time_orphans(job, job.proc.pid, 8.0)
        job.proc.wait(timeout=10)
    finally:
        kill_tagged(tag)
    ours = {k: t for k, t in job.gone_after.items() if not k.startswith("torch_shm_manag")}
    assert max(ours.values()) < ORPHAN_BOUND_S, job.gone_after  # ranks, engines (and a router) themselves
    listing = sorted(p.name for p in ckpt.iterdir())
    time.sleep(2.0)
    assert sorted(p.name for p in ckpt.iterdir()) == listing  # no orphan writes into --save
    steps = [n for n in listing if n.startswith("step_")]
    assert steps and all((ckpt / n / COMPLETE).is_file() for n in steps), listing
    assert all(n.startswith(".tmp.step_") for n in listing if not n.startswith("step_")), listing
    assert latest_checkpoint(ckpt) == ckpt / steps[-1]
    err = job.stderr.read_text()
    for r in range(2):
        assert f"[miles r{r}] error: the launcher process that started this rank (torchrun: " in err, err[-3000:]
    print(f"all gone {seconds:.2f}s after the agent's SIGKILL (last seen: {job.gone_after}); "
          f"--save holds {listing}")
