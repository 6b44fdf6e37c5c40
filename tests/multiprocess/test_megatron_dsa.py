"""DeepSeek sparse attention (tiny GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``, GLM-5.2's shared top-k
layers; ``miles.utils.tiny_dsa``) on the Megatron backend, on real gloo ranks (torchrun, CPU). The workers are
family_workers.py's (every family goes through the registry, ``miles/trainer/megatron/families/``), run here as
test_megatron_mla.py runs them on the MLA checkpoints (12-token rows, transformers' default attention, the frozen
indexer's gradient exported as zeros, the FSDP export's experts split per expert):

``test_dsa_gpt_matches_hf``: megatron-core's MLA with its ``DSAttention`` / ``DSAIndexer`` core attention (our torch
Hadamard transform, the indexer weights permuted to megatron-core's head layout) built from config.json and loaded
by our converter gives transformers' own DSA logits in fp32 at TP 1 and TP 2 (sequence parallel); the rows (12
tokens) are longer than the indexer's top-k (4), so attention is sparse from the fifth token on; every trained
parameter gets a finite gradient (the indexer is frozen, as in transformers); the export equals the checkpoint's
safetensors bit for bit, names included (the permutation undone exactly); the TP 2 gradients equal TP 1's.

``test_dsa_expert_parallel_matches_hf``: EP 2 (all-to-all dispatcher): the same logits, the export gathered over EP
bitwise.

``test_dsa_trainer_parity_with_fsdp``: 2 ranks, each family. The FSDP backend (transformers' GlmMoeDsaForCausalLM /
DeepseekV32ForCausalLM under FSDP2, DP 2) and the Megatron trainer (TP 2, sequence parallel) train the same 2
rollouts: log-probs before training, step metrics and the update after 2 steps agree; the fp32 and bf16 exports of
the untrained model equal the checkpoint; ``--save-hf`` loads in transformers to the trained weights; a torch_dist
checkpoint saved and resumed restores them bitwise. The rows are checked first to leave no indexer top-k to a tie
(``boundary_ties``: there the keys kept would be ``torch.topk``'s tie order, not the model's).

``test_dsa_pipeline_parallel_parity_with_fsdp``: 2 ranks, each family, PP 2 (the 3 layers split 2 + 1, so GLM-5.2's
shared layer is on its source layer's stage): the same comparison against FSDP DP 2, each stage building only its own
layers' core attention.

``test_dsa_matches_hf_on_gpu_bf16`` (``gpu``): one GPU, bf16, TP 1, against transformers' bf16 logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from family_workers import check_export, check_gpu_matches_hf, check_grads_match, check_parity, launch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
SEQ = 12

# fp32 rounding of another op order only: measured 1.2e-7 .. 1.8e-7 (GLM-5, DeepSeek-V3.2, GLM-5.2's shared layers;
# TP 1, TP 2; EP 2: 1.2e-7 each) of logits up to 0.58 (python -m pytest -s tests/multiprocess/test_megatron_dsa.py -k gpt_matches);
# the indexer's rope layout of the other family gives 0.23, a dense attention in place of the top-k 0.18
BOUND = 4e-7


# 8 indexer heads, not tiny_dsa's 4: with 4, a key's score is often exactly 0 (every head's ReLU zero), and where
# zeros straddle the top-k boundary the keys kept are torch.topk's arbitrary tie order, which changes with the row's
# padded length: transformers itself then gives one sample 7.2e-3 (DeepSeek-V3.2) / 3.3e-2 (GLM-5.2) other
# log-probs padded than unpadded, which is what the trainer parity measured (the backends pad micro-batches
# differently). With 8 heads the parity rows have no tie at the boundary (GLM-5 / 5.1 and DeepSeek-V3.2 have 32 / 64).
INDEX_HEADS = 8


@pytest.fixture(scope="module")
def tiny_glm5_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    return build_tiny_dsa_model(tmp_path_factory.mktemp("tiny_glm5"), index_n_heads=INDEX_HEADS)


@pytest.fixture(scope="module")
def tiny_dsv32_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_dsa import TINY_YARN, build_tiny_dsa_model

    # DeepSeek-V3.2: half-split indexer rope, yarn (factor 4 over 8 original positions: the 12-token rows use the
    # ramp and the softmax mscale), grouped routing (2 groups of 2 experts, 1 chosen)
    return build_tiny_dsa_model(tmp_path_factory.mktemp("tiny_dsv32"), model_type="deepseek_v32", n_group=2,
                                topk_group=1, rope_scaling=TINY_YARN, routed_scaling_factor=2.5,
                                max_position_embeddings=32, index_n_heads=INDEX_HEADS)


@pytest.fixture(scope="module")
def tiny_glm52_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    # GLM-5.2: the middle layer has no indexer and attends over the first layer's top-k
    return build_tiny_dsa_model(tmp_path_factory.mktemp("tiny_glm52"), indexer_types=["full", "shared", "full"],
                                index_n_heads=INDEX_HEADS)


FAMILY_DIRS = {"glm5": "tiny_glm5_dir", "dsv32": "tiny_dsv32_dir", "glm52": "tiny_glm52_dir"}


def _gpt(model_dir: Path, out: Path, port: int, nproc: int, *args: str) -> dict:
    res = launch(HERE, nproc, port, "gpt", model_dir, out, *args)
    assert res["grads_ok"], res
    assert res["max_abs_err"] < BOUND, (nproc, args, res["max_abs_err"])
    check_export(res)                                            # bit for bit, the indexer's permutation undone
    return res


@pytest.mark.parametrize("family", ["glm5", "dsv32", "glm52"])
def test_dsa_gpt_matches_hf(request, tmp_path: Path, free_port: int, family: str) -> None:
    from safetensors.torch import load_file

    model_dir = request.getfixturevalue(FAMILY_DIRS[family])
    grads = {}
    for tp in (1, 2):
        out = tmp_path / f"gpt_tp{tp}.json"
        res = _gpt(model_dir, out, free_port + tp - 1, tp)
        print(family, tp, res["max_abs_err"], res["ref_scale"])
        assert any(".self_attn.indexer.wq_b." in n for n in res["same"])
        grads[tp] = load_file(str(out.with_suffix(".grads.safetensors")))
    check_grads_match(grads[1], grads[2], 1e-5, floor=1e-6)
    frozen = [name for name in grads[1] if ".indexer." in name]
    assert frozen and not any(grads[1][name].any() for name in frozen)    # frozen: no gradient (exported as zeros)


@pytest.mark.parametrize("family", ["glm5", "dsv32", "glm52"])
def test_dsa_expert_parallel_matches_hf(request, tmp_path: Path, free_port: int, family: str) -> None:
    res = _gpt(request.getfixturevalue(FAMILY_DIRS[family]), tmp_path / "gpt_ep2.json", free_port, 2, "2")
    print(family, "ep2", res["max_abs_err"])


def boundary_ties(model_dir: Path, samples: list) -> list[tuple[int, int]]:
    """(sample, query position) where transformers' indexer, run on the sample alone, has a tie between its
    ``index_topk``-th and next best score over the causal keys: there the keys kept are ``torch.topk``'s tie order,
    which changes with the row's padded length, so two backends need not keep the same ones."""
    from unittest import mock

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    k, topk, seen = hf.config.index_topk, torch.Tensor.topk, []

    def recording(t, n, *a, **kw):
        if t.dim() == 3 and t.shape[-1] == t.shape[-2] == length and n == min(k, length):
            seen.append(t.detach().clone())            # the indexer's [1, s, s] scores (not the router's)
        return topk(t, n, *a, **kw)

    ties = []
    with mock.patch.object(torch.Tensor, "topk", recording), torch.no_grad():
        for i, sample in enumerate(samples):
            length, seen = len(sample.tokens), []
            hf(input_ids=torch.tensor([sample.tokens]))
            ties += [(i, q) for scores in seen for q in range(k, length)
                     if (v := scores[0, q, :q + 1].sort(descending=True).values)[k - 1] == v[k]]
    return ties


