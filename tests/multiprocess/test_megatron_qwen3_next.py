"""Qwen3.5-MoE and Qwen3-Next (tiny, ``miles.utils.tiny_qwen35``) on megatron-core, on real gloo ranks (torchrun,
CPU).

``test_hybrid_gpt_matches_hf``: the Megatron backend's GPTModel built from config.json with the family's block spec
(``miles/trainer/megatron/families/qwen3_next.py``: GatedDeltaNet on the torch gated delta rule in the linear
layers, gated self-attention with partial rotary in the full ones, (1 + w) norms, MoE with a gated shared expert) and
loaded by ``convert.load_hf_into`` gives transformers' own logits in fp32 at TP 1, TP 2 (sequence parallel) and EP 2
(the shared worker of ``family_workers.py``); every parameter gets a finite gradient; the weight export equals the
checkpoint's safetensors bit for bit, names included; the TP 2 gradients equal TP 1's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _torchrun import torchrun_self
from family_workers import gpt_worker, gpu_worker, parity_worker

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
SEQ = 70          # longer than one 64-token chunk of the gated delta rule: the state is handed between chunks


def _torchrun(nproc: int, port: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return torchrun_self(HERE, nproc, port, *args, timeout=timeout)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def tiny_hybrid_dir(request, tmp_path_factory) -> Path:
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    return build_tiny_qwen35_model(tmp_path_factory.mktemp(f"tiny_{request.param}"), kind=request.param)


# fp32 rounding of another op order only: measured 2.1e-7 (TP 1, EP 2) and 1.8e-7 (TP 2) for qwen3_5_moe, 1.8e-7 /
# 1.5e-7 for qwen3_next, of logits up to 0.62 (python -m pytest tests/multiprocess/test_megatron_qwen3_next.py)
BOUND = 4e-7


def test_hybrid_gpt_matches_hf(tiny_hybrid_dir: Path, tmp_path: Path, free_port: int) -> None:
    from safetensors.torch import load_file

    grads = {}
    for tp in (1, 2):
        out = tmp_path / f"gpt_tp{tp}.json"
        proc = _torchrun(tp, free_port + tp - 1, "gpt", str(tiny_hybrid_dir), str(out))
        assert proc.returncode == 0, proc.stdout[-4000:]
        res = json.loads(out.read_text())
        assert res["grads_ok"], res
        assert res["max_abs_err"] < BOUND, (tp, res["max_abs_err"], res["ref_scale"])
        assert sorted(res["exported"]) == res["disk"] and len(res["exported"]) == len(set(res["exported"]))
        assert sorted(res["same"]) == res["disk"], sorted(set(res["disk"]) - set(res["same"]))     # bit for bit
        grads[tp] = load_file(str(out.with_suffix(".grads.safetensors")))
    assert grads[1].keys() == grads[2].keys()
    # relative to the tensor's largest gradient, floored at 1% of the model's: A_log's gradients (6e-8) are sums over
    # every token that cancel, measured 8e-11 apart (fp32 order) while the model's largest is 5.6e-3
    scale = max(float(g.abs().max()) for g in grads[1].values())
    for name, g in grads[1].items():
        err = float((grads[2][name] - g).abs().max())
        assert err <= 1e-5 * max(float(g.abs().max()), 1e-2 * scale), (name, err, float(g.abs().max()))


def test_hybrid_expert_parallel_matches_hf(tiny_hybrid_dir: Path, tmp_path: Path, free_port: int) -> None:
    out = tmp_path / "gpt_ep2.json"
    proc = _torchrun(2, free_port, "gpt", str(tiny_hybrid_dir), str(out), "2")
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    assert res["grads_ok"] and res["max_abs_err"] < BOUND, res
    assert sorted(res["exported"]) == res["disk"] and sorted(res["same"]) == res["disk"]


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_mtp_layer_loads_and_exports_bitwise(tp: int, tmp_path: Path, free_port: int) -> None:
    """A checkpoint with its MTP layer (``mtp.*``, the published Qwen3.5 layout) and ``--mtp-num-layers 1``: the MTP
    block (megatron-core's, like the decoder's last layer) is loaded from it, the main model's logits stay
    transformers', and the export gives every tensor back under the checkpoint's names, bit for bit (TP 1, 2)."""
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    model_dir = build_tiny_qwen35_model(tmp_path / "mtp", mtp=True)
    out = tmp_path / "gpt_mtp.json"
    proc = _torchrun(tp, free_port, "gpt_mtp", str(model_dir), str(out))
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    assert any(n.startswith("mtp.") for n in res["disk"])
    assert res["grads_ok"] and res["max_abs_err"] < BOUND, res
    assert sorted(res["exported"]) == res["disk"] and sorted(res["same"]) == res["disk"], \
        sorted(set(res["disk"]) - set(res["same"]))


@pytest.mark.parametrize("layout", ["tp2", "cp2", "pp2", "ep2_cp2"])
def test_hybrid_trainer_parity_with_fsdp(tiny_hybrid_dir: Path, tmp_path: Path, free_port: int, layout: str) -> None:
    """2 ranks: the FSDP backend (transformers' model, DP 2) and the Megatron trainer (TP 2 with sequence
    parallelism, or CP 2: each row split over the 2 ranks, the DeltaNet layers all-gathering it; PP 2: two
    DeltaNet layers on the first stage, a DeltaNet and the attention layer on the last; CP 2 with EP 2 over the same
    2 ranks: each CP rank routes its chunks' tokens to both ranks' experts) train the same 2
    rollouts: log-probs before training, step metrics and the update agree; the export (fp32, bf16) equals the
    checkpoint; ``--save-hf`` loads in transformers to the trained weights; a torch_dist checkpoint (the DeltaNet's
    in_proj and conv1d split per section by megatron-core's factories) saved and resumed restores them bitwise."""
    import torch

    out = tmp_path / "parity.pt"
    proc = _torchrun(2, free_port, "parity_" + layout, str(tiny_hybrid_dir), str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = torch.load(out, weights_only=False)
    assert res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    assert res["save_hf_equal"] and res["ckpt_reload_bitwise"] and res["resumed_extra"]["rollout_id"] == 1, res
    assert res["lp_max_abs_diff"] < LP_BOUND, res
    for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]):
        for key in ("loss", "pg_loss", "entropy", "ppo_kl", "tis", "grad_norm", "num_samples", "num_tokens",
                    "advantages_mean", "kl_loss", "reward_kl_mean"):
            assert abs(f[key] - m[key]) <= 1e-5 * max(1.0, abs(f[key])), (key, f[key], m[key])
    assert res["update_max_abs_diff"] < UPDATE_BOUND and res["update_rel_l2"] < REL_BOUND, res


