"""CPU threads follow the phase (miles.spmd.threads) in a real 2-rank run: torchrun, 1 FSDP trainer rank + 1
embedded engine on one node. With no OMP_NUM_THREADS from the user (torchrun then sets 1 for its workers) the
trainer rank trains with every usable core and the engine generates with every usable core, or with one when its
start-up timing finds one faster (``--pick-cpu-threads``, checked against the timings it logs); under
train_async.py, where both compute at once, each gets half; the user's OMP_NUM_THREADS=1 keeps one thread in both. The trainer's count is read inside its loss (a custom loss that
reports ``torch.get_num_threads()`` as ``train/cpu_threads``), the engine's on its scheduler thread (its log)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from _miles_e2e import REPO, env, metrics, tail

from miles.spmd.threads import usable_cpus

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]
HERE = Path(__file__).resolve().parent


def _run(tmp_path: Path, model: Path, omp: str | None, script: str = "train.py") -> tuple[list[dict], str, str]:
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(16)))
    out, log = tmp_path / "run", tmp_path / "run.log"
    e = env(MILES_ENGINE_LOG_LEVEL="INFO", PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]))
    e.pop("OMP_NUM_THREADS")
    if omp is not None:
        e["OMP_NUM_THREADS"] = omp
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", script, "--train-backend", "fsdp",
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node",
           "2", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key",
           "label", "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "4", "--global-batch-size", "4", "--advantage-estimator", "grpo",
           "--num-rollout", "2", "--loss-type", "custom_loss", "--custom-loss-function-path", "thread_plugins.threads_loss",
           "--output-dir", str(out), "--no-progress"]
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=e, stdout=f, stderr=subprocess.STDOUT, timeout=500).returncode
    assert rc == 0, tail(log)
    return metrics(out), (out / "engine0.log").read_text(), log.read_text()


def _engine_threads(engine_log: str) -> list[int]:
    return [int(n) for n in re.findall(r"scheduler thread: (\d+) CPU thread", engine_log)]


def _picked(engine_log: str, share: int) -> int:
    """The count the engine keeps of its ``share`` (``--pick-cpu-threads``): the share itself when it is one thread,
    else the faster side of the timings it logged (``share`` threads against one)."""
    found = re.findall(r"CPU forwards on (\d+) thread\(s\): a \d+-row one-token forward took ([\d.]+) ms on (\d+), "
                       r"([\d.]+) ms on 1", engine_log)
    if share == 1:
        assert not found, engine_log[-2000:]
        return 1
    assert len(found) == 1, engine_log[-2000:]
    kept, t_share, n, t_one = found[0]
    assert int(n) == share and int(kept) == (1 if float(t_one) < float(t_share) else share), found
    return int(kept)


def test_each_phase_gets_every_core_without_omp_num_threads(tmp_path: Path, tiny_model_dir: Path):
    cores = len(usable_cpus())
    if cores < 2:
        pytest.skip("one usable CPU: one thread is every core, so the plan cannot be told from torchrun's default")
    recs, engine_log, text = _run(tmp_path, tiny_model_dir, None)
    assert [r["train/cpu_threads"] for r in recs] == [float(cores)] * 2, text[-3000:]
    assert _engine_threads(engine_log) == [_picked(engine_log, cores)], engine_log[-2000:]
    assert f"CPU threads: {cores} per trainer rank while it trains, {cores} per engine process while it generates" in text


def test_the_users_omp_num_threads_fixes_every_process(tmp_path: Path, tiny_model_dir: Path):
    recs, engine_log, text = _run(tmp_path, tiny_model_dir, "1")
    assert [r["train/cpu_threads"] for r in recs] == [1.0, 1.0], text[-3000:]
    assert _engine_threads(engine_log) == [1], engine_log[-2000:]
    assert "CPU threads: 1 in every process (OMP_NUM_THREADS)" in text


def test_train_async_splits_the_cores_between_trainer_and_engine(tmp_path: Path, tiny_model_dir: Path):
    half = max(1, len(usable_cpus()) // 2)
    recs, engine_log, text = _run(tmp_path, tiny_model_dir, None, script="train_async.py")
    assert [r["train/cpu_threads"] for r in recs] == [float(half)] * 2, text[-3000:]
    assert _engine_threads(engine_log) == [_picked(engine_log, half)], engine_log[-2000:]
    assert f"CPU threads: {half} per trainer rank while it trains, {half} per engine process while it generates" in text
