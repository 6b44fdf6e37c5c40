"""The quickstart end to end on CPU: the SFT warm start, then GRPO under torchrun (disaggregated: 2 trainer
ranks of the default backend, megatron, + 2 embedded engines; colocated: 2 ranks, with --train-backend fsdp,
the README's other choice; colocated Megatron is tests/e2e/test_megatron_quickstart.py's), under mpirun, and
with train_async.py. Each
short run checks that it completes and what it leaves (metrics.jsonl keys, config, per-rank logs, plot).
``test_learning`` asserts the full quickstart's learning criterion: mean reward over the last
3 rollouts at least 0.3 above the first 3, and at least 0.8, within 10 minutes of wall time; the disaggregated
wiring test checks the same run (``grpo_run``, once per module).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, REPO, check_ok, check_run_dir, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def quickstart(quickstart_sft: Path) -> Path:
    """prepare.sh + run_sft.sh: the data, the tiny model and its SFT warm start (our SFT path, 2 ranks; built once
    per session, tests/conftest.py's ``quickstart_sft``, which checks its run dir)."""
    return quickstart_sft


@pytest.fixture(scope="module")
def grpo_run(quickstart: Path, tmp_path_factory) -> tuple[Path, Path, float]:
    """The quickstart's GRPO phase as README runs it (``run_grpo.sh``: disaggregated, 40 rollouts), once: its run
    dir, its log and its wall time. ``test_torchrun_disaggregated`` checks its wiring, ``test_learning`` that it
    learns (one run, where each ran its own: the wiring run was the first 3 rollouts of this command)."""
    d = tmp_path_factory.mktemp("grpo")
    out, log = d / "run", d / "run.log"
    t0 = time.monotonic()
    check_ok(run(["bash", str(QUICKSTART / "run_grpo.sh"), "--output-dir", str(out)], log, timeout=600,
                 QUICKSTART_DIR=str(quickstart)), log)
    return out, log, time.monotonic() - t0


def test_torchrun_disaggregated(grpo_run: tuple[Path, Path, float]):
    out, log, _ = grpo_run
    recs = check_run_dir(out, num_rollout=40, num_ranks=4)
    assert all(r["rollout/num_samples"] == 128 for r in recs)
    assert all(r["perf/update_weights_time"] > 0 for r in recs)
    assert (out / "engine0.log").is_file() and (out / "engine1.log").is_file() and (out / "router.log").is_file()
    assert "eval/quickstart" in recs[-1]  # evaluation after the last rollout
    text = log.read_text()
    assert "rollout 39/40 | reward" in text and "weight sync v4 (broadcast)" in text
    assert "Megatron trainer ready" in text  # no backend named: Miles's default
    # an engine joins the router once healthy and current: after the initial weight sync, never before it
    driver = (out / "logs" / "rank0.log").read_text()
    assert driver.count(": added engine http") == 2, driver[-3000:]
    assert driver.index("weight sync v1 (broadcast)") < driver.index(": added engine http")


def test_torchrun_colocated(quickstart: Path, tmp_path: Path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    check_ok(run(["bash", str(QUICKSTART / "run_grpo_colocated.sh"), "--train-backend", "fsdp", "--num-rollout", "2",
                  "--output-dir", str(out)], log, timeout=600, QUICKSTART_DIR=str(quickstart)), log)
    check_run_dir(out, num_rollout=2, num_ranks=2)
    text = log.read_text()
    assert "(tensor) to 2 engine(s)" in text and "FSDP trainer ready" in text


@pytest.mark.mpi
def test_mpirun(quickstart: Path, tmp_path: Path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed")
    out, log = tmp_path / "run", tmp_path / "run.log"
    check_ok(run(["bash", str(QUICKSTART / "run_grpo_mpirun.sh"), "--num-rollout", "2", "--output-dir", str(out)],
                 log, timeout=600, QUICKSTART_DIR=str(quickstart)), log)
    check_run_dir(out, num_rollout=2, num_ranks=4)
    assert "launcher openmpi" in log.read_text()


def test_train_async(quickstart: Path, tmp_path: Path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    flags = (QUICKSTART / "flags.sh")
    cmd = ["bash", "-c", f'torchrun --standalone --nproc-per-node 4 train_async.py --actor-num-nodes 1 '
           f'--actor-num-gpus-per-node 2 --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 --num-gpus-per-node 4 '
           f'$(bash {flags} {quickstart}) --num-rollout 3 --use-tis --max-weight-staleness 1 --output-dir {out}']
    check_ok(run(cmd, log, timeout=600), log)
    recs = check_run_dir(out, num_rollout=3, num_ranks=4)
    # rollout k+1 was generated while k trained, with the weights from before k's update
    assert [r["rollout/weight_staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert all(r["rollout/stale_dropped_groups"] == 0 for r in recs)
    assert all("perf/wait_rollout_time" in r for r in recs)
    # the sync detached (one request to each embedded engine), and each next generation landed it first
    assert [r["weight_sync/detached"] for r in recs] == [1.0, 1.0, 1.0]
    assert all("perf/wait_weights_time" in r for r in recs[1:])
    # every sync's transfer and load are reported measured, never as zeros at return: rollout 2's record carries the
    # sync after rollout 0 (its generation landed it), after rollout 1 (the last sync landed it) and after rollout 2
    # (its eval landed it, or the end of the run did, before the record was written)
    r2 = recs[2]
    assert r2["weight_sync/landed_rollout_id"] == 0.0 and r2["weight_sync/landed_load_s"] > 0, r2
    assert r2["weight_sync/sync_landed_rollout_id"] == 1.0 and r2["weight_sync/sync_landed_load_s"] > 0, r2
    last = "eval_" if "weight_sync/eval_landed_rollout_id" in r2 else "final_"
    assert r2[f"weight_sync/{last}landed_rollout_id"] == 2.0 and r2[f"weight_sync/{last}landed_load_s"] > 0, r2
    assert not any("weight_sync/transfer_s" in r for r in recs)


def test_train_async_refuses_colocate(tmp_path: Path):
    log = tmp_path / "run.log"
    result = run(["python", str(REPO / "train_async.py"), "--colocate", "--num-rollout", "1", "--rollout-batch-size", "1"],
                 log, timeout=120)
    assert result.returncode != 0
    assert "does not support --colocate" in log.read_text()


def test_learning(grpo_run: tuple[Path, Path, float]):
    """The quickstart's GRPO phase learns: last-3 mean >= first-3 mean + 0.3 and >= 0.8, in < 10 minutes."""
    out, _, wall = grpo_run
    print(f"quickstart GRPO phase: {wall:.1f} s")
    recs = check_run_dir(out, num_rollout=40, num_ranks=4)
    rewards = [r["rollout/raw_reward"] for r in recs]
    first3, last3 = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last3 >= first3 + 0.3 and last3 >= 0.8, f"first3 {first3:.3f} last3 {last3:.3f}: {rewards}"
    assert wall < 600, f"GRPO phase took {wall:.0f}s"
    assert recs[-1]["eval/quickstart"] >= 0.8
