"""Kimi-K2 end to end on CPU: Miles's recorded Kimi-K2 command (radixark/miles@v0.1.0:tests/snapshots/launch_scripts/
py/scripts/run_kimi_k2.py/execute.txt) with its model-shape flags at the tiny Kimi-K2's sizes (``miles.utils.tiny_mla``,
config.json model_type kimi_k2, its YaRN rope and routed scaling) and its 256-GPU world at 2 CPU trainer ranks (TP 2
with sequence parallelism and EP 2, as its TP 8 / EP 32; PP 8 and CP 4 at 1 here: the recorded command's PP with TP
and EP at tiny scale runs in tests/e2e/test_mla_parallel_replay.py, MLA under CP in tests/multiprocess/
test_megatron_mla.py), the embedded engines serving it on the generic transformers path: 2 rollouts with a weight sync
after each under ``--check-weight-update-equal`` (every tensor the trainer exports equals the engine's, HF names), in
each weight-sync mode: ``tensor`` (colocated, as recorded), ``broadcast``, ``p2p`` and ``disk-delta`` (one engine rank
of its own).

What is changed besides sizes, and why: the data and reward are the quickstart's (a random tiny policy never solves a
dapo-math prompt, so the recorded ``check_reward_nonzero_std`` filter would keep no group: it and
``--over-sampling-batch-size`` are left out); ``--moe-grouped-gemm``, ``--moe-permute-fusion``,
``--moe-enable-deepep`` and ``--moe-token-dispatcher-type flex`` need transformer-engine / DeepEP, absent on CPU
(refused there by name: ``test_spec_and_kernels.py``), so the dispatcher is the recorded first value, alltoall;
``--ref-load`` (a torch_dist copy of the HF weights) is the HF checkpoint itself; the wandb, eval and ``--sglang-*``
flags are left out (no wandb, no eval within 2 rollouts, embedded engines).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _miles_e2e import check_ok, check_run_dir, quickstart_copy, run
from miles_fixtures import replay_params

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1200)]

RECORDED = [  # the recorded command's training flags, GPU counts scaled to 2 trainer ranks
    "--attention-softmax-in-fp32", "--no-rope-fusion", "--moe-router-pre-softmax", "--moe-router-score-function",
    "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0",
    "--moe-router-dtype", "fp32", "--apply-chat-template", "--rollout-shuffle", "--rollout-temperature", "1",
    "--num-steps-per-rollout", "4", "--balance-data", "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style",
    "constant", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer", "--advantage-estimator", "grpo",
    "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00",
    "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1", "--expert-model-parallel-size", "2",
    "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    "--rollout-num-gpus-per-engine", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--accumulate-allreduce-grads-in-fp32", "--attention-backend", "flash", "--update-weight-buffer-size",
    "2147483648", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2"]
# weight-sync mode -> its flags and ranks (2 trainer ranks; colocated engines on them, or one engine rank of its own)
MODES = {
    "tensor": (["--colocate", "--num-gpus-per-node", "2"], 2),
    "broadcast": (["--rollout-num-gpus", "1", "--num-gpus-per-node", "3"], 3),
    "p2p": (["--rollout-num-gpus", "1", "--num-gpus-per-node", "3", "--update-weight-transfer-mode", "p2p"], 3),
    "disk-delta": (["--rollout-num-gpus", "1", "--num-gpus-per-node", "3", "--update-weight-transfer-mode",
                    "disk-delta"], 3),
}


def kimi_shape_flags(model: Path) -> list[str]:
    """The recorded command's model-shape flags (Miles's scripts/models/kimi-k2.py) at the tiny model's values, read
    back from its config.json as the Megatron backend reads it."""
    from miles.trainer.megatron.model import ModelShape
    from miles.utils.model_dir import load_config

    s = ModelShape.from_hf_config(load_config(model))
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = s.yarn
    values = {"--num-layers": s.num_layers, "--hidden-size": s.hidden_size, "--ffn-hidden-size": s.ffn_hidden_size,
              "--num-attention-heads": s.num_attention_heads, "--kv-channels": s.kv_channels,
              "--norm-epsilon": s.norm_epsilon, "--vocab-size": s.vocab_size, "--q-lora-rank": s.q_lora_rank,
              "--kv-lora-rank": s.kv_lora_rank, "--qk-head-dim": s.qk_head_dim,
              "--qk-pos-emb-head-dim": s.qk_pos_emb_head_dim, "--v-head-dim": s.v_head_dim,
              "--rotary-scaling-factor": factor, "--rotary-base": s.rotary_base,
              "--original-max-position-embeddings": int(original), "--beta-fast": beta_fast,
              "--beta-slow": beta_slow, "--mscale": mscale, "--mscale-all-dim": mscale_all_dim,
              "--num-experts": s.num_experts, "--moe-ffn-hidden-size": s.moe_ffn_hidden_size,
              "--moe-router-topk": s.moe_router_topk, "--moe-shared-expert-intermediate-size":
              s.moe_shared_ffn_hidden_size, "--moe-router-group-topk": 1, "--moe-router-num-groups": 1,
              "--moe-router-topk-scaling-factor": s.moe_topk_scaling,
              "--moe-layer-freq": "[" + ",".join(map(str, s.moe_layer_pattern)) + "]"}
    out = ["--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rope-type",
           "yarn", "--swiglu", "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--qk-layernorm"]
    for flag, v in values.items():
        out += [flag, str(v)]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Path]:
    from miles.utils.tiny_mla import KIMI_K2_YARN, build_tiny_mla_model

    d = tmp_path_factory.mktemp("kimi_k2")
    quickstart_copy(quickstart_prepared, d / "data")      # prepare.sh's, built once a session
    # Kimi-K2's rope theta 50000 and routed scaling 2.827 (its config.json), its yarn over 8 original positions
    model = build_tiny_mla_model(d / "kimi", model_type="kimi_k2", rope_scaling=KIMI_K2_YARN, rope_theta=50000.0,
                                 routed_scaling_factor=2.827, max_position_embeddings=256)
    return d / "data", model


# `make test` runs the recorded colocated mode; the other modes run under `make test-replay` (the other families'
# e2e tests carry each mode in `make test`: docs/benchmarks.md, "The CPU suite")
@pytest.mark.parametrize("mode", replay_params(MODES, in_make_test=("tensor",)))
def test_kimi_k2_recorded_command_runs_two_rollouts(setup, tmp_path: Path, mode: str) -> None:
    data, model = setup
    flags, nproc = MODES[mode]
    if mode == "disk-delta":
        flags = [*flags, "--update-weight-disk-dir", str(tmp_path / "deltas")]
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "train.py", *kimi_shape_flags(model),
           *RECORDED, *flags, "--hf-checkpoint", str(model), "--prompt-data", str(data / "train.jsonl"),
           "--input-key", "input", "--label-key", "label", "--rm-type", "quickstart", "--num-rollout", "2",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
           "--check-weight-update-equal", "--output-dir", str(out)]
    check_ok(run(cmd, log, timeout=900), log)
    recs = check_run_dir(out, num_rollout=2, num_ranks=nproc)
    assert all(r["rollout/num_samples"] == 8 for r in recs)
    text = log.read_text()
    assert "TP 2 x PP 1 x DP 1" in text, text[-3000:]
    assert text.count("--check-weight-update-equal: ") >= 3, text[-3000:]   # initial sync + one per rollout
