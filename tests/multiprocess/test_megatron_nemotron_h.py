"""Nemotron-H (tiny, ``miles.utils.tiny_nemotron``: pattern ``ME*-E``, latent MoE) on the Megatron backend, on real
gloo ranks (torchrun, CPU).

``test_nemotron_h_matches_hf``: megatron-core's MambaModel built from config.json (Mamba layers on our torch
mixer and SSD scan, attention without rope, squared-ReLU MLP, the latent MoE with a sigmoid router, expert bias and
shared expert) and loaded by our converter gives transformers' own ``NemotronHForCausalLM`` log-probs in fp32 at
TP 1, TP 2 (sequence parallel: in_proj / conv1d split by sections) and EP 2 (all-to-all dispatcher), on rows of 20
tokens (the Mamba chunk is 8); every parameter gets a finite gradient; the weight export (HF ``backbone.*`` names)
equals the checkpoint's safetensors bit for bit, names included.

``test_nemotron_h_pipeline_matches_one_stage``: a dense Nemotron-H (pattern ``M*-M``: Mamba and attention on the
first stage, MLP and Mamba on the second) trains 2 rollouts at TP 2 x PP 2 with ``--sequence-parallel`` (the recorded
Nemotron-3-Nano layout) as at TP 2 + SP on one stage: the same log-probs, metrics and update.

``test_nemotron_h_moe_pipeline_matches_one_stage``: the latent MoE under PP 2 (pattern ``ME*E``: a Mamba and an MoE
layer on each stage's side, the routers' expert bias loaded and exported per stage) trains 2 rollouts as one stage.

``test_nemotron_h_kv_heads_replicated_over_tp``: TP 2 over one KV head (``kv_replicate.py``, as Nemotron-3 Super's 2
KV heads at Miles's TP 4): transformers' log-probs, every gradient equal to TP 1's, the export bit for bit.

Measured on the 2-core CPU box (``pytest -s tests/multiprocess/test_megatron_nemotron_h.py``):
max |log-prob difference| 5.7e-6 at TP 1, TP 2 and EP 2 (logits up to 9.0); bound 1.2e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from family_workers import check_export, check_grads_match, check_parity, compare_runs, launch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
SEQ = 20
BOUND = 1.2e-5
NEMOTRON_FLAGS = ("--expert-tensor-parallel-size", "1", "--moe-aux-loss-coeff", "0", "--position-embedding-type",
                  "none", "--moe-latent-size", "32")


@pytest.fixture(scope="module")
def tiny_nemotron_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    return build_tiny_nemotron_model(tmp_path_factory.mktemp("tiny_nemotron"))


@pytest.mark.parametrize("nproc,ep", [(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2_sp", "ep2"])
def test_nemotron_h_matches_hf(tiny_nemotron_dir: Path, tmp_path: Path, free_port: int, nproc: int, ep: int) -> None:
    res = launch(HERE, nproc, free_port, "run", tiny_nemotron_dir, tmp_path / "res.json", ep, timeout=400)
    print(f"nproc {nproc} ep {ep}: max |log-prob diff| {res['max_lp_err']:.2e} (logits up to {res['ref_scale']:.1f})")
    assert res["ref_scale"] > 3.0               # log-probs far from uniform: the comparison can fail
    assert res["grads_ok"], res
    assert res["max_lp_err"] < BOUND, res["max_lp_err"]
    check_export(res)                                          # bit for bit, names included


def test_nemotron_h_trainer_parity_with_fsdp(tiny_nemotron_dir: Path, tmp_path: Path, free_port: int) -> None:
    """2 ranks: FSDP (transformers' NemotronHForCausalLM, DP 2) and the Megatron trainer (TP 2, sequence parallel)
    train the same 2 rollouts; then the Megatron side's exports, --save-hf (its safetensors, which transformers
    loads) and a torch_dist save / resume."""
    res = launch(HERE, 2, free_port, "parity", tiny_nemotron_dir, tmp_path / "parity.pt", timeout=600)
    print({k: v for k, v in res.items() if k not in ("meg_keys", "fsdp_metrics", "meg_metrics")})
    # both backends export the checkpoint's names (backbone.*, per-expert up/down); FSDP's lacks only the routers'
    # bias buffers (not parameters, never trained)
    assert not res["fsdp_extra"] and res["fsdp_missing"] and all(
        k.endswith(".mixer.gate.e_score_correction_bias") for k in res["fsdp_missing"]), res
    check_parity(res, lp_bound=TRAINER_LP_BOUND, metrics=("loss", "pg_loss", "entropy", "grad_norm", "num_tokens"),
                 bf16=False, metric_bound=TRAINER_METRIC_BOUND, update_bound=TRAINER_UPDATE_BOUND,
                 rel_bound=TRAINER_REL_BOUND)


# measured (2026-12-06, the 2-core CPU box, torchrun of /tmp scripts equivalent to the test): log-probs 5.7e-6 apart
# at TP 2 (4.3e-6 at TP 1); grad norms 5.681859 vs 5.681842 after one update
TRAINER_LP_BOUND = 1.2e-5
# measured (2026-12-07, CPU fp32, the 2-core box; ``OMP_NUM_THREADS=1 python -m pytest -s
# tests/multiprocess/test_megatron_nemotron_h.py -k trainer_parity`` prints it): log-probs 5.7e-6 apart, step metrics
# 3.0e-6 (relative), the update after 2 steps (up to 4.0e-3) 3.8e-5 apart (max abs), 6.4e-5 (relative L2); about twice
TRAINER_METRIC_BOUND, TRAINER_UPDATE_BOUND, TRAINER_REL_BOUND = 6e-6, 7.6e-5, 1.3e-4


NANO_FLAGS = "--tensor-model-parallel-size,2,--sequence-parallel,--position-embedding-type,none"


def test_nemotron_h_pipeline_matches_one_stage(tmp_path: Path, free_port: int) -> None:
    from miles.utils.net import find_free_port
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    model_dir = build_tiny_nemotron_model(tmp_path / "dense", pattern="M*-M")
    runs = {}
    for name, nproc, port, flags in (("one", 2, free_port, NANO_FLAGS),
                                     ("pp2", 4, find_free_port(), NANO_FLAGS + ",--pipeline-model-parallel-size,2")):
        runs[name] = launch(HERE, nproc, port, "train", model_dir, tmp_path / f"{name}.pt", flags, timeout=600)
    assert runs["one"]["layout"] == (2, 1, 1, True) and runs["pp2"]["layout"] == (2, 2, 1, True)
    res = compare_runs(runs["one"], runs["pp2"])
    print(res)
    # measured (2-core CPU box, ``pytest -s tests/multiprocess/test_megatron_nemotron_h.py -k pipeline``): log-probs
    # 2.9e-6 apart (one stage coalesces the micro-batches into one forward, the pipeline runs them one by one), step
    # metrics 1.1e-6 (relative, the grad norm summed over the stages), updates of up to 4.0e-3 differ by 3.7e-6 (9.1e-6
    # in relative L2); bounds at about twice that
    assert res["lp_max_abs_diff"] < 6e-6, res
    assert all(v <= 2.2e-6 for v in res["metric_rel"].values()), res
    assert res["update_max_abs"] > 1e-3 and res["update_max_abs_diff"] < 7.5e-6 and res["update_rel_l2"] < 2e-5, res


MOE_FLAGS = ",".join(NEMOTRON_FLAGS)


def test_nemotron_h_moe_pipeline_matches_one_stage(tmp_path: Path, free_port: int) -> None:
    """The latent MoE at PP 2 (2 ranks: ``M E`` | ``* E``) against one stage (1 rank): the same log-probs, metrics and
    update after 2 rollouts; the export of both (``state_dict_for_check``, HF names) holds every router's
    ``e_score_correction_bias`` as the checkpoint has it."""
    from safetensors.torch import load_file

    from miles.utils.net import find_free_port
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    model_dir = build_tiny_nemotron_model(tmp_path / "moe", pattern="ME*E")
    runs = {}
    # --adam-eps 1e-3: Adam's first step moves every weight by about lr whatever its gradient's size, so a gradient
    # of rounding size (1e-9) would move a weight by lr in either run and a different routing follow; a larger eps
    # keeps such weights still and the comparison at rounding
    base = MOE_FLAGS + ",--adam-eps,1e-3"
    for name, nproc, port, flags in (("one", 1, free_port, base),
                                     ("pp2", 2, find_free_port(), base + ",--pipeline-model-parallel-size,2")):
        runs[name] = launch(HERE, nproc, port, "train", model_dir, tmp_path / f"{name}.pt", flags, timeout=600)
    assert runs["one"]["layout"] == (1, 1, 1, False) and runs["pp2"]["layout"] == (1, 2, 1, False)
    disk = load_file(str(model_dir / "model.safetensors"))
    bias = sorted(n for n in disk if n.endswith("e_score_correction_bias"))
    assert len(bias) == 2 and all(torch_equal(runs["pp2"]["init"][n], disk[n]) for n in bias), bias
    res = compare_runs(runs["one"], runs["pp2"])
    print(res)
    # measured (2-core CPU box, ``OMP_NUM_THREADS=1 pytest -s tests/multiprocess/test_megatron_nemotron_h.py -k
    # moe_pipeline``): log-probs before training equal (0.0: each micro-batch runs alone in both), the first step's
    # grad norm equal to all digits, the second's 3.0e-6 apart (relative), updates of up to 3.5e-3 differ by 1.2e-7;
    # bounds at about twice that (the log-probs at 1e-6)
    assert res["lp_max_abs_diff"] < 1e-6, res
    assert all(v <= 6e-6 for v in res["metric_rel"].values()), res
    assert res["update_max_abs"] > 1e-3 and res["update_max_abs_diff"] < 2.5e-7, res


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny_nemotron_one_kv_dir(tmp_path_factory) -> Path:
    """The tiny model with one KV head (4 query heads): TP 2 replicates it (Super: 2 KV heads at TP 4)."""
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    return build_tiny_nemotron_model(tmp_path_factory.mktemp("tiny_nemotron_one_kv"), num_kv_heads=1)


def test_nemotron_h_kv_heads_replicated_over_tp(tiny_nemotron_one_kv_dir: Path, tmp_path: Path,
                                                free_port: int) -> None:
    """TP 2 (sequence parallel) over one KV head: ``linear_q`` split over TP by heads, ``linear_kv`` on both ranks
    (its gradient summed over TP). Against transformers and against TP 1 on the same rows: log-probs, every
    gradient (HF names, ``k_proj`` / ``v_proj`` included), and the export bit for bit, names included."""
    from safetensors.torch import load_file

    runs = {}
    for tp in (1, 2):
        out = tmp_path / f"kv_tp{tp}.json"
        res = launch(HERE, tp, free_port + tp, "run", tiny_nemotron_one_kv_dir, out, 1, timeout=400)
        runs[tp] = res, load_file(str(out.with_suffix(".grads.safetensors")))
    (one, g1), (two, g2) = runs[1], runs[2]
    print(f"max |log-prob diff| TP 1 {one['max_lp_err']:.2e}, TP 2 {two['max_lp_err']:.2e}")
    assert two["ref_scale"] > 3.0 and two["grads_ok"], two
    assert one["max_lp_err"] < BOUND and two["max_lp_err"] < BOUND, (one["max_lp_err"], two["max_lp_err"])
    check_export(two)
    kv = [n for n in g1 if n.endswith(("mixer.k_proj.weight", "mixer.v_proj.weight"))]
    assert len(kv) == 2 and all(float(g1[n].abs().max()) > 0 for n in kv), kv
    worst = max(g1, key=lambda n: float((g2[n] - g1[n]).abs().max() / g1[n].abs().max().clamp_min(1e-30)))
    print("largest gradient distance, relative to the tensor's largest entry:", worst,
          float((g2[worst] - g1[worst]).abs().max() / g1[worst].abs().max()))
    check_grads_match(g1, g2, KV_GRAD_REL_BOUND)


# measured (2-core CPU box, ``pytest -s tests/multiprocess/test_megatron_nemotron_h.py -k kv_heads``, which prints
# it): the largest gradient distance 2.6e-6 of its tensor's largest entry (layer 4's router); TP 1 and TP 2 log-probs
# 5.7e-6 / 6.7e-6 from transformers' (BOUND 1.2e-5); the bound at about twice that
KV_GRAD_REL_BOUND = 5.5e-6


@pytest.mark.gpu
def test_nemotron_h_super_layout_on_four_gpus(tmp_path: Path, free_port: int) -> None:
    """Nemotron-3 Super's recorded layout at tiny size on GPUs (NCCL, the trainer's GPU default bf16): TP 2 + SP over
    one KV head (replicated) x PP 2 x EP 2 (4 GPUs, ``ME*E``: an MoE layer per stage) against one stage at
    TP 2 + SP x EP 2 (2 GPUs): the same log-probs, metrics and update after 2 rollouts, within bf16 rounding.
    Not run yet (no GPU on the CPU box): the bounds are bf16 budgets (the log-probs of a few nats to about 8 ulps,
    the metrics and update to 2 %) until ``pytest -s -m gpu tests/multiprocess/test_megatron_nemotron_h.py -k
    four_gpus`` measures them; the CPU tests above check the same layouts in fp32 tightly."""
    import torch

    from miles.utils.net import find_free_port
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs (one per rank)")
    model_dir = build_tiny_nemotron_model(tmp_path / "super", pattern="ME*E", num_kv_heads=1)
    base = MOE_FLAGS + ",--adam-eps,1e-3,--tensor-model-parallel-size,2,--sequence-parallel,--expert-model-parallel-size,2"
    runs = {}
    for name, nproc, port, flags in (("one", 2, free_port, base),
                                     ("pp2", 4, find_free_port(), base + ",--pipeline-model-parallel-size,2")):
        runs[name] = launch(HERE, nproc, port, "train", model_dir, tmp_path / f"{name}.pt", flags, "cuda",
                            timeout=900)
    assert runs["one"]["layout"] == (2, 1, 1, True) and runs["pp2"]["layout"] == (2, 2, 1, True)
    res = compare_runs(runs["one"], runs["pp2"])
    print(res)
    assert res["lp_max_abs_diff"] < 0.06, res
    assert all(v <= 2e-2 for v in res["metric_rel"].values()), res
    assert res["update_max_abs"] > 0 and res["update_rel_l2"] < 2e-2, res


@pytest.mark.gpu
def test_nemotron_h_matches_hf_on_gpu_bf16(tiny_nemotron_dir: Path, tmp_path: Path, free_port: int) -> None:
    """bf16 on one GPU (the Megatron MambaModel on mamba_ssm's scan where it imports, else ours on the GPU;
    transformers' model on its kernels or torch fallbacks): Megatron's log-probs are as far from transformers' bf16
    ones as transformers' own bf16 log-probs are from its fp32 ones, within a factor of 2 (not run yet: no GPU on
    the CPU box)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    res = launch(HERE, 1, free_port, "gpu", tiny_nemotron_dir, tmp_path / "gpu.json", timeout=400)
    print(res)
    assert res["max_lp_err"] < 2 * max(res["hf_lp_bf16_vs_fp32"], 1e-3), res


