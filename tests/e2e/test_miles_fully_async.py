"""``train_async.py --fully-async`` (Miles's FullyAsyncRolloutFn): 1 trainer rank + 1 embedded engine, the
producer generating across rollouts and weight updates (``--pause-generation-mode retract``), three
rollouts trained, weights synced after each, and the resumable data position saved with the checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _miles_e2e import check_ok, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_fully_async_run(tmp_path: Path, tiny_model_dir: Path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(16)))
    out, log, ckpt = tmp_path / "run", tmp_path / "run.log", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train_async.py",
           "--train-backend", "fsdp", "--fully-async", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
           "--num-gpus-per-node", "2", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data),
           "--input-key", "input", "--label-key", "label", "--rm-type", "random", "--num-rollout", "3",
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
           "--global-batch-size", "4", "--lr", "1e-4", "--save", str(ckpt), "--output-dir", str(out), "--no-progress",
           "--dump-details", str(tmp_path / "details")]
    check_ok(run(cmd, log, timeout=420), log)
    recs = metrics(out)
    assert [r["rollout_id"] for r in recs] == [0, 1, 2], recs
    assert all(r["rollout/num_samples"] == 4 and "rollout/groups_in_flight" in r for r in recs), recs
    assert all(r["perf/update_weights_time"] > 0 for r in recs), recs  # a sync after every rollout
    assert all(r["rollout/weight_staleness_max"] >= 0 for r in recs[1:]), recs
    text = log.read_text()
    assert "fully async rollout: producer started" in text
    state = json.loads((ckpt / "step_00000002" / "trainer_state.json").read_text())["extra"]["data_source"]
    assert 3 * 2 + len(state["buffer"]) <= state["offset"] + 16 * state["epoch"]  # unfinished prompts given back
    assert len(state["buffer"]) >= 1
    dumped = [json.loads(line) for line in (tmp_path / "details" / "rollout_data" / "2.jsonl").read_text().splitlines()]
    assert len(dumped) == 4  # --dump-details writes every rollout's samples, fully async too
