"""train.py with Miles's --eval-config (two datasets with different n / temperature / max_response_len / rm_type)
and a sglang-router --router-* flag: 1 fsdp trainer rank + 1 embedded engine on the tiny model. The router miles
starts takes the flag, and evaluation logs eval/<name> with each dataset's own sample count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _miles_e2e import check_ok, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_eval_config_two_datasets_and_a_router_flag(tmp_path: Path, tiny_model_dir: Path):
    def rows(name: str, n: int) -> str:
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n)))
        return str(p)

    doc = {"eval": {"defaults": {"top_p": 0.9, "max_response_len": 3},
                    "datasets": [{"name": "small", "path": rows("small", 3), "n_samples_per_eval_prompt": 2,
                                  "temperature": 0.0, "rm_type": "exact_match"},
                                 {"name": "big", "path": rows("big", 5), "n_samples_per_eval_prompt": 3,
                                  "temperature": 1.0, "max_response_len": 5, "rm_type": "math"}]}}
    (tmp_path / "eval.yaml").write_text(json.dumps(doc))
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           "--train-backend", "fsdp", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
           "--num-gpus-per-node", "2", "--hf-checkpoint", str(tiny_model_dir),
           "--prompt-data", rows("train", 4), "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
           "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "4", "--global-batch-size", "4", "--lr", "1e-4", "--advantage-estimator", "grpo",
           "--eval-interval", "1", "--skip-eval-before-train", "--eval-config", str(tmp_path / "eval.yaml"),
           "--router-health-success-threshold", "1", "--router-queue-size", "33",
           "--output-dir", str(out), "--no-progress"]
    check_ok(run(cmd, log, timeout=480), log)
    recs = metrics(out)
    evals = [r for r in recs if "eval/small" in r]
    assert len(evals) == 1, recs
    ev = evals[0]
    assert ev["eval/small/num_samples"] == 3 * 2 and ev["eval/big/num_samples"] == 5 * 3, ev
    assert ev["eval/small/response_len_max"] <= 3 and ev["eval/big/response_len_max"] <= 5, ev
    driver = (out / "logs" / "rank0.log").read_text()
    assert "--health-success-threshold 1" in driver and "--queue-size 33" in driver, driver[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["rollout"]["router_args"] == {"health_success_threshold": 1, "queue_size": 33}
    assert config["eval"]["eval_config"] == str(tmp_path / "eval.yaml")
