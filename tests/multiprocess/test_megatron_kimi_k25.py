"""Kimi-K2.5 (tiny, ``miles.utils.tiny_kimi_k25``: the published multimodal layout) on the Megatron backend, on real
gloo ranks (torchrun, CPU), against transformers' own ``Kimi_K25ForConditionalGeneration`` run on text.

``test_kimi_k25_gpt_matches_hf``: the registry's build (``families/kimi_k25.py``: ``text_config``'s MLA + YaRN +
DeepSeek-style MoE through ``mla.py``'s hooks), loaded by ``convert.load_hf_into`` from the checkpoint's
``language_model.model.*`` names, gives transformers' log-probs in fp32 at TP 1, TP 2 (sequence parallel) and EP 2
(each rank half of the experts); rows of 20 tokens cross the tiny YaRN's original context (8); every parameter gets a
finite gradient and TP 2's gradients equal TP 1's; the export (``export.iter_hf_buckets``: the weight sync and
``--save-hf``) is the checkpoint's text model, names (``language_model.lm_head.weight`` included) and bits, and nothing
of its vision tower.

``test_kimi_k25_trainer_round_trip``: the Megatron trainer (2 ranks, GRPO, sequence parallel: TP 2 + EP 2 as Miles's
command, CP 2 x EP 2 and PP 2 with multi-latent attention under context / pipeline parallelism) gives
transformers' log-probs of its samples before training; after 2 steps ``--save-hf`` writes every tensor of the
checkpoint, the trained text model and the tower / projector copied bit for bit, and transformers loads it to the
trainer's weights; a torch_dist checkpoint saved and resumed restores them bitwise.

``test_embedded_engine_serves_kimi_k25``: the embedded engine serves the checkpoint (transformers' model on text):
greedy tokens = transformers' ``generate``; weights read back by the published names.

``test_kimi_k25_matches_hf_on_gpu`` (``gpu``): the same build at TP 1 in bf16 on one GPU under real torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _torchrun import torchrun_self
from family_workers import assert_bf16_parity

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
SEQ = 20


@pytest.fixture(scope="module")
def tiny_k25_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_kimi_k25 import build_tiny_kimi_k25

    return build_tiny_kimi_k25(tmp_path_factory.mktemp("tiny_k25"))


def _text_vocab(model_dir: Path) -> int:
    """The ids below the image / video token ids (transformers embeds those as id 0: not text)."""
    c = json.loads((model_dir / "config.json").read_text())
    return min(c["image_token_id"], c["video_token_id"], c["vision_start_token_id"], c["vision_end_token_id"])


def _text_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sorted(k for k in f.keys() if k.startswith("language_model."))


# fp32 CPU: the log-probs' distance to transformers, measured 9.5e-7 at TP 1, TP 2 and EP 2 (one fp32 ulp of the
# ~4.6-nat log-probs; a wrong rope, head layout or router rule gives > 1e-2):
# OMP_NUM_THREADS=1 python -m pytest -s tests/multiprocess/test_megatron_kimi_k25.py -k "not gpu"
LP_BOUND = 2e-6


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_kimi_k25_gpt_matches_hf(tiny_k25_dir: Path, tmp_path: Path, free_port: int, layout: str) -> None:
    from safetensors.torch import load_file

    ranks, ep = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (2, 2)}[layout]
    grads = {}
    for tp_run in ((1, 2) if layout == "tp2" else (ranks,)):
        out = tmp_path / f"gpt_{layout}_{tp_run}.json"
        proc = torchrun_self(HERE, tp_run, free_port + tp_run - 1, "gpt", str(tiny_k25_dir), str(out), str(ep),
                             str(_text_vocab(tiny_k25_dir)), timeout=400)
        assert proc.returncode == 0, proc.stdout[-4000:]
        res = json.loads(out.read_text())
        print(layout, tp_run, "max_lp_err", res["max_lp_err"], "max_abs_err", res["max_abs_err"])
        assert res["finite_ok"] and (ep > 1 or res["grads_ok"]), res
        assert res["max_lp_err"] < LP_BOUND, (layout, tp_run, res["max_lp_err"])
        text = _text_names(tiny_k25_dir)
        assert sorted(res["exported"]) == text and len(res["exported"]) == len(set(res["exported"]))
        assert sorted(res["same"]) == text                       # bit for bit, no tower tensor exported
        if ep == 1:
            grads[tp_run] = load_file(str(out.with_suffix(".grads.safetensors")))
    if layout == "tp2":             # TP 2 (sequence parallel) gradients after finish_grads equal TP 1's
        assert grads[1].keys() == grads[2].keys()
        print("grad rel", max(float((grads[2][n] - g).abs().max()) / max(float(g.abs().max()), 1e-6)
                              for n, g in grads[1].items()))
        for name, g in grads[1].items():
            err = float((grads[2][name] - g).abs().max())
            # measured 1.2e-6 of the tensor's largest entry (CPU, 2026-12-08; printed above); about twice
            assert err <= 2.5e-6 * max(float(g.abs().max()), 1e-6), (name, err, float(g.abs().max()))


# layout -> the Megatron flags of the trainer test (2 ranks, --sequence-parallel): Miles's recorded K2.5 command's TP
# with EP, and multi-latent attention under context parallelism (x EP: the EP group is the CP pair) and under
# pipeline parallelism (the tiny model's 3 layers as 2 + 1)
TRAINER_LAYOUTS = {
    "tp2_ep2": ("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"),
    "cp2_ep2": ("--context-parallel-size", "2", "--expert-model-parallel-size", "2"),
    "pp2": ("--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1"),
}


def _trainer_worker(model_dir: str, out: str, layout: str = "tp2_ep2") -> None:
    """2 ranks: the Megatron trainer (``TRAINER_LAYOUTS[layout]``) on 2 rollouts; transformers' log-probs of the
    same samples before training; --save-hf, torch_dist save and resume."""
    import torch
    import torch.distributed as dist
    from family_workers import hf_lm, save_and_resume
    from safetensors.torch import load_file
    from test_megatron import _all_logprobs
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    samples = random_samples(4, 4, seed=7, vocab=90)
    mine = samples[:8] if rank == 0 else samples[8:]
    res: dict = {}
    flags = ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
             "--num-steps-per-rollout", "1", "--rollout-temperature", "1.0", "--train-backend", "megatron",
             "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl", "--lr", "2e-3",
             "--lr-decay-style", "constant", "--micro-batch-size", "3", "--clip-grad", "1.0",
             *TRAINER_LAYOUTS[layout], "--sequence-parallel", "--expert-tensor-parallel-size", "1",
             "--moe-router-dtype", "fp32", "--save", str(Path(out).parent / "ckpt")]
    meg = build(model_dir, flags, group=group)
    res["layout"] = {k: getattr(meg.groups, k) for k in ("tp_size", "pp_size", "cp_size", "ep_size")}
    init = meg.state_dict_for_check()
    meg_lp = _all_logprobs(meg, samples)
    res["meg_metrics"] = [meg.train(mine, rid) for rid in range(2)]
    meg_sd, res["resumed_extra"], reloaded = save_and_resume(meg, mine, Path(out).parent / "hf_out")
    if rank == 0:
        hf = load_file(str(Path(model_dir) / "model.safetensors"))
        text = sorted(k for k in hf if k.startswith("language_model."))
        ref = hf_lm(model_dir, dtype=torch.float32, attn_implementation="eager")
        errs = []
        with torch.no_grad():
            for s, lp in zip(samples, meg_lp):
                logits = ref(input_ids=torch.tensor([s.tokens])).logits[0].float()
                n = s.response_length
                want = torch.log_softmax(logits[-n - 1:-1], -1).gather(-1, torch.tensor(s.tokens[-n:])[:, None])[:, 0]
                errs.append(float((want - lp).abs().max()))
        res["lp_max_abs_err"] = max(errs)
        res["ckpt_reload_bitwise"] = sorted(reloaded) == sorted(meg_sd) and all(
            torch.equal(reloaded[k], meg_sd[k]) for k in meg_sd)
        res["export_keys_equal"] = sorted(init) == text == sorted(meg_sd)
        res["export_bitwise"] = all(torch.equal(init[k], hf[k]) for k in text)
        res["trained"] = any(not torch.equal(meg_sd[k], hf[k]) for k in text)
        on_disk = load_file(str(Path(out).parent / "hf_out" / "model.safetensors"))
        res["save_hf_keys_equal"] = sorted(on_disk) == sorted(hf)
        res["save_hf_text_equal"] = all(torch.equal(on_disk[k], meg_sd[k]) for k in text)
        res["save_hf_towers_equal"] = all(torch.equal(on_disk[k], hf[k]) for k in hf if k not in text)
        saved = hf_lm(str(Path(out).parent / "hf_out"), dtype=torch.float32)
        live = {n: t.detach() for n, t in saved.state_dict().items()}
        res["save_hf_loads"] = (torch.equal(live["lm_head.weight"], meg_sd["language_model.lm_head.weight"])
                                and torch.equal(live["model.language_model.layers.0.self_attn.q_a_proj.weight"],
                                                meg_sd["language_model.model.layers.0.self_attn.q_a_proj.weight"]))
        torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", list(TRAINER_LAYOUTS))
def test_kimi_k25_trainer_round_trip(tiny_k25_dir: Path, tmp_path: Path, free_port: int, layout: str) -> None:
    import torch

    out = tmp_path / "trainer.pt"
    proc = torchrun_self(HERE, 2, free_port, "trainer", str(tiny_k25_dir), str(out), layout, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = torch.load(out, weights_only=False)
    flags = TRAINER_LAYOUTS[layout]
    assert res["layout"] == {k: int(flags[flags.index(f) + 1]) if f in flags else 1 for k, f in (
        ("tp_size", "--tensor-model-parallel-size"), ("pp_size", "--pipeline-model-parallel-size"),
        ("cp_size", "--context-parallel-size"), ("ep_size", "--expert-model-parallel-size"))}, res["layout"]
    print(layout, "trainer lp_max_abs_err", res["lp_max_abs_err"])
    assert res["export_keys_equal"] and res["export_bitwise"] and res["trained"], res
    assert res["save_hf_keys_equal"] and res["save_hf_text_equal"] and res["save_hf_towers_equal"], res
    assert res["save_hf_loads"], res
    assert res["ckpt_reload_bitwise"] and res["resumed_extra"]["rollout_id"] == 1, res
    assert res["lp_max_abs_err"] < LP_BOUND, res["lp_max_abs_err"]
    assert all(m["grad_norm"] > 0 for m in res["meg_metrics"]), res["meg_metrics"]


def test_embedded_engine_serves_kimi_k25(tiny_k25_dir: Path, tmp_path: Path) -> None:
    """``python -m miles.engine`` (the generic transformers path: Kimi_K25ForConditionalGeneration on text) generates
    transformers' greedy tokens, and reports weights by the checkpoint's published names (the names the trainer
    exports), an expert's included."""
    from family_workers import check_engine_greedy

    prompt = [5, 17, 23, 42, 8, 61, 9, 30, 12]     # with 8 new tokens the rows cross the YaRN original context (8)
    names = ("language_model.model.layers.1.mlp.gate.e_score_correction_bias", "language_model.lm_head.weight",
             "language_model.model.layers.2.mlp.experts.3.up_proj.weight")
    check_engine_greedy(tiny_k25_dir, tmp_path / "e.log", prompt, names)   # each name: 200, the checkpoint's values


@pytest.mark.gpu
def test_kimi_k25_matches_hf_on_gpu(tiny_k25_dir: Path, tmp_path: Path, free_port: int) -> None:
    """One GPU, bf16, TP 1 (real torchrun): the Megatron build of Kimi-K2.5's text model within bf16 rounding of
    transformers' (the same bound as the other MLA families' GPU test: twice transformers' own bf16 vs fp32)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "gpt_gpu.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port), str(HERE), "gpu", str(tiny_k25_dir), str(out),
           str(_text_vocab(tiny_k25_dir))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    print(res)
    assert_bf16_parity(res)


if __name__ == "__main__":
    if sys.argv[1] == "gpt":
        from family_workers import gpt_worker

        gpt_worker(sys.argv[2], sys.argv[3], ep=int(sys.argv[4]), seq=SEQ, text_vocab=int(sys.argv[5]))
    elif sys.argv[1] == "trainer":
        _trainer_worker(*sys.argv[2:5])
    elif sys.argv[1] == "gpu":
        from family_workers import gpu_worker

        gpu_worker(sys.argv[2], sys.argv[3], seq=SEQ, text_vocab=int(sys.argv[4]))