if __name__ == "__main__":
    from family_workers import gpt_worker, gpu_worker, parity_worker, train_worker

    if sys.argv[1] == "run":
        gpt_worker(sys.argv[2], sys.argv[3], ep=int(sys.argv[4]) if len(sys.argv) > 4 else 1, seq=SEQ)
    elif sys.argv[1] == "parity":           # the checkpoint's backbone.* names: --save-hf compared on disk
        parity_worker(sys.argv[2], sys.argv[3], NEMOTRON_FLAGS, saved="disk", bf16_export=False)
    elif sys.argv[1] == "train":
        train_worker(*sys.argv[2:6])
    elif sys.argv[1] == "gpu":
        from miles.trainer.megatron.families.mamba import gpu_chunk_scan

        gpu_worker(sys.argv[2], sys.argv[3], seq=SEQ, attn_implementation=None,
                   info=lambda: {"mamba_ssm": gpu_chunk_scan() is not None})


def test_embedded_engine_serves_nemotron_h(tiny_nemotron_dir: Path, tmp_path: Path) -> None:
    """``python -m miles.engine`` serves Nemotron-H on the generic transformers path, each request with its own cache
    built from config.json (a conv and an SSM state per Mamba layer, KV for the attention layer): a batch of prompts
    of different lengths (2 to 20 tokens, across the Mamba chunk of 8), 2 samples each and different
    ``max_new_tokens``, on 4 slots (so requests finish, leave and are admitted while others decode), gives greedily
    exactly the tokens each prompt gets alone, and transformers' ``generate`` of the prompt alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.engine.testing import EngineProc

    prompts = [[5, 17, 23, 42, 8, 9, 11, 12, 3, 4, 5, 6, 7], [7, 8], list(range(30, 50)), [60, 61, 62, 63, 64]]
    new = [8, 5, 10, 6]
    hf = AutoModelForCausalLM.from_pretrained(tiny_nemotron_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p, m in zip(prompts, new)]
    assert len({tuple(r) for r in ref}) == len(ref), ref          # the prompts' continuations differ
    sp = [{"max_new_tokens": m, "temperature": 0.0, "ignore_eos": True, "n": 2} for m in new]
    eng = EngineProc(tiny_nemotron_dir, "--max-running-requests", "4", "--max-context-len", "64",
                     log=tmp_path / "e.log")
    try:
        batch = eng.generate({"input_ids": prompts, "sampling_params": sp})
        alone = [eng.generate({"input_ids": p, "sampling_params": {**s, "n": 1}})["output_ids"]
                 for p, s in zip(prompts, sp)]
    finally:
        eng.stop()
    assert [o["output_ids"] for o in batch] == [r for r in ref for _ in range(2)], (batch, ref)
    assert alone == ref, (alone, ref)
