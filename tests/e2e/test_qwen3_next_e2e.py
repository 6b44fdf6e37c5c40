"""Qwen3.5-MoE end to end on CPU: the model flags of Miles's Qwen3.5-35B-A3B commands (radixark/miles@v0.1.0:
tests/snapshots/model_args/qwen3.5-35B-A3B.txt, without ``--spec`` and ``--mtp-num-layers``: see docs/trainer.md)
at the tiny model's sizes (``miles.utils.tiny_qwen35``), the parallel layout of its self-distillation command (TP 2
with sequence parallelism, EP over the same 2 CPU ranks, colocated), the embedded engines serving the model on the
generic transformers path (one cache per request: the DeltaNet's conv and recurrent states): 2 rollouts, a weight
sync after each under ``--check-weight-update-equal`` (the engines hold exactly the trainer's weights under HF names),
colocated as recorded, and the published layout once more through ``disk-delta`` (one engine rank of its own).
Miles's recorded Qwen3.6 / Qwen3.5 MTP, Qwen3-Next-80B-A3B (PP with the MTP block) and Qwen3.5 self-distillation
commands (fixtures refused here only by their SGLang-only serving flags) run through the replay tier's scaler.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _family_e2e import check_synced, quickstart_data, run_replay, run_two_rollouts, weight_sync_flags
from miles_fixtures import replay_params, tier_params

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

TINY_SHAPE = [  # Qwen3.5-35B-A3B's model flags, at the tiny model's sizes
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--kv-channels", "16", "--num-layers", "4", "--hidden-size", "64",
    "--ffn-hidden-size", "32", "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type",
    "rope", "--norm-epsilon", "1e-6", "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "101", "--rotary-base", "10000", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "48", "--moe-router-score-function", "softmax",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "2", "--moe-layer-freq", "[1,1,1,1]",
    "--num-experts", "4", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff",
    "0", "--attention-output-gate", "--moe-shared-expert-gate"]
RECORDED = [  # from the self-distillation command (phase2_opd_selfdistill.sh), GPU counts scaled to 2 CPU ranks
    "--apply-chat-template", "--rollout-shuffle", "--rollout-temperature", "1", "--num-steps-per-rollout", "1",
    "--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-beta1",
    "0.9", "--adam-beta2", "0.98", "--advantage-estimator", "grpo", "--kl-loss-type", "low_var_kl", "--entropy-coef",
    "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--use-tis", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full",
    "--recompute-method", "uniform", "--recompute-num-layers", "1", "--rollout-num-gpus-per-engine", "1",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2"]
# + the weight-sync mode's flags (recorded: --colocate)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Callable[[bool], Path]]:
    """The quickstart's data, and the tiny model (built once each) as a text-only checkpoint (False) or in the
    published Qwen3.5 layout (True: ``qwen3_5_moe`` with a ``text_config``, the text model under
    ``model.language_model.``, a vision tower the run does not train, an MTP layer under ``mtp.*`` that the run
    builds and trains: Miles's ``--mtp-num-layers 1 --enable-mtp-training``)."""
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    d = tmp_path_factory.mktemp("qwen35")
    models: dict[bool, Path] = {}

    def model(published: bool) -> Path:
        if published not in models:
            models[published] = build_tiny_qwen35_model(d / ("published" if published else "text"), vlm=published,
                                                        mtp=published)
        return models[published]

    return quickstart_data(d, quickstart_prepared), model


# layout (published with MTP, or text-only) x weight-sync mode: colocated (``tensor``) as recorded, and the published
# layout once through ``disk-delta`` (one engine rank of its own, loading a full safetensors version under the
# published names, ``model.language_model.``, the DeltaNet's ``linear_attn.*`` and the MTP layer's ``mtp.*`` among
# them, then per-tensor deltas; the check leaves ``mtp.*`` out: the engines serve the main model)
LAYOUT_MODES = {"text": (False, "tensor"), "published_layout_mtp": (True, "tensor"),
                "published_layout_mtp-disk-delta": (True, "disk-delta")}


# `make test` runs the text layout (colocated) and the published layout through disk-delta; the published layout
# colocated runs under `make test-replay` (in `make test`, test_recorded_qwen36_mtp_command_runs_two_rollouts runs
# the published layout with its MTP layer trained, colocated)
@pytest.mark.parametrize("published, mode",
                         tier_params(LAYOUT_MODES, in_make_test=("text", "published_layout_mtp-disk-delta")))
def test_qwen35_moe_runs_two_rollouts_with_weight_check(setup, tmp_path: Path, published: bool, mode: str) -> None:
    data, model = setup
    flags, nproc = weight_sync_flags(mode, tmp_path)
    extra = ["--mtp-num-layers", "1", "--enable-mtp-training"] if published else []
    recs, text = run_two_rollouts([*TINY_SHAPE, *RECORDED, *extra, *flags], model=model(published), data=data,
                                  tmp_path=tmp_path, nproc=nproc)
    if published:                       # the MTP layer trained (its loss logged) and left out of the engines' check
        assert all("train/mtp_loss" in r for r in recs), recs[0].keys()
        assert "MTP" in text, text[-3000:]


def test_recorded_qwen36_mtp_command_runs_two_rollouts(tmp_path: Path) -> None:
    """Miles's recorded Qwen3.6-35B-A3B command (tests/fixtures/miles_scripts/megatron_moe_qwen3_6_35b_a3b_mtp.flags:
    ``--spec miles_plugins.models.qwen3_5 get_qwen3_5_spec``, ``--mtp-num-layers 1 --enable-mtp-training``, EP 8)
    through the replay tier's scaler (``miles_fixtures.tiny_replay``: the tiny model in the published layout with its
    MTP layer, 2 CPU ranks, EP 2, the SGLang-only flags dropped: the CPU world's engines are embedded ones): 2
    rollouts, the MTP loss trained, ``--check-weight-update-equal`` after every sync."""
    from miles_fixtures import HERE, PLUGIN_FOLDERS, tiny_replay

    replay = tiny_replay(HERE / "megatron_moe_qwen3_6_35b_a3b_mtp.flags", tmp_path, tmp_path / "models")
    log = tmp_path / "replay.log"
    records = run_replay(replay, log, *PLUGIN_FOLDERS)
    assert all("train/mtp_loss" in r for r in records), records[0].keys()
    assert "--sglang-ep-size" in replay.changed and "--spec" not in replay.changed, replay.changed
    check_synced(log, layout=None)


# the recorded commands of issue 26 (tests/fixtures/miles_scripts/): name -> (what the replay trains, the scaled
# layout on 4 CPU ranks); each is refused here only by SGLang-only serving flags (dropped by the scaler)
RECORDED_COMMANDS = {
    "megatron_moe_qwen3_5_35b_a3b_mtp": "MTP trained, TP 2 x CP 2 (recorded TP 2 x CP 2 x EP 8), EP 2",
    "megatron_moe_qwen3_next_80b_a3b": "MTP frozen, TP 2 x PP 2 (recorded TP 2 x PP 4 x CP 2 x EP 8), EP 2",
    "opd_selfdistill_qwen3_5_35b_phase1_rlvr_teacher": "RLVR, routing replay, TP 2 x CP 2, EP 2",
    "opd_selfdistill_qwen3_5_35b_phase2_opd_selfdistill": "Megatron OPD teacher, TP 2 x CP 2, EP 2",
    "opd_selfdistill_qwen3_5_35b_phase2_gb200": "Megatron OPD teacher, 2 x 4 GPUs recorded, TP 2 x CP 2, EP 2",
}


@pytest.mark.replay
@pytest.mark.parametrize("name", replay_params(RECORDED_COMMANDS, in_make_test=("megatron_moe_qwen3_next_80b_a3b",)))
def test_recorded_qwen35_next_commands_run_two_rollouts(name: str, tmp_path: Path) -> None:
    """Miles's recorded Qwen3.5-35B-A3B MTP, Qwen3-Next-80B-A3B and Qwen3.5 self-distillation commands through the
    replay tier's scaler (``miles_fixtures.tiny_replay``: the tiny model of the family in the published layout with
    its MTP layer, parallel sizes at most 2 on 4 CPU ranks, the SGLang-only flags dropped: the CPU world's engines are
    embedded ones): 2 rollouts, ``--check-weight-update-equal`` after every sync. The MTP command logs ``mtp_loss``;
    Qwen3-Next's builds the MTP block (frozen) on the last of its 2 pipeline stages; the OPD commands' Megatron
    teacher (``--opd-teacher-load``) is a tiny model of other random weights, so the reverse KL is not zero."""
    from miles_fixtures import HERE, PLUGIN_FOLDERS, build_family_model, fixture_model, tiny_replay
    from miles_fixtures import _set as set_flag

    path = HERE / f"{name}.flags"
    replay = tiny_replay(path, tmp_path, tmp_path / "models")
    if "--opd-teacher-load" in replay.argv:
        teacher = build_family_model(tmp_path / "models" / "teacher", fixture_model(path), seed=1)
        replay.argv = set_flag(replay.argv, "--opd-teacher-load", str(teacher))
    log = tmp_path / "replay.log"
    records = run_replay(replay, log, *PLUGIN_FOLDERS)
    text = check_synced(log, layout=None)
    assert any(f.startswith("--sglang-") for f in replay.changed), replay.changed
    if "--enable-mtp-training" in replay.argv:
        assert all("train/mtp_loss" in r for r in records), records[0].keys()
    if name == "megatron_moe_qwen3_next_80b_a3b":       # PP 4 recorded: 2 stages, the frozen MTP block on the last
        assert replay.argv[replay.argv.index("--pipeline-model-parallel-size") + 1] == "2", replay.changed
        assert "train/mtp_loss" not in records[0] and "x PP 2 x" in text, text[-3000:]
    if "--opd-teacher-load" in replay.argv:
        kl = [r["train/opd_reverse_kl_mean"] for r in records]
        assert all(abs(v) > 1e-4 for v in kl), records
