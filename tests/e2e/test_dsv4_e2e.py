"""DeepSeek-V4 end to end on CPU: the flags of Miles's recorded DeepSeek-V4 command (radixark/miles@v0.1.0:
tests/snapshots/launch_scripts/py/scripts/run_deepseek_v4.py/train.txt) that miles takes today, its 8-GPU world
scaled to 2 CPU ranks (TP 2 with sequence parallelism and EP 2, as its TP 8 / EP 8; colocated), on the tiny V4
(``miles.utils.tiny_dsv4``), the embedded engines serving it on the generic transformers path: 2 rollouts, a weight
sync after each under ``--check-weight-update-equal`` (the engines hold exactly the trainer's weights: transformers'
names, fused experts, the hash routers' int64 tables).

Left out of the recorded command (refused by name today, so it cannot pass ``--dry-run`` as recorded): its model-shape
flags in Miles's fork spelling (``--multi-latent-attention`` with ``--kv-lora-rank 512`` as V4's head dim, the YaRN
flags, ``--experimental-attention-variant dsv4``, ``--dsv4-*``, ``--dsa-indexer-*``, ``--activation-func-clamp-value``,
``--no-activation-func-clamp-shared-expert``), ``--moe-router-freeze-gate``, ``--freeze-e-score-correction-bias``,
``--model-name``, the fp8 / transformer-engine flags and ``--use-rollout-routing-replay`` (the engine does not record
V4's hash / sqrtsoftplus routing).

``test_engine_serves_dsv4``: the embedded engine's greedy tokens (a prompt of 11 and 14 new tokens: past the sliding
window, several CSA windows and an HCA window, through V4's own cache layers) equal transformers' full forward's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, check_ok, check_run_dir, run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

RECORDED = [  # the recorded command's flags miles takes, GPU counts scaled to 2 CPU ranks
    "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
    "--swiglu", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--attention-softmax-in-fp32", "--no-rope-fusion", "--moe-router-topk", "2", "--moe-router-pre-softmax",
    "--moe-router-score-function", "sqrtsoftplus", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0", "--moe-router-topk-scaling-factor", "1.5", "--apply-chat-template",
    "--rollout-shuffle", "--rollout-temperature", "0.8", "--num-steps-per-rollout", "1", "--balance-data",
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
    "--overlap-cpu-optimizer-d2h-h2d", "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--micro-batch-size", "1", "--rollout-num-gpus-per-engine", "1", "--accumulate-allreduce-grads-in-fp32",
    "--qkv-format", "bshd", "--colocate", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
    "--num-gpus-per-node", "2", "--spec", "miles_plugins.models.deepseek_v4.deepseek_v4", "get_dsv4_spec"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    d = tmp_path_factory.mktemp("dsv4")
    log = d / "prepare.log"
    check_ok(run(["bash", str(QUICKSTART / "prepare.sh"), str(d / "data")], log, timeout=300), log)
    return d / "data", build_tiny_dsv4_model(d / "dsv4")


def test_engine_serves_dsv4(setup) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from miles.engine.testing import EngineProc

    _, model = setup
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    eng = EngineProc(model, "--max-running-requests", "2", timeout=180)
    try:
        got = eng.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 14, "temperature": 0}})
    finally:
        eng.stop()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(14):
            seq = torch.cat([seq, hf(seq, use_cache=False).logits[0, -1].argmax().view(1, 1)], 1)
    assert got["output_ids"] == seq[0, len(prompt):].tolist()


def test_dsv4_recorded_flags_run_two_rollouts(setup, tmp_path: Path) -> None:
    data, model = setup
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", *RECORDED,
           "--hf-checkpoint", str(model), "--prompt-data", str(data / "train.jsonl"), "--input-key", "input",
           "--label-key", "label", "--rm-type", "quickstart", "--num-rollout", "2", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--rollout-max-response-len", "4",
           "--check-weight-update-equal", "--output-dir", str(out)]
    dry = run([*cmd, "--dry-run"], tmp_path / "dry.log", timeout=300)
    check_ok(dry, tmp_path / "dry.log")
    check_ok(run(cmd, log, timeout=600), log)
    recs = check_run_dir(out, num_rollout=2, num_ranks=2)
    assert all(r["rollout/num_samples"] == 8 for r in recs)
    text = log.read_text()
    assert "TP 2 x PP 1 x DP 1" in text, text[-3000:]
    assert text.count("--check-weight-update-equal: ") >= 3, text[-3000:]   # initial sync + one per rollout
