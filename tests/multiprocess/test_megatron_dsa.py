"""DeepSeek sparse attention (tiny GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``, GLM-5.2's shared top-k
layers; ``miles.utils.tiny_dsa``) on the Megatron backend, on real gloo ranks (torchrun, CPU). The workers are
test_megatron_mla.py's (every family goes through the registry, ``miles/trainer/megatron/families/``), run here on
the DSA checkpoints:

``test_dsa_gpt_matches_hf``: megatron-core's MLA with its ``DSAttention`` / ``DSAIndexer`` core attention (our torch
Hadamard transform, the indexer weights permuted to megatron-core's head layout) built from config.json and loaded
by our converter gives transformers' own DSA logits in fp32 at TP 1 and TP 2 (sequence parallel); the rows (12
tokens) are longer than the indexer's top-k (4), so attention is sparse from the fifth token on; every trained
parameter gets a finite gradient (the indexer is frozen, as in transformers); the export equals the checkpoint's
safetensors bit for bit, names included (the permutation undone exactly); the TP 2 gradients equal TP 1's.

``test_dsa_expert_parallel_matches_hf``: EP 2 (all-to-all dispatcher): the same logits, the export gathered over EP
bitwise.

``test_dsa_trainer_parity_with_fsdp``: 2 ranks. The FSDP backend (transformers' GlmMoeDsaForCausalLM under FSDP2,
DP 2) and the Megatron trainer (TP 2, sequence parallel) train the same 2 rollouts: log-probs before training, step
metrics and the update after 2 steps agree; the fp32 and bf16 exports of the untrained model equal the checkpoint;
``--save-hf`` loads in transformers to the trained weights; a torch_dist checkpoint saved and resumed restores them
bitwise.

``test_dsa_matches_hf_on_gpu_bf16`` (``gpu``): one GPU, bf16, TP 1, against transformers' bf16 logits.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _torchrun import torchrun_self

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
MLA_WORKERS = HERE.with_name("test_megatron_mla.py")          # its "gpt" and "parity" workers
GPU_WORKER = HERE.with_name("test_megatron_gpt_oss.py")       # its "gpu" worker (bf16, TP 1, eager transformers)

# fp32 rounding of another op order only: measured 1.2e-7 .. 1.8e-7 (GLM-5, DeepSeek-V3.2, GLM-5.2's shared layers;
# TP 1, TP 2; EP 2: 1.2e-7, 1.3e-7) of logits up to 0.58 (python -m pytest -s tests/multiprocess/test_megatron_dsa.py -k gpt_matches);
# the indexer's rope layout of the other family gives 0.23, a dense attention in place of the top-k 0.18
BOUND = 4e-7


def _torchrun(script: Path, nproc: int, port: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return torchrun_self(script, nproc, port, *args, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_glm5_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    return build_tiny_dsa_model(tmp_path_factory.mktemp("tiny_glm5"))


@pytest.fixture(scope="module")
def tiny_dsv32_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_dsa import TINY_YARN, build_tiny_dsa_model

    # DeepSeek-V3.2: half-split indexer rope, yarn (factor 4 over 8 original positions: the 12-token rows use the
    # ramp and the softmax mscale), grouped routing (2 groups of 2 experts, 1 chosen)
    return build_tiny_dsa_model(tmp_path_factory.mktemp("tiny_dsv32"), model_type="deepseek_v32", n_group=2,
                                topk_group=1, rope_scaling=TINY_YARN, routed_scaling_factor=2.5,
                                max_position_embeddings=32)


@pytest.fixture(scope="module")
def tiny_glm52_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    # GLM-5.2: the middle layer has no indexer and attends over the first layer's top-k
    return build_tiny_dsa_model(tmp_path_factory.mktemp("tiny_glm52"), indexer_types=["full", "shared", "full"])


FAMILY_DIRS = {"glm5": "tiny_glm5_dir", "dsv32": "tiny_dsv32_dir", "glm52": "tiny_glm52_dir"}


@pytest.mark.parametrize("family", ["glm5", "dsv32", "glm52"])
def test_dsa_gpt_matches_hf(request, tmp_path: Path, free_port: int, family: str) -> None:
    from safetensors.torch import load_file

    model_dir = request.getfixturevalue(FAMILY_DIRS[family])
    grads = {}
    for tp in (1, 2):
        out = tmp_path / f"gpt_tp{tp}.json"
        proc = _torchrun(MLA_WORKERS, tp, free_port + tp - 1, "gpt", str(model_dir), str(out))
        assert proc.returncode == 0, proc.stdout[-4000:]
        res = json.loads(out.read_text())
        assert res["grads_ok"], res
        print(family, tp, res["max_abs_err"], res["ref_scale"])
        assert res["max_abs_err"] < BOUND, (tp, res["max_abs_err"])
        assert sorted(res["exported"]) == res["disk"] and len(res["exported"]) == len(set(res["exported"]))
        assert sorted(res["same"]) == res["disk"]                # bit for bit, the indexer's permutation undone
        assert any(".self_attn.indexer.wq_b." in n for n in res["same"])
        grads[tp] = load_file(str(out.with_suffix(".grads.safetensors")))
    assert grads[1].keys() == grads[2].keys()
    for name, g in grads[1].items():
        err = float((grads[2][name] - g).abs().max())
        assert err <= 1e-5 * max(float(g.abs().max()), 1e-6), (name, err, float(g.abs().max()))
        if ".indexer." in name:                                  # frozen: no gradient (exported as zeros)
            assert not g.any(), name


@pytest.mark.parametrize("family", ["glm5", "dsv32"])
def test_dsa_expert_parallel_matches_hf(request, tmp_path: Path, free_port: int, family: str) -> None:
    out = tmp_path / "gpt_ep2.json"
    proc = _torchrun(MLA_WORKERS, 2, free_port, "gpt", str(request.getfixturevalue(FAMILY_DIRS[family])), str(out), "2")
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    print(family, "ep2", res["max_abs_err"])
    assert res["grads_ok"] and res["max_abs_err"] < BOUND, res["max_abs_err"]
    assert sorted(res["exported"]) == res["disk"] and sorted(res["same"]) == res["disk"]


def test_dsa_trainer_parity_with_fsdp(tiny_glm5_dir: Path, tmp_path: Path, free_port: int) -> None:
    import torch

    out = tmp_path / "parity.pt"
    proc = _torchrun(MLA_WORKERS, 2, free_port, "parity", str(tiny_glm5_dir), str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = torch.load(out, weights_only=False)
    print({k: res[k] for k in ("lp_max_abs_diff", "update_max_abs_diff", "update_rel_l2", "update_worst")})
    assert res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    assert res["save_hf_equal"] and res["ckpt_reload_bitwise"] and res["resumed_extra"]["rollout_id"] == 1, res
    assert res["lp_max_abs_diff"] < LP_BOUND, res
    for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]):
        for key in ("loss", "pg_loss", "entropy", "ppo_kl", "tis", "grad_norm", "num_samples", "num_tokens",
                    "advantages_mean", "kl_loss", "reward_kl_mean"):
            assert abs(f[key] - m[key]) <= 1e-5 * max(1.0, abs(f[key])), (key, f[key], m[key])
    assert res["update_max_abs_diff"] < UPDATE_BOUND and res["update_rel_l2"] < REL_BOUND, res


# measured (python -m pytest -s tests/multiprocess/test_megatron_dsa.py -k trainer_parity): log-probs 4.8e-7 apart,
# the update after 2 steps 9.7e-6 (max abs, an MLP weight), 1.4e-5 (relative L2)
LP_BOUND, UPDATE_BOUND, REL_BOUND = 1e-6, 2e-5, 3e-5


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["glm5", "dsv32"])
def test_dsa_matches_hf_on_gpu_bf16(request, tmp_path: Path, free_port: int, family: str) -> None:
    """bf16 on one GPU (the indexer's Hadamard transform by fast_hadamard_transform where it imports): Megatron's
    logits are as far from transformers' bf16 logits as transformers' own bf16 logits are from its fp32 ones, within
    a factor of 2."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = tmp_path / "gpu.json"
    proc = _torchrun(GPU_WORKER, 1, free_port, "gpu", str(request.getfixturevalue(FAMILY_DIRS[family])), str(out))
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    print(family, res)
    assert res["max_abs_err"] <= 2 * max(res["hf_bf16_vs_fp32"], 1e-3), res


@pytest.mark.parametrize("family", ["glm5", "dsv32"])
def test_embedded_engine_serves_dsa(request, tmp_path: Path, family: str) -> None:
    """``python -m miles.engine`` (generic transformers path, its cache built from config.json so the indexer keeps
    its keys) decodes greedily as transformers' ``generate`` does, past the indexer's top-k."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.engine.testing import EngineProc

    model_dir = request.getfixturevalue(FAMILY_DIRS[family])
    prompt = [5, 17, 23, 42, 8, 9, 11, 12]                   # longer than index_topk (4)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    eng = EngineProc(model_dir, "--max-running-requests", "2", "--max-context-len", "64", log=tmp_path / "e.log")
    try:
        out = eng.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                                     "ignore_eos": True}})
    finally:
        eng.stop()
    assert out["output_ids"] == ref, (out, ref)
