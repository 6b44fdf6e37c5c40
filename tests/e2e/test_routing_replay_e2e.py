"""Rollout routing replay (R3) end to end on CPU: a tiny Qwen3-MoE, one trainer rank and one embedded engine under
torchrun. The rollout asks the engine for the routed experts of every token (``return_routed_experts``), the
samples carry them to the trainer, and the policy's forwards route to them (a sample without them, or with the
wrong shape, would stop the run with an error). Each backend runs 2 rollouts with a weight sync after each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _miles_e2e import check_ok, check_run_dir, quickstart_copy, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Path]:
    from miles.utils.tiny_model import build_tiny_moe_model

    d = tmp_path_factory.mktemp("r3")
    quickstart_copy(quickstart_prepared, d / "data")      # prepare.sh's, built once a session
    model = build_tiny_moe_model(d / "moe", num_layers=2, num_experts=4, num_experts_per_tok=2)
    return d / "data", model


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_r3_run_replays_the_engines_routing(setup, tmp_path: Path, backend: str) -> None:
    data, model = setup
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py",
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
           "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "2", "--train-backend", backend,
           "--hf-checkpoint", str(model), "--prompt-data", str(data / "train.jsonl"), "--input-key", "input",
           "--label-key", "label", "--rm-type", "quickstart", "--num-rollout", "2", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--rollout-max-response-len", "4",
           "--rollout-temperature", "1.0", "--lr", "1e-3", "--use-rollout-routing-replay", "--use-tis",
           "--check-weight-update-equal", "--output-dir", str(out)]
    check_ok(run(cmd, log, timeout=600), log)
    recs = check_run_dir(out, num_rollout=2, num_ranks=2)
    assert all(r["rollout/num_samples"] == 8 for r in recs)
    text = log.read_text()
    assert "routing replay (R3, --use-rollout-routing-replay): 2 MoE routers" in text, text[-3000:]
    assert text.count("--check-weight-update-equal: ") >= 3
