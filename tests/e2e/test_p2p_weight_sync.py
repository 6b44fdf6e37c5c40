"""``--update-weight-transfer-mode p2p`` under real torchrun on both trainer backends: 2 trainer ranks (Megatron
with 2 data-parallel ranks, Megatron with one TP=2 group, FSDP2 with 2 ranks) + 1 embedded engine, with
``--check-weight-update-equal`` after every sync. The engine holds the trainer's weights under HF names, bit for
bit: every tensor the trainer exports is asked from the engine (``/get_weights_by_name``) and compared after the
initial sync and after each rollout's training, so a wrong name (issue 21: Megatron's own parameter names sent
as local shards), a wrong shard or a stale tensor fails the run. The Megatron backend has no local-shard
iterator: each trainer rank sends its dim-0 share of the full tensors it holds after the TP gather.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, check_ok, check_run_dir, run, tail

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

NUM_ROLLOUT = 2
CASES = {
    "megatron_dp2": (["--train-backend", "megatron"], "TP 1 x PP 1 x DP 2"),
    "megatron_tp2": (["--train-backend", "megatron", "--tensor-model-parallel-size", "2"], "TP 2 x PP 1 x DP 1"),
    "fsdp_dp2": (["--train-backend", "fsdp"], "FSDP trainer ready"),
}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    sys.path.insert(0, str(QUICKSTART))
    import build as quickstart_build

    d = tmp_path_factory.mktemp("p2p_quickstart")
    quickstart_build.build(d, train_copies=1)
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_p2p_engine_holds_the_trainers_weights(quickstart: Path, tmp_path: Path, case: str) -> None:
    if case.startswith("megatron"):
        pytest.importorskip("megatron.core")
    from miles.trainer.weights import checkpoint_tensor_names

    flags, ready = CASES[case]
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "3", "train.py", *flags,
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
           "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "3",
           "--hf-checkpoint", str(quickstart / "model"), "--prompt-data", str(quickstart / "train.jsonl"),
           "--input-key", "input", "--label-key", "label", "--rm-type", "quickstart",
           "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "3", "--lr", "1e-2", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
           "4096", "--entropy-coef", "0.01", "--update-weight-transfer-mode", "p2p", "--check-weight-update-equal",
           "--output-dir", str(out), "--no-progress"]
    check_ok(run(cmd, log, timeout=600), log)
    text = log.read_text()
    assert ready in text, tail(log)
    syncs = re.findall(r"weight sync v(\d+) \(p2p\) to 1 engine\(s\)", text)
    assert len(syncs) >= NUM_ROLLOUT, tail(log)              # one sync per rollout (+ the initial one)
    checks = [(int(n), int(v)) for n, v in
              re.findall(r"--check-weight-update-equal: (\d+) tensors equal on 1 engine\(s\) \(v(\d+)\)", text)]
    assert len(checks) >= NUM_ROLLOUT + 1, tail(log)         # after the initial sync and after every rollout
    num_tensors = len(checkpoint_tensor_names(quickstart / "model"))
    assert {n for n, _ in checks} == {num_tensors}, (checks, num_tensors)   # every tensor of the model, HF names
    assert max(v for _, v in checks) >= NUM_ROLLOUT                        # trained weights, not only the initial
    recs = check_run_dir(out, num_rollout=NUM_ROLLOUT, num_ranks=3)
    assert all(r["train/grad_norm"] > 0 for r in recs), recs    # --entropy-coef: the weights move every rollout