@pytest.mark.parametrize("family", ["glm5", "dsv32", "glm52"])
def test_dsa_trainer_parity_with_fsdp(request, tmp_path: Path, free_port: int, family: str) -> None:
    from trainer_harness import random_samples

    model_dir = request.getfixturevalue(FAMILY_DIRS[family])
    # the parity worker's rows (family_workers.parity_worker) must not leave the top-k to a tie (INDEX_HEADS)
    assert not boundary_ties(model_dir, random_samples(4, 4, seed=7, vocab=90)), "indexer top-k ties in the rows"
    res = launch(HERE, 2, free_port, "parity", model_dir, tmp_path / "parity.pt", timeout=600)
    print(family, {k: res[k] for k in ("lp_max_abs_diff", "update_max_abs_diff", "update_rel_l2", "update_worst")})
    check_parity(res, lp_bound=LP_BOUND, update_bound=UPDATE_BOUND, rel_bound=REL_BOUND)


# measured (2026-12-07, OMP_NUM_THREADS=1 python -m pytest -s tests/multiprocess/test_megatron_dsa.py -k
# trainer_parity): log-probs 4.8e-7 (GLM-5, GLM-5.2) / 9.5e-7 (DeepSeek-V3.2) apart; the update after 2 steps 1.5e-5
# / 5.4e-6 / 4.3e-6 (max abs, an MLP or expert weight), 2.1e-5 / 8.6e-6 / 6.0e-6 (relative L2). About twice the largest.
LP_BOUND, UPDATE_BOUND, REL_BOUND = 2e-6, 3e-5, 4e-5


