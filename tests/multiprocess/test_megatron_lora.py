"""LoRA on the Megatron backend, on real gloo ranks (torchrun, CPU, 2 ranks).

``test_lora_tp2_matches_tp1_and_exports_merged``: the tiny Qwen3 with ``--lora-rank 4 --lora-alpha 8
--target-modules all-linear`` trains 2 rollouts at TP 2 and at TP 1 x DP 2 on the same samples. At step 0 the
KL to the (LoRA-free) reference is exactly 0 and the export (the weight sync's buckets) equals the HF checkpoint
bit for bit (B = 0). After training: the losses and merged exports of TP 2 and TP 1 agree; only the target
linears (q/k/v/o, gate/up/down) moved; the exported q/k/v and o_proj of layer 0 equal base + (alpha/r) B @ A
computed by hand from the gathered adapter shards; ``--save-hf`` writes exactly the exported (merged) weights,
and the adapter alone in HF PEFT layout (``adapter/``) whose base + (alpha/r) B @ A per module is that model.

``test_lora_sequence_parallel_matches_tp2``: TP 2 with ``--sequence-parallel`` (the rank-r activations gathered /
reduce-scattered over the sequence, the replicated factors' gradients summed over TP) and full recompute (the layout
of Miles's recorded Qwen3-4B LoRA command: every layer in a reentrant checkpoint, its input the frozen embedding's)
trains as TP 2 without either: the same losses, adapters and merged exports, and the merged weights are
base + (alpha/r) B @ A.

``test_lora_moe_tp2_sequence_parallel_matches_tp1``: the same with the routed experts' adapters (tiny Qwen3-MoE):
TP 2 + SP trains as TP 1 x DP 2.

``test_lora_pp2_and_cp2_match_dp2``: ``--pipeline-model-parallel-size 2`` (a layer and its adapters per stage) and
``--context-parallel-size 2`` each train as PP 1 x DP 2: the same metrics, adapters and merged export within fp32
rounding; both layers' merged weights are base + (alpha/r) B @ A; the targets-only export and the PEFT adapter hold
both layers (under PP: both stages').

``test_lora_resume_matches_uninterrupted``: TP 2, a checkpoint after rollout 0 (``--save``), a relaunch that
resumes and trains rollout 1 ends with the adapters, AdamW state and export of the uninterrupted run; also with
``--optimizer-cpu-offload`` (the adapters' AdamW on CPU) and at PP 2 (each rank its stage's adapters).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
FULL_RECOMPUTE = "--recompute-granularity,full,--recompute-method,uniform,--recompute-num-layers,1"
# test_lora_pp2_and_cp2_match_dp2: (metrics (relative), adapters, merged weights, merged relative L2) vs PP 1 x DP 2.
# Measured (2-core CPU box, ``pytest -s tests/multiprocess/test_megatron_lora.py -k pp2_and_cp2``), with the CPU
# AdamW foreach (main since 4e7b491) / fused: PP 2 3.2e-8 / 1.4e-7, 3.0e-6 / 8.1e-7, 2.1e-7 / 2.1e-7, 1.0e-6 /
# 9.8e-7; CP 2 1.1e-8 / 1.4e-7, 4.4e-6 / 2.3e-6, 1.8e-7 / 1.1e-7, 9.4e-7 / 7.2e-7; bounds at about twice the larger.
# Seen failing: the CP ranks' gradients left unsummed over CP measure 2.0e-1, 4.0e-2, 2.6e-2, 1.2; the stages' adapters
# named by their local layer index (not the global one) fail the names check.
BOUNDS = {"pp2": (3e-7, 6e-6, 4.2e-7, 2.1e-6), "cp2": (3e-7, 9e-6, 3.6e-7, 1.9e-6)}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _trainer(model_dir: str, group, extra: list[str]):
    from trainer_harness import build, flags

    return build(model_dir, flags("megatron", "lora", ["--num-rollout", "2", "--n-samples-per-prompt", "3", "--lr",
                                  "1e-2", "--lr-decay-style", "constant", "--use-kl-loss", "--kl-loss-coef", "0.1"],
                                  extra), group=group)


def _samples(rank: int, rid: int):
    """One group of 3 per rank, the same for every launch (the data of (rollout, rank))."""
    from trainer_harness import random_samples

    return random_samples(1, 3, seed=1000 * rid + rank, first_group=rank)


def _init():
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist, dist.new_group([0, 1], timeout=timedelta(seconds=60))


def _run_worker(model_dir: str, out: str, tp: str, save_dir: str, mode: str, extra: str = "") -> None:
    import torch

    from miles.trainer import lora
    from miles.trainer.megatron.parallel import local_optimizer

    dist, group = _init()
    rank = dist.get_rank(group)
    flags = ["--tensor-model-parallel-size", tp] + (["--save", save_dir, "--save-interval", "1"]
                                                    if save_dir != "-" else [])
    flags += [f for f in extra.split(",") if f]
    tr = _trainer(model_dir, group, flags)
    res: dict = {"init": tr.state_dict_for_check()}
    start = 0
    if mode == "resume":
        extra = tr.resume()
        start = extra["rollout_id"] + 1
    stop = 1 if mode == "first" else 2
    res["metrics"] = {}
    for rid in range(start, stop):
        res["metrics"][rid] = tr.train(_samples(rank, rid), rid)
        if save_dir != "-":
            tr.checkpoint(rid, extra={})
    res["final"] = tr.state_dict_for_check()
    res["adapters"] = lora.full_pairs(tr.lora)          # gathered over TP
    state = local_optimizer(tr.optimizer).state
    res["moments"] = {n: (state[p.lora_B]["exp_avg"].clone(), int(state[p.lora_B]["step"]))
                      for n, p in tr.lora.named_pairs()}
    if mode == "full":
        tr.save_hf(f"{out}.hf")
        # --lora-base-cpu-backup's export: the merged target linears only (every stage's under PP)
        res["trained"] = {n: t.detach().cpu().clone() for b in tr.iter_trained_weight_buckets(1 << 20) for n, t in b}
        res["trainable"] = lora.trainable_count(tr.lora)
    res["sequence_parallel"] = sum(p.sequence_parallel for _, p in tr.lora.named_pairs())
    torch.save(res, f"{out}.{rank}")
    dist.barrier(group)
    dist.destroy_process_group()


def _launch(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    from _torchrun import torchrun_self

    from miles.utils.net import find_free_port

    return torchrun_self(HERE, 2, find_free_port(), *args, timeout=timeout)


def _run(tmp_path: Path, model_dir: Path, name: str, tp: int, save: str = "-", mode: str = "full",
         extra: str = "") -> dict:
    import torch

    r = _launch("run", str(model_dir), str(tmp_path / name), str(tp), save, mode, extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(tmp_path / f"{name}.0", weights_only=False)


def test_lora_tp2_matches_tp1_and_exports_merged(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles.trainer.megatron.convert import read_hf_state_dict
    from miles.trainer.megatron.model import ModelShape

    base = read_hf_state_dict(tiny_model_dir)
    tp2 = _run(tmp_path, tiny_model_dir, "tp2", 2)
    tp1 = _run(tmp_path, tiny_model_dir, "tp1", 1)
    for res in (tp1, tp2):
        assert sorted(res["init"]) == sorted(base)
        assert all(torch.equal(res["init"][k], base[k]) for k in base)          # B = 0: the base model exactly
        assert res["metrics"][0]["kl_loss"] == 0.0                               # policy = reference at step 0
        assert res["metrics"][1]["kl_loss"] != 0.0                               # it moved
        for k in base:
            moved = not torch.equal(res["final"][k], base[k])
            assert moved == (k.split(".")[-2] in TARGETS), k
    diff = {k: (tp2["final"][k] - tp1["final"][k]).abs().max().item() for k in base}
    num = sum(((tp2["final"][k] - tp1["final"][k]) ** 2).sum().item() for k in base)
    den = sum(((tp1["final"][k] - base[k]) ** 2).sum().item() for k in base)
    print("figures:", [(rid, k, tp1["metrics"][rid][k], abs(tp2["metrics"][rid][k] - tp1["metrics"][rid][k]))
                       for rid in (0, 1) for k in ("loss", "pg_loss", "kl_loss", "grad_norm")],
          max(diff.values()), (num / den) ** 0.5)
    # Bounds at about twice what was measured (2026-12-07, CPU fp32; ``OMP_NUM_THREADS=1 python -m pytest -s
    # tests/multiprocess/test_megatron_lora.py -k tp2_matches_tp1`` prints it): the step metrics at most 7.5e-8 apart
    # (kl_loss, of 6.8e-4; the losses are near 0, so bounded absolutely), grad norms equal; after 2 AdamW steps of
    # lr 1e-2 (targets moved by up to 1.7e-2) TP 2 and TP 1 x DP 2 are 3.6e-7 apart (max abs), 1.7e-6 of the update's
    # L2 norm
    for rid in (0, 1):
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
            assert tp2["metrics"][rid][key] == pytest.approx(tp1["metrics"][rid][key], rel=2e-7, abs=1.5e-7), key
    assert max(diff.values()) < 7.2e-7 and (num / den) ** 0.5 < 3.4e-6, (max(diff.values()), (num / den) ** 0.5)

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir))
    _check_merged(tp2, base, shape)
    saved = load_file(str(tmp_path / "tp2.hf" / "model.safetensors"))
    assert all(torch.equal(saved[k].float(), tp2["final"][k]) for k in base)
    # the adapter alone, HF PEFT names and config: base + (alpha / r) B @ A per HF module is the merged model
    adapter = load_file(str(tmp_path / "tp2.hf" / "adapter" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "tp2.hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    modules = {k.removesuffix(".lora_A.weight") for k in adapter if k.endswith(".lora_A.weight")}
    assert len(modules) == 7 * shape.num_layers
    for m in modules:
        hf = m.removeprefix("base_model.model.") + ".weight"
        merged = base[hf] + 2.0 * adapter[m + ".lora_B.weight"] @ adapter[m + ".lora_A.weight"]
        torch.testing.assert_close(merged, saved[hf].float(), rtol=0, atol=0)     # measured: bit for bit (2026-12-07)


def _distances(res: dict, ref: dict, base: dict) -> tuple[float, float, float, float]:
    """Two ``_run`` results apart: the largest relative difference of the two steps' loss metrics, the largest of
    the adapters', the largest of the merged weights', and the merged weights' relative L2 (over ``ref``'s update
    from ``base``)."""
    metric = max(abs(res["metrics"][rid][k] - ref["metrics"][rid][k]) / max(1.0, abs(ref["metrics"][rid][k]))
                 for rid in (0, 1) for k in ("loss", "pg_loss", "kl_loss", "grad_norm"))
    adapters = max((x2 - x).abs().max().item() for n, pair in ref["adapters"].items()
                   for x, x2 in zip(pair, res["adapters"][n]))
    diff = max((res["final"][k] - ref["final"][k]).abs().max().item() for k in base)
    num = sum(((res["final"][k] - ref["final"][k]) ** 2).sum().item() for k in base)
    den = sum(((ref["final"][k] - base[k]) ** 2).sum().item() for k in base)
    return metric, adapters, diff, (num / den) ** 0.5


def test_lora_pp2_and_cp2_match_dp2(tiny_model_dir: Path, tmp_path: Path) -> None:
    """PP 2 (each stage holds one of the 2 layers and its adapters, seeded by the global layer index) and CP 2 (each
    rank two chunks of every sequence, the adapters' gradients summed over DP x CP) train as PP 1 x DP 2 on the same
    samples: the same step metrics, adapters and merged export (under PP every stage's layers under their global
    names); the merged weights of both layers are base + (alpha/r) B @ A; the targets-only export
    (--lora-base-cpu-backup's) and the PEFT adapter of --save-hf cover every layer."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles.trainer.megatron.convert import read_hf_state_dict
    from miles.trainer.megatron.model import ModelShape

    base = read_hf_state_dict(tiny_model_dir)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir))
    dp2 = _run(tmp_path, tiny_model_dir, "dp2", 1)
    targets = sorted(k for k in base if k.split(".")[-2] in TARGETS)
    for name, extra in (("pp2", "--pipeline-model-parallel-size,2"), ("cp2", "--context-parallel-size,2")):
        res = _run(tmp_path, tiny_model_dir, name, 1, extra=extra)
        assert sorted(res["init"]) == sorted(base) and all(torch.equal(res["init"][k], base[k]) for k in base), name
        assert res["metrics"][0]["kl_loss"] == 0.0 and res["metrics"][1]["kl_loss"] != 0.0, name
        assert sorted(res["adapters"]) == sorted(dp2["adapters"]) and res["trainable"] == dp2["trainable"], name
        for k in base:
            assert (not torch.equal(res["final"][k], base[k])) == (k in targets), (name, k)
        metric, adapters, diff, rel = _distances(res, dp2, base)
        print(f"lora {name} vs dp2: metrics {metric:.2e}, adapters {adapters:.2e}, merged weights {diff:.2e} "
              f"(relative L2 {rel:.2e})")
        bound = BOUNDS[name]
        assert metric < bound[0] and adapters < bound[1] and diff < bound[2] and rel < bound[3], (
            name, metric, adapters, diff, rel)
        _check_merged(res, base, shape)
        _check_merged(res, base, shape, layer=1)                                # PP 2: the second stage's layer
        assert sorted(res["trained"]) == targets, name
        assert all(torch.equal(res["trained"][k], res["final"][k]) for k in targets), name
        saved = load_file(str(tmp_path / f"{name}.hf" / "model.safetensors"))
        assert sorted(saved) == sorted(base) and all(torch.equal(saved[k].float(), res["final"][k]) for k in base)
        adapter = load_file(str(tmp_path / f"{name}.hf" / "adapter" / "adapter_model.safetensors"))
        assert len({k.removesuffix(".lora_A.weight") for k in adapter if k.endswith(".lora_A.weight")}) == 7 * 2


