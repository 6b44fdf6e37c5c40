"""LoRA on the MoE experts on the FSDP backend end to end on CPU: a tiny Qwen3-MoE, one trainer rank and one embedded
engine under torchrun (``train.py``), ``--lora-rank 4 --target-modules all-linear --experts-shared-outer-loras``,
2 rollouts with ``--check-weight-update-equal`` after every sync (the merged experts under the checkpoint's
per-expert names, read back from the engine bit for bit), ``grad_norm`` > 0 in every step, and ``--save``'s adapter
files (``step_N/lora/rank_00000.pt``) hold every routed expert's factors with ``lora_B`` moved off its zero init;
a relaunch with ``--load`` resumes from them and trains the third rollout.

``test_fsdp_lora_on_mla_trains_and_syncs``: a tiny DeepSeek-V3 (multi-latent attention, DeepSeek-style MoE) with
Kimi-K2.5's recipe targets (``q_a_proj,kv_a_proj_with_mqa,o_proj,gate_proj,up_proj,down_proj``), 2 rollouts with
``--check-weight-update-equal`` after every sync; the saved adapters hold the MLA down projections' factors (q_b_proj /
kv_b_proj: none) with ``lora_B`` moved.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _miles_e2e import check_ok, check_run_dir, quickstart_copy, run
from miles_fixtures import VARYING_REWARD

HERE = Path(__file__).resolve()
# the repo and tests/ (miles_fixtures.varying_reward: a reward that varies within a group, so a random tiny policy's
# GRPO advantages and the adapters' gradient are not 0)
PYTHONPATH = os.pathsep.join([str(HERE.parents[2]), str(HERE.parents[1])])

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Path]:
    from miles.utils.tiny_model import build_tiny_moe_model

    d = tmp_path_factory.mktemp("fsdp_lora_moe")
    quickstart_copy(quickstart_prepared, d / "data")      # prepare.sh's, built once a session
    return d / "data", build_tiny_moe_model(d / "moe", num_layers=2, num_experts=4, num_experts_per_tok=2)


KIMI_K25 = "q_a_proj,kv_a_proj_with_mqa,o_proj,gate_proj,up_proj,down_proj"        # Kimi-K2.5's LoRA recipe


def _cmd(data: Path, model: Path, out: Path, save: Path, num_rollout: int,
         lora: tuple[str, ...] = ("--target-modules", "all-linear", "--experts-shared-outer-loras")) -> list[str]:
    return ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
            "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "2", "--train-backend", "fsdp",
            "--hf-checkpoint", str(model), "--prompt-data", str(data / "train.jsonl"), "--input-key", "input",
            "--label-key", "label", "--custom-rm-path", VARYING_REWARD, "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
            "--rollout-max-response-len", "4", "--rollout-temperature", "1.0", "--lr", "1e-2",
            "--lora-rank", "4", "--lora-alpha", "8", *lora, "--check-weight-update-equal", "--save", str(save), "--save-interval", "1", "--output-dir", str(out)]


def test_fsdp_lora_on_moe_experts_trains_syncs_saves_and_resumes(setup, tmp_path: Path) -> None:
    import torch

    data, model = setup
    out, log, save = tmp_path / "run", tmp_path / "run.log", tmp_path / "ckpt"
    check_ok(run(_cmd(data, model, out, save, 2), log, timeout=600, PYTHONPATH=PYTHONPATH), log)
    recs = check_run_dir(out, num_rollout=2, num_ranks=2)
    assert all(r["train/grad_norm"] > 0 for r in recs), [r["train/grad_norm"] for r in recs]
    text = log.read_text()
    assert text.count("--check-weight-update-equal: ") >= 3, text[-3000:]
    newest = sorted(save.glob("step_*"))[-1]
    saved = torch.load(newest / "lora" / "rank_00000.pt", weights_only=False)
    assert saved["spec"]["experts_shared_outer"] and "optimizer" in saved
    experts = {k: t for k, t in saved["adapters"].items() if ".local_experts." in k.replace("/", ".")}
    assert len(experts) == 2 * 4 * 2 * 2, sorted(experts)[:4]            # layers x experts x fc x (A, B)
    assert any(t.abs().max() > 0 for k, t in experts.items() if k.endswith("lora_B")), "every expert lora_B is 0"

    out2, log2 = tmp_path / "resumed", tmp_path / "resumed.log"
    check_ok(run(_cmd(data, model, out2, save, 3), log2, timeout=600, PYTHONPATH=PYTHONPATH), log2)
    recs2 = check_run_dir(out2, num_rollout=1, num_ranks=2, first=2)
    assert recs2[0]["train/grad_norm"] > 0
    assert "loaded checkpoint" in log2.read_text(), log2.read_text()[-3000:]


def test_fsdp_lora_on_mla_trains_and_syncs(setup, tmp_path: Path) -> None:
    import torch

    from miles.utils.tiny_mla import build_tiny_mla_model

    data, _ = setup
    model = build_tiny_mla_model(tmp_path / "dsv3", model_type="deepseek_v3", n_group=2, topk_group=1)
    out, log, save = tmp_path / "run", tmp_path / "run.log", tmp_path / "ckpt"
    check_ok(run(_cmd(data, model, out, save, 2, ("--target-modules", KIMI_K25)), log, timeout=600,
                 PYTHONPATH=PYTHONPATH), log)
    recs = check_run_dir(out, num_rollout=2, num_ranks=2)
    assert all(r["train/grad_norm"] > 0 for r in recs), [r["train/grad_norm"] for r in recs]
    assert log.read_text().count("--check-weight-update-equal: ") >= 3, log.read_text()[-3000:]
    saved = torch.load(sorted(save.glob("step_*"))[-1] / "lora" / "rank_00000.pt", weights_only=False)["adapters"]
    # keys: groups.decoder/layers/L/self_attention/<Megatron leaf>.lora_A / .lora_B.<HF linear>
    attn = {k.split("/self_attention/")[1].split(".")[0] for k in saved if "/self_attention/" in k}
    assert attn == {"linear_q_down_proj", "linear_kv_down_proj", "linear_proj"}, sorted(saved)[:8]
    kv_b = [t for k, t in saved.items() if k.endswith("linear_kv_down_proj.lora_B.kv_a_proj_with_mqa")]
    assert len(kv_b) == 3 and all(t.abs().max() > 0 for t in kv_b), "a kv_a_proj_with_mqa lora_B is 0"