# PP 2 on the tiny model's 3 layers, split 2 + 1 (--decoder-last-pipeline-num-layers, as Kimi-K2's recorded command
# splits): GLM-5.2's shared layer 1 stays on stage 0 with its source layer 0 (a stage may not start with a shared
# layer: options refuses that split); TP 1, DP 1.
PP2_FLAGS = ("--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1")
# measured (2026-12-07, CPU fp32, 2 gloo ranks; OMP_NUM_THREADS=1 python -m pytest -s
# tests/multiprocess/test_megatron_dsa.py -k pipeline_parallel_parity): log-probs 4.8e-7 apart in each (GLM-5,
# DeepSeek-V3.2, GLM-5.2); the update after 2 steps 3.3e-6 / 4.3e-6 / 4.1e-6 (max abs), 6.6e-6 / 7.2e-6 / 5.9e-6
# (relative L2). About twice the largest.
LP_BOUND_PP, UPDATE_BOUND_PP, REL_BOUND_PP = 1e-6, 9e-6, 1.5e-5


@pytest.mark.parametrize("family", ["glm5", "dsv32", "glm52"])
def test_dsa_pipeline_parallel_parity_with_fsdp(request, tmp_path: Path, free_port: int, family: str) -> None:
    """GLM-5, DeepSeek-V3.2 (its recorded command runs PP 4) and GLM-5.2 (shared top-k layers) under pipeline
    parallelism (2 stages, each building only its own layers' DSA core attention by their model-wide layer number),
    2 ranks, against the FSDP backend over the same ranks (DP 2): log-probs before training, the step metrics and the
    update after 2 steps; the export bitwise (fp32 and bf16, the indexer tensors under their global layer names),
    ``--save-hf`` and a checkpoint resume."""
    from trainer_harness import random_samples

    model_dir = request.getfixturevalue(FAMILY_DIRS[family])
    assert not boundary_ties(model_dir, random_samples(4, 4, seed=7, vocab=90)), "indexer top-k ties in the rows"
    res = launch(HERE, 2, free_port, "parity_pp", model_dir, tmp_path / "parity.pt", timeout=900)
    assert res["layout"] == {"tp_size": 1, "pp_size": 2, "cp_size": 1, "ep_size": 1, "dp_size": 1}, res["layout"]
    assert any(".self_attn.indexer.wq_b." in k for k in res["meg_keys"]), res["meg_keys"]
    print(family, "pp2", {k: res[k] for k in ("lp_max_abs_diff", "update_max_abs_diff", "update_rel_l2",
                                              "update_worst")})
    check_parity(res, lp_bound=LP_BOUND_PP, update_bound=UPDATE_BOUND_PP, rel_bound=REL_BOUND_PP)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["glm5", "dsv32", "glm52"])
def test_dsa_matches_hf_on_gpu_bf16(request, tmp_path: Path, free_port: int, family: str) -> None:
    """bf16 on one GPU (the indexer's Hadamard transform by fast_hadamard_transform where it imports): Megatron's
    logits are as far from transformers' bf16 logits as transformers' own bf16 logits are from its fp32 ones, within
    a factor of 2."""
    check_gpu_matches_hf(HERE, request.getfixturevalue(FAMILY_DIRS[family]), tmp_path / "gpu.json", free_port, family)


@pytest.mark.parametrize("family", ["glm5", "dsv32", "glm52"])
def test_embedded_engine_serves_dsa(request, tmp_path: Path, family: str) -> None:
    """``python -m miles.engine`` (generic transformers path, its cache built from config.json so the indexer keeps
    its keys) decodes greedily as transformers' ``generate`` does, past the indexer's top-k."""
    from family_workers import check_engine_greedy

    model_dir = request.getfixturevalue(FAMILY_DIRS[family])
    check_engine_greedy(model_dir, tmp_path / "e.log", [5, 17, 23, 42, 8, 9, 11, 12])   # longer than index_topk (4)


if __name__ == "__main__":
    from family_workers import gpt_worker, gpu_worker, parity_worker
    from trainer_harness import PRESETS

    if sys.argv[1] == "gpt":            # as test_megatron_mla.py's: transformers' default attention, the indexer's
        gpt_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]), seq=SEQ,     # zero gradient exported
                   attn_implementation=None, frozen="zero")
    elif sys.argv[1] == "parity":
        parity_worker(sys.argv[2], sys.argv[3], ("--expert-tensor-parallel-size", "1", *PRESETS["mla"],
                                                 "--moe-router-dtype", "fp32"), split_fsdp_experts=True)
    elif sys.argv[1] == "parity_pp":
        parity_worker(sys.argv[2], sys.argv[3], (*PRESETS["mla"], "--moe-router-dtype", "fp32", *PP2_FLAGS), tp=1,
                      split_fsdp_experts=True)
    elif sys.argv[1] == "gpu":
        gpu_worker(sys.argv[2], sys.argv[3])