# measured (python -m pytest tests/multiprocess/test_megatron_qwen3_next.py -k parity), qwen3_5_moe / qwen3_next:
# TP 2: log-probs 4.8e-7 / 4.8e-7 apart, the update after 2 steps 8.7e-6 / 1.25e-5 (max abs), 1.4e-5 / 1.6e-5
# (relative L2); CP 2: 9.5e-7 / 4.8e-7, 1.6e-5 / 1.2e-5, 2.9e-5 / 2.2e-5
LP_BOUND, UPDATE_BOUND, REL_BOUND = 2e-6, 3.2e-5, 6e-5
FLAGS = ("--expert-tensor-parallel-size", "1", "--moe-aux-loss-coeff", "0")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_matches_hf_on_gpu_bf16(kind: str, tmp_path: Path, free_port: int) -> None:
    """bf16 on one GPU (TP 1, NCCL, real torchrun): the Megatron GPTModel's logits (GatedDeltaNet on fla's kernel when
    flash-linear-attention imports, else the torch rule) are as far from transformers' bf16 logits as transformers'
    own bf16 logits are from its fp32 ones, within a factor of 2. DeltaNet head dims of 64 (fla's kernels tile by 16
    and more)."""
    import torch

    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model_dir = build_tiny_qwen35_model(tmp_path / kind, kind=kind, linear_key_head_dim=64, linear_value_head_dim=64)
    out = tmp_path / "gpu.json"
    proc = _torchrun(1, free_port, "gpu", str(model_dir), str(out))
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    print(res)
    assert res["max_abs_err"] <= 2 * max(res["hf_bf16_vs_fp32"], 1e-3), res


if __name__ == "__main__":
    if sys.argv[1] == "gpt":
        gpt_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]), seq=SEQ)
    elif sys.argv[1] == "gpt_mtp":
        gpt_worker(sys.argv[2], sys.argv[3], seq=SEQ, mtp=True)
    elif sys.argv[1] == "parity_tp2":
        parity_worker(sys.argv[2], sys.argv[3], FLAGS)
    elif sys.argv[1] == "parity_cp2":
        parity_worker(sys.argv[2], sys.argv[3], (*FLAGS, "--context-parallel-size", "2"), tp=1)
    elif sys.argv[1] == "parity_pp2":
        parity_worker(sys.argv[2], sys.argv[3], (*FLAGS, "--pipeline-model-parallel-size", "2"), tp=1)
    elif sys.argv[1] == "parity_ep2_cp2":
        parity_worker(sys.argv[2], sys.argv[3], (*FLAGS, "--context-parallel-size", "2", "--expert-model-parallel-size",
                                                 "2"), tp=1)
    elif sys.argv[1] == "gpu":
        gpu_worker(sys.argv[2], sys.argv[3], seq=SEQ)