def _check_merged(res: dict, base: dict, shape, layer_mods: tuple[str, ...] = (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
        layer: int = 0) -> None:
    """The exported weights of ``layer``'s ``layer_mods`` are base + (alpha/r) B @ A of the gathered adapters."""
    import torch

    from miles.trainer.megatron.convert import megatron_to_hf

    for layer_mod in layer_mods:
        name = f"decoder.layers.{layer}.{layer_mod}"
        a, b = res["adapters"][name]
        delta = (b @ a) * 2.0                                                   # alpha / r = 8 / 4
        # the fp32 rounding of base + delta: measured 3.7e-9 (deltas up to 2.2e-2; 2026-12-07)
        for hf, d in megatron_to_hf(name + ".weight", delta, shape):
            torch.testing.assert_close(res["final"][hf] - base[hf], d, rtol=0, atol=7.5e-9)


def test_lora_sequence_parallel_matches_tp2(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from miles.trainer.megatron.convert import read_hf_state_dict
    from miles.trainer.megatron.model import ModelShape

    base = read_hf_state_dict(tiny_model_dir)
    tp2 = _run(tmp_path, tiny_model_dir, "tp2", 2, mode="sp")
    sp = _run(tmp_path, tiny_model_dir, "sp", 2, mode="sp", extra="--sequence-parallel," + FULL_RECOMPUTE)
    assert sp["sequence_parallel"] == len(sp["adapters"]) > 0 and tp2["sequence_parallel"] == 0
    assert sp["metrics"][1]["kl_loss"] != 0.0
    metric, adapters, diff, rel = _distances(sp, tp2, base)
    print(f"lora sp vs tp2: metrics {metric:.2e}, adapters {adapters:.2e}, merged weights {diff:.2e} "
          f"(relative L2 {rel:.2e})")
    # measured (2-core CPU box, ``pytest -s tests/multiprocess/test_megatron_lora.py -k sequence_parallel``): metrics
    # 1.2e-9 apart (relative), adapters 7.6e-6 (Adam's normalisation amplifies rounding where a gradient is near 0),
    # merged weights 3.1e-7 (relative L2 1.4e-6), with and without the full recompute; bounds at about twice that.
    # The replicated factors' gradients left unsummed over TP (each rank's part of the sequence only) measure 5.2e-2,
    # 4.0e-2, 1.9e-2 (4.2e-1); without the embedding's output marked, the recomputed layers' backward fails
    assert metric < 2.5e-9 and adapters < 1.5e-5, (metric, adapters)
    assert diff < 6e-7 and rel < 3e-6, (diff, rel)
    _check_merged(sp, base, ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir)))


