"""train.py with Miles's --eval-function-path examples.experimental.eval.eval_delegate_rollout.generate_rollout (the
stand-in of tests/fixtures/miles_scripts/plugins) and an --eval-config with datasets and a delegate section: 1 fsdp
trainer rank + 1 embedded engine on the tiny model, and a local HTTP server standing in for NeMo Skills. The loop
calls the function at the eval step; the server gets the router of the run; metrics.jsonl has the built-in
evaluation's eval/<name> (as Miles logs eval data) and the server's eval/<benchmark>/... metrics."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _miles_e2e import REPO, check_ok, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]

STAND_INS = REPO / "tests" / "fixtures" / "miles_scripts" / "plugins"


PYTHONPATH = os.pathsep.join([str(STAND_INS), str(REPO)])
DELEGATE = "examples.experimental.eval.eval_delegate_rollout.generate_rollout"


def _command(tmp_path: Path, model: Path, url: str, out: Path) -> list[str]:
    def rows(name: str, n: int) -> str:
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n)))
        return str(p)

    doc = {"eval": {"defaults": {"max_response_len": 3},
                    "datasets": [{"name": "small", "path": rows("small", 3), "n_samples_per_eval_prompt": 2,
                                  "temperature": 0.0, "rm_type": "exact_match"}],
                    "delegate": [{"name": "skills", "url": url, "timeout_secs": 30, "max_retries": 1,
                                  "datasets": [{"name": "aime25", "n_samples_per_eval_prompt": 8}]}]}}
    (tmp_path / "multi_tasks.yaml").write_text(json.dumps(doc))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
            "--train-backend", "fsdp", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus",
            "1", "--num-gpus-per-node", "2", "--hf-checkpoint", str(model),
            "--prompt-data", rows("train", 4), "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--global-batch-size", "4", "--lr", "1e-4", "--advantage-estimator",
            "grpo", "--eval-interval", "1", "--skip-eval-before-train", "--eval-config", str(tmp_path / "multi_tasks.yaml"),
            "--eval-function-path", DELEGATE, "--output-dir", str(out), "--no-progress"]


def test_eval_delegate_function_in_a_training_run(tmp_path: Path, tiny_model_dir: Path):
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
            data = json.dumps({"raw_metrics": {"aime25": {"accuracy": 0.375}}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = _command(tmp_path, tiny_model_dir, f"http://127.0.0.1:{server.server_address[1]}/evaluate", out)
    try:
        check_ok(run(cmd, log, timeout=480, PYTHONPATH=PYTHONPATH), log)
    finally:
        server.shutdown()
        server.server_close()
    (body,) = bodies
    assert body["rollout_id"] == 0 and body["benchmarks"] == [{"name": "aime25", "n_samples_per_eval_prompt": 8,
                                                               "max_response_len": 3}]
    router = body["router_url"]
    assert router.startswith("http://") and "None" not in router, router
    evals = [r for r in metrics(out) if "eval/small" in r]
    assert len(evals) == 1, evals
    ev = evals[0]
    assert ev["eval/aime25/accuracy"] == 0.375
    assert 0.0 <= ev["eval/small"] <= 1.0 and ev["eval/small-none_reward_ratio"] == 0.0
    assert "eval/small-truncated_ratio" in ev and 0 < ev["eval/small/response_len/max"] <= 3


def test_eval_function_failure_stops_the_run_in_one_line(tmp_path: Path, tiny_model_dir: Path):
    """The evaluation server is down: the run ends (non-zero, within the bound) with one line naming the flag, the
    function and the server, and no traceback of it."""
    from miles.utils.net import find_free_port

    dead = f"http://127.0.0.1:{find_free_port()}/evaluate"
    out, log = tmp_path / "run", tmp_path / "run.log"
    result = run(_command(tmp_path, tiny_model_dir, dead, out), log, timeout=480, PYTHONPATH=PYTHONPATH)
    text = log.read_text()
    assert result.returncode != 0, text[-3000:]
    line = f"--eval-function-path {DELEGATE} failed: RuntimeError: skills evaluation request to {dead} failed"
    assert line in text, text[-3000:]
    # the only traceback is torchrun's own report of a failed child (ChildFailedError), never a rank's
    blocks = text.split("Traceback (most recent call last):")[1:]
    assert all("torch/distributed/run.py" in b and "/miles/" not in b.split("ChildFailedError")[0] for b in blocks), \
        text[-3000:]