def test_lora_moe_tp2_sequence_parallel_matches_tp1(tmp_path: Path) -> None:
    """The tiny Qwen3-MoE (4 experts top-2; MoE under TP needs --sequence-parallel) with LoRA on every linear, the
    routed experts' included: TP 2 + SP (each TP rank routes its part of the sequence through whole experts, the
    experts' adapters summed over the expert-DP group that spans the TP ranks) trains as TP 1 x DP 2, and merges to
    base + (alpha/r) B @ A."""
    from transformers import AutoConfig

    from miles.trainer.megatron.convert import read_hf_state_dict
    from miles.trainer.megatron.model import ModelShape
    from miles.utils.tiny_model import build_tiny_moe_model

    model_dir = build_tiny_moe_model(tmp_path / "moe")
    base = read_hf_state_dict(model_dir)
    router = "--moe-router-dtype,fp32,--moe-aux-loss-coeff,0"
    tp1 = _run(tmp_path, model_dir, "tp1", 1, mode="sp", extra=router)
    sp = _run(tmp_path, model_dir, "sp", 2, mode="sp", extra=router + ",--sequence-parallel")
    assert sp["sequence_parallel"] > 0 and any(".local_experts." in n for n in sp["adapters"])
    metric = max(abs(sp["metrics"][rid][k] - tp1["metrics"][rid][k]) / max(1.0, abs(tp1["metrics"][rid][k]))
                 for rid in (0, 1) for k in ("loss", "pg_loss", "kl_loss", "grad_norm"))
    diff = max((sp["final"][k] - tp1["final"][k]).abs().max().item() for k in base)
    num = sum(((sp["final"][k] - tp1["final"][k]) ** 2).sum().item() for k in base)
    den = sum(((tp1["final"][k] - base[k]) ** 2).sum().item() for k in base)
    moved = [k for k in base if ".experts." in k and not (sp["final"][k] - base[k]).eq(0).all()]
    print(f"lora moe sp vs tp1: metrics {metric:.2e}, merged weights {diff:.2e} (relative L2 {(num / den) ** 0.5:.2e}),"
          f" {len(moved)} expert weights moved")
    assert moved and sp["metrics"][1]["kl_loss"] != 0.0
    # measured (2-core CPU box, ``pytest -s tests/multiprocess/test_megatron_lora.py -k moe_tp2``): metrics 5.4e-8
    # apart (relative), merged weights 1.9e-7 (relative L2 8.9e-7); bounds at about twice that
    assert metric < 1.1e-7 and diff < 4e-7 and (num / den) ** 0.5 < 1.8e-6, (metric, diff, (num / den) ** 0.5)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    _check_merged(sp, base, shape, layer_mods=("self_attention.linear_qkv", "self_attention.linear_proj",
                                               "mlp.experts.local_experts.0.linear_fc1",
                                               "mlp.experts.local_experts.1.linear_fc2"))


@pytest.mark.parametrize("layout", ["adamw", "cpu_offload", "pp2"])
def test_lora_resume_matches_uninterrupted(tiny_model_dir: Path, tmp_path: Path, layout: str) -> None:
    """(also with --optimizer-cpu-offload: the adapters' AdamW state on CPU, saved and loaded with them; and at PP 2:
    each rank saves and loads its stage's adapters)"""
    import torch

    extra = {"adamw": "", "cpu_offload": "--optimizer-cpu-offload", "pp2": "--pipeline-model-parallel-size,2"}[layout]
    tp = 1 if layout == "pp2" else 2
    full = _run(tmp_path, tiny_model_dir, "full", tp, extra=extra)
    ckpt = str(tmp_path / "ckpt")
    first = _run(tmp_path, tiny_model_dir, "first", tp, ckpt, "first", extra=extra)
    assert (Path(ckpt) / "iter_0000000" / "lora" / "rank_00001.pt").is_file()
    resumed = _run(tmp_path, tiny_model_dir, "resumed", tp, ckpt, "resume", extra=extra)
    assert list(resumed["metrics"]) == [1]
    assert first["metrics"][0]["loss"] == full["metrics"][0]["loss"]
    assert resumed["metrics"][1]["loss"] == full["metrics"][1]["loss"]
    for k in full["final"]:
        assert torch.equal(resumed["final"][k], full["final"][k]), k
    for n, (m, step) in full["moments"].items():
        assert torch.equal(resumed["moments"][n][0], m) and resumed["moments"][n][1] == step == 2


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _run_worker(*sys.argv[2:8])
