"""Multi-latent attention (tiny GLM-4.7-Flash / DeepSeek-V3 / Kimi-K2 / JoyAI-LLM-Flash, ``miles.utils.tiny_mla``) on
the Megatron backend, on
real gloo ranks (torchrun, CPU).

``test_mla_gpt_matches_hf``: megatron-core's ``MLASelfAttention`` (local spec, our SDPA core attention) with the
DeepSeek-style MoE (sigmoid router with expert bias, top-k scaling, shared experts, a dense first layer) built from
config.json and loaded by our converter gives transformers' logits in fp32, at TP 1 and at TP 2 (sequence
parallel, experts whole on each TP rank); every parameter gets a finite gradient; the weight export (TP shards
gathered, ``export.iter_hf_buckets``) equals the checkpoint's safetensors bit for bit, names included; the TP 2
gradients (after ``parallel.finish_grads``) equal TP 1's.

``test_mla_trainer_parity_with_fsdp``: 2 ranks, each family. The FSDP backend (HF ``Glm4MoeLiteForCausalLM`` /
``DeepseekV3ForCausalLM`` under FSDP2, DP 2) and the Megatron trainer (TP 2, sequence parallel, experts whole on
each TP rank) train the same 2 rollouts (GRPO with KL loss, KL reward, entropy bonus, TIS): log-probs before
training, step metrics and the update after 2 steps agree; the export of the untrained model equals the checkpoint
bit for bit (fp32 and bf16); ``--save-hf`` loads in transformers to the trained weights; a torch_dist checkpoint
saved and resumed restores them bitwise.

``test_mla_parallel_layouts_match_fsdp``: the same comparison (``family_workers.parity_worker``) for Kimi-K2 with
multi-latent attention under context parallelism (CP 2), pipeline parallelism (PP 2, uneven) and CP 2 x EP 2 with
the all-to-all CP attention, on 2 ranks against FSDP DP 2. The ``gpu`` tests: the CP attention on MLA's widths on one
GPU (bf16), and CP 2 / PP 2 against FSDP on two GPUs (NCCL, bf16).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _torchrun import torchrun_self
from family_workers import assert_bf16_parity
from trainer_harness import PRESETS

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def _torchrun(nproc: int, port: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return torchrun_self(HERE, nproc, port, *args, timeout=timeout)


def _parity_worker(model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from family_workers import save_and_resume, update_distance
    from safetensors.torch import load_file
    from test_megatron import _all_logprobs, _flags
    from test_megatron_moe import split_fused_experts
    from trainer_harness import PRESETS, build, random_samples

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    samples = random_samples(4, 4, seed=7, vocab=90)
    mine = samples[:8] if rank == 0 else samples[8:]
    res: dict = {}
    fsdp = build(model_dir, _flags("fsdp", 1), group=group)
    fsdp_lp = _all_logprobs(fsdp, samples)
    res["fsdp_metrics"] = [fsdp.train(mine, rid) for rid in range(2)]
    fsdp_sd = split_fused_experts(fsdp.state_dict_for_check())
    del fsdp
    flags = ("--sequence-parallel", "--expert-tensor-parallel-size", "1", *PRESETS["mla"], "--moe-router-dtype",
             "fp32", "--save", str(Path(out).parent / "ckpt"))
    meg = build(model_dir, _flags("megatron", 2, megatron_flags=flags), group=group)
    init = meg.state_dict_for_check()
    init_bf16 = {n: t.detach().cpu().clone() for b in meg.iter_weight_buckets(4096, torch.bfloat16) for n, t in b}
    meg_lp = _all_logprobs(meg, samples)
    res["meg_metrics"] = [meg.train(mine, rid) for rid in range(2)]
    meg_sd, res["resumed_extra"], reloaded = save_and_resume(meg, mine, Path(out).parent / "hf_out")
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = load_file(str(Path(model_dir) / "model.safetensors"))
        res["ckpt_reload_bitwise"] = sorted(reloaded) == sorted(meg_sd) and all(
            torch.equal(reloaded[k], meg_sd[k]) for k in meg_sd)
        hf_model = AutoModelForCausalLM.from_pretrained(Path(out).parent / "hf_out")
        saved = split_fused_experts({n: t.detach().cpu() for n, t in hf_model.state_dict().items()})
        res["save_hf_equal"] = sorted(saved) == sorted(meg_sd) and all(torch.equal(saved[k], meg_sd[k]) for k in meg_sd)
        res["export_keys_equal"] = sorted(init) == sorted(hf) == sorted(meg_sd)
        res["export_bitwise"] = all(torch.equal(init[k], hf[k]) for k in hf)
        res["export_bf16_bitwise"] = all(torch.equal(init_bf16[k], hf[k].bfloat16()) for k in hf)
        keys = sorted(fsdp_sd)                          # the parameters (the FSDP export has no buffers)
        res["fsdp_keys_missing"] = sorted(set(hf) - set(keys))
        res.update(update_distance(meg_sd, fsdp_sd, hf, keys))
        res["lp_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(fsdp_lp, meg_lp))
        torch.save(res, out)
    dist.destroy_process_group()


def _gpt_worker(model_dir: str, out: str, ep: int = 1) -> None:
    """TP = world size (``ep`` 1), or TP 1 x EP = world size (the experts split over the ranks, all-to-all)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.trainer.megatron import compat, convert, export, model, moe, parallel
    from miles.utils.model_dir import load_config

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world // ep
    cpu = torch.device("cpu")
    groups = parallel.init_parallel(tp_size=tp, num_trainer_ranks=world, seed=1, device=cpu, ep_size=ep)
    compat.apply_moe_compat()
    compat.apply_moe_cpu_compat()
    shape = model.ModelShape.from_hf_config(load_config(model_dir))      # kimi_k2 registered (hf_aliases)
    padded = model.padded_vocab_size(shape.vocab_size, 128, tp)
    kw = moe.config_kwargs(shape, moe.MoeOptions(), ep=ep, etp=1, te=False)
    config = model.transformer_config(shape, tp_size=tp, device=cpu, moe=kw, sequence_parallel=tp > 1)
    gpt = model.build_gpt_model(shape, config, padded_vocab=padded, device=cpu)
    hf_sd = convert.read_hf_state_dict(model_dir)
    convert.load_hf_into(gpt, hf_sd, shape, padded, groups.tp_rank, tp, ep_rank=groups.ep_rank, ep_size=ep)

    torch.manual_seed(0)
    ids = torch.randint(4, shape.vocab_size, (2, 12))
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)
    hidden = gpt(ids, pos, attention_mask=None)                       # [s / tp (sequence parallel), b, h]
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import (
            gather_from_sequence_parallel_region,
            gather_from_tensor_model_parallel_region,
        )

        hidden = gather_from_sequence_parallel_region(hidden)        # backward: the TP ranks' parts summed
    local = hidden.transpose(0, 1) @ model.output_weight(gpt).t()     # [b, s, V / tp]
    full = gather_from_tensor_model_parallel_region(local) if tp > 1 else local
    logits = full[..., :shape.vocab_size]
    logits.square().mean().backward()                                 # the same loss on every TP rank
    if ep == 1:
        parallel.finish_grads(gpt, groups)                            # TP sums (sequence-parallel norms, router)
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gpt.parameters()
                   if p.requires_grad)       # a frozen part (DSA's indexer, test_megatron_dsa.py) has none
    logits = logits.detach()

    exported = [pair for bucket in export.iter_hf_buckets(gpt, shape, groups, device=cpu, bucket_bytes=1 << 14)
                for pair in bucket]
    disk = load_file(str(Path(model_dir) / "model.safetensors"))
    same = [n for n, t in exported if n in disk and disk[n].dtype == t.dtype and torch.equal(disk[n], t)]
    with torch.no_grad():                  # the full gradients in HF names: the export of p.grad in place of p
        for p in gpt.parameters() if ep == 1 else ():
            p.data, p.grad = (p.grad if p.grad is not None else torch.zeros_like(p)), p.data
        grads = {n: t.clone() for bucket in export.iter_hf_buckets(gpt, shape, groups, device=cpu, bucket_bytes=1 << 14)
                 for n, t in bucket if not n.endswith("e_score_correction_bias")}
    if rank == 0 and ep == 1:
        from safetensors.torch import save_file

        save_file(grads, str(Path(out).with_suffix(".grads.safetensors")))

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    if rank == 0:
        Path(out).write_text(json.dumps({
            "max_abs_err": float((logits - ref).abs().max()), "ref_scale": float(ref.abs().max()),
            "grads_ok": grads_ok, "exported": [n for n, _ in exported], "same": same, "disk": sorted(disk)}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_dsv3_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_mla import build_tiny_mla_model

    # grouped routing (2 groups of 2 experts, 1 chosen: top-2 in a group, as HF scores groups), no q LoRA, yarn rope
    # (factor 4 over 8 original positions: the 12-token rows use the ramp and the softmax mscale)
    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_dsv3"), model_type="deepseek_v3", n_group=2,
                                topk_group=1, q_lora_rank=None, routed_scaling_factor=2.5,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                                max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny_kimi_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_mla import KIMI_K2_YARN, build_tiny_mla_model

    # Kimi-K2 (config.json's model_type kimi_k2, DeepSeek-V3's architecture): its yarn (factor 32, beta_fast =
    # beta_slow = 1) over 8 original positions, one expert group, q LoRA
    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_kimi"), model_type="kimi_k2", rope_scaling=KIMI_K2_YARN,
                                routed_scaling_factor=2.827, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_joyai_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_mla import build_tiny_mla_model

    # JoyAI-LLM-Flash (config.json's model_type joyai_llm_flash, DeepSeek-V3's architecture; models/
    # JoyAI-LLM-Flash.json): q LoRA, one expert group, routed scaling 2.5, rope theta 32e6 without scaling
    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_joyai"), model_type="joyai_llm_flash",
                                routed_scaling_factor=2.5, rope_theta=32000000.0)


FAMILY_DIRS = {"glm": "tiny_glm_dir", "dsv3": "tiny_dsv3_dir", "kimi": "tiny_kimi_dir", "joyai": "tiny_joyai_dir"}
# fp32 rounding of another op order only, measured (CPU, 2026-12-08, ``pytest -s -k "mla_gpt_matches_hf or
# mla_expert_parallel"`` prints them): logits 1.2e-7 .. 1.8e-7 from transformers' (of 0.6; TP 1, TP 2 + SP, EP 2),
# TP 2's gradients 6.7e-7 .. 1.4e-6 (kimi) of each tensor's largest entry from TP 1's; bounds at about twice those.
# A wrong head layout, rope order or router rule gives > 1e-2
LOGIT_BOUND = 4e-7
GRAD_REL_BOUND = 3e-6


@pytest.mark.parametrize("family", ["glm", "dsv3", "kimi", "joyai"])
def test_mla_gpt_matches_hf(request, tmp_path: Path, free_port: int, family: str) -> None:
    from safetensors.torch import load_file

    model_dir = request.getfixturevalue(FAMILY_DIRS[family])
    grads = {}
    for tp in (1, 2):
        out = tmp_path / f"gpt_tp{tp}.json"
        proc = _torchrun(tp, free_port + tp - 1, "gpt", str(model_dir), str(out))
        assert proc.returncode == 0, proc.stdout[-4000:]
        res = json.loads(out.read_text())
        assert res["grads_ok"], res
        print(family, "tp", tp, "max_abs_err", res["max_abs_err"], "ref_scale", res["ref_scale"])
        assert res["max_abs_err"] < LOGIT_BOUND * max(res["ref_scale"], 1.0), (tp, res["max_abs_err"])
        assert sorted(res["exported"]) == res["disk"] and len(res["exported"]) == len(set(res["exported"]))
        assert sorted(res["same"]) == res["disk"]                # bit for bit, e_score_correction_bias included
        grads[tp] = load_file(str(out.with_suffix(".grads.safetensors")))
    # TP 2 (sequence parallel) gradients after finish_grads equal TP 1's: the latent norms (complete on every TP
    # rank, summed over TP only for their sequence parts), the router, the shared experts, the sharded projections
    assert grads[1].keys() == grads[2].keys()
    print(family, "grad rel", max(float((grads[2][n] - g).abs().max()) / max(float(g.abs().max()), 1e-6)
                                  for n, g in grads[1].items()))
    for name, g in grads[1].items():
        err = float((grads[2][name] - g).abs().max())
        assert err <= GRAD_REL_BOUND * max(float(g.abs().max()), 1e-6), (name, err, float(g.abs().max()))


@pytest.mark.parametrize("family", ["glm", "dsv3", "kimi", "joyai"])
def test_mla_expert_parallel_matches_hf(request, tmp_path: Path, free_port: int, family: str) -> None:
    """EP 2 (each rank half of the experts, all-to-all dispatcher): the same logits, and the export gathered over EP
    equals the checkpoint bit for bit (the routers' expert bias exported with the non-expert tensors)."""
    out = tmp_path / "gpt_ep2.json"
    proc = _torchrun(2, free_port, "gpt", str(request.getfixturevalue(FAMILY_DIRS[family])), str(out), "2")
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    print(family, "ep2 max_abs_err", res["max_abs_err"], res["ref_scale"])
    assert res["grads_ok"] and res["max_abs_err"] < LOGIT_BOUND * max(res["ref_scale"], 1.0), res["max_abs_err"]
    assert sorted(res["exported"]) == res["disk"] and sorted(res["same"]) == res["disk"]


@pytest.mark.parametrize("family", ["glm", "dsv3", "kimi", "joyai"])
def test_mla_trainer_parity_with_fsdp(request, tmp_path: Path, free_port: int, family: str) -> None:
    """GLM-4.7-Flash, DeepSeek-V3 (grouped routing, no q LoRA, YaRN rope), Kimi-K2 (model_type kimi_k2:
    transformers' DeepSeek-V3 under FSDP2 via hf_aliases, its YaRN rope over rows longer than the tiny original
    context) and JoyAI-LLM-Flash (model_type joyai_llm_flash, the same alias; rope theta 32e6, no scaling)."""
    import torch
    from family_workers import check_parity

    out = tmp_path / "parity.pt"
    proc = _torchrun(2, free_port, "parity", str(request.getfixturevalue(FAMILY_DIRS[family])), str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = torch.load(out, weights_only=False)
    print(family, {k: res[k] for k in ("lp_max_abs_diff", "update_max_abs_diff", "update_rel_l2", "update_worst")})
    check_parity(res, lp_bound=LP_BOUND, metric_bound=METRIC_BOUND, update_bound=UPDATE_BOUND, rel_bound=REL_BOUND)


# measured (2026-12-07, OMP_NUM_THREADS=1 python -m pytest -s tests/multiprocess/test_megatron_mla.py -k
# "trainer_parity_with_fsdp"): log-probs 9.5e-7 (GLM-4.7-Flash, DeepSeek-V3) / 4.8e-7 (Kimi-K2) apart; the update
# after 2 steps 1.5e-5 / 1.1e-5 / 4.8e-6 (max abs), 1.5e-5 / 1.8e-5 / 9.1e-6 (relative L2). JoyAI-LLM-Flash (same day,
# -k "trainer_parity_with_fsdp and joyai"): log-probs 9.5e-7, update 4.8e-6 (max abs), 7.4e-6 (relative L2). About
# twice the largest. Re-measured 2026-12-07 (the same figures): step metrics 7.8e-8 relative at most.
LP_BOUND, METRIC_BOUND, UPDATE_BOUND, REL_BOUND = 2e-6, 1.6e-7, 3e-5, 4e-5


# ------------------------------------------------------------------------------------------- CP, PP, CP x EP
MLA_FLAGS = (*PRESETS["mla"], "--moe-router-dtype", "fp32")
LAYOUTS = {  # id: Megatron flags on 2 ranks (TP 1, --sequence-parallel as the recorded commands pass it)
    "cp2": ("--context-parallel-size", "2"),
    # Kimi-K2's uneven split (--decoder-last-pipeline-num-layers), here 2 + 1 of the tiny model's 3 layers
    "pp2": ("--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1"),
    # the EP group is the CP pair; Ulysses all-to-all over heads with values narrower than the keys
    "cp2_ep2_a2a": ("--context-parallel-size", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size", "2",
                    "--expert-tensor-parallel-size", "1"),
}
SIZES = {"cp2": (1, 2, 1), "pp2": (2, 1, 1), "cp2_ep2_a2a": (1, 2, 2)}      # (PP, CP, EP)
# Measured (2026-12-07, CPU fp32, 2 gloo ranks, the box shared with other jobs; OMP_NUM_THREADS=1 python -m pytest -s
# tests/multiprocess/test_megatron_mla.py -k "parallel_layouts_match_fsdp and not gpu"): log-probs 4.8e-7 in each
# layout; update max 5.1e-6 (cp2) / 6.0e-6 (pp2) / 7.7e-6 (cp2_ep2_a2a), relative L2 8.8e-6 / 9.6e-6 / 1.1e-5.
# Re-measured 2026-12-07 (the same figures): step metrics 6.0e-8 relative at most. Bounds: about twice the largest.
LP_BOUND_LAYOUTS, METRIC_BOUND_LAYOUTS, UPDATE_BOUND_LAYOUTS, REL_BOUND_LAYOUTS = 1e-6, 1.2e-7, 1.6e-5, 2.3e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_parallel_layouts_match_fsdp(tiny_kimi_dir: Path, tmp_path: Path, free_port: int, layout: str) -> None:
    """Kimi-K2 (MLA with its YaRN rope over rows longer than the tiny original context, the DeepSeek-style MoE) under
    context parallelism (each rank its load-balanced chunks: megatron-core's MLA picks their rotary angles, the
    core attention gathers K/V or all-to-alls the heads), pipeline parallelism (2 stages, uneven) and CP 2 x EP 2
    (a2a), 2 ranks, against the FSDP backend over the same ranks (DP 2): log-probs before training, the step metrics
    and the update after 2 steps; the export bitwise (fp32 and bf16), ``--save-hf`` and a checkpoint resume."""
    from family_workers import check_parity, launch

    res = launch(HERE, 2, free_port, "layout", tiny_kimi_dir, tmp_path / "parity.pt", ",".join(LAYOUTS[layout]),
                 timeout=900)
    pp, cp, ep = SIZES[layout]
    assert res["layout"] == {"tp_size": 1, "pp_size": pp, "cp_size": cp, "ep_size": ep, "dp_size": 2 // (pp * cp)}
    print(layout, {k: res[k] for k in ("lp_max_abs_diff", "update_max_abs_diff", "update_rel_l2", "update_worst")})
    check_parity(res, lp_bound=LP_BOUND_LAYOUTS, metric_bound=METRIC_BOUND_LAYOUTS, update_bound=UPDATE_BOUND_LAYOUTS,
                 rel_bound=REL_BOUND_LAYOUTS)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["glm", "dsv3", "kimi", "joyai"])
def test_mla_matches_hf_on_gpu_bf16(request, tmp_path: Path, free_port: int, family: str) -> None:
    """bf16 on one GPU, TP 1 (Kimi-K2: MLA, YaRN, the sigmoid router with expert bias and top-k scaling): Megatron's
    logits are as far from transformers' bf16 logits as transformers' own bf16 logits are from its fp32 ones, within
    a factor of 2 (both are bf16 roundings of the same function; a wrong layout gives > 1e-2 in fp32 already)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = tmp_path / "gpu.json"
    proc = _torchrun(1, free_port, "gpu", str(request.getfixturevalue(FAMILY_DIRS[family])), str(out))
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    print(family, res)
    assert_bf16_parity(res)


def _cp_attention_worker(out: str) -> None:
    """One rank on GPU 0 (NCCL): ``context_parallel.attention`` at DeepSeek-V3's MLA widths (keys 128 + 64, values
    128, as many key as query heads; a CP group of one rank holds chunks 0 and 1 of 2, so the all_gather path
    attends chunk 1 through the lower-right causal mask, the a2a path through its all-to-all) against plain causal
    SDPA, bf16, forward and backward."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from miles.trainer.megatron import context_parallel

    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    b, heads, s, d, dv = 2, 16, 512, 192, 128
    q, k, v = (torch.randn(b, heads, s, w, device=dev, dtype=torch.bfloat16, requires_grad=True) for w in (d, d, dv))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5)
    grads_ref = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    res = {}
    for comm in ("all_gather", "a2a"):
        o = context_parallel.attention(q, k, v, comm=comm, group=dist.group.WORLD, scale=d ** -0.5)
        grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        res[comm] = {"shape": list(o.shape), "out": float((o.float() - ref.float()).abs().max()),
                     "scale": float(ref.float().abs().max()),
                     "grad": max(float((a.float() - r.float()).abs().max() / r.float().abs().max())
                                 for a, r in zip(grads, grads_ref))}
    Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.mark.gpu
def test_mla_cp_attention_on_gpu(tmp_path: Path, free_port: int) -> None:
    """The CP attention on MLA's widths on one GPU in bf16 (SDPA's kernels take values narrower than the keys, with
    the lower-right causal mask too): within bf16 rounding of plain SDPA."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "mla_cp_attention.json"
    proc = _torchrun(1, free_port, "cp_attention", "-", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    print(res)
    for comm, r in res.items():
        # bf16: ~3 significant digits; another kernel (masked memory-efficient vs plain causal) rounds differently
        # (the bound of test_megatron_cp.py::test_cp_attention_kernels_on_gpu; not run here, no GPU)
        assert r["shape"] == [2, 16, 512, 128], (comm, r)
        assert r["out"] < 2e-2 * max(r["scale"], 1.0) and r["grad"] < 2e-2, (comm, r)


@pytest.mark.gpu
def test_mla_parallel_layouts_on_two_gpus(tiny_kimi_dir: Path, tmp_path: Path, free_port: int) -> None:
    """Kimi-K2's Megatron trainer in bf16 (NCCL, one GPU per rank) at CP 2 and PP 2 on 2 GPUs against the same
    trainer on one GPU (the same micro-batches: ``family_workers.train_worker``): within bf16 rounding. (Against
    the Megatron trainer, not FSDP: the FSDP backend's varlen flash attention on GPU takes no values narrower than
    the keys, which MLA has.)"""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from family_workers import compare_runs, launch

    runs = {name: launch(HERE, nproc, free_port + i, "train_gpu", tiny_kimi_dir, tmp_path / f"{name}.pt",
                         ",".join((*MLA_FLAGS, *flags)), timeout=900)
            for i, (name, nproc, flags) in enumerate((("one", 1, ()), ("cp2", 2, LAYOUTS["cp2"]),
                                                      ("pp2", 2, LAYOUTS["pp2"])))}
    assert runs["one"]["bf16"] and runs["cp2"]["cp_size"] == 2 and runs["pp2"]["layout"][1] == 2, runs["pp2"]["layout"]
    for name in ("cp2", "pp2"):
        res = compare_runs(runs["one"], runs[name])
        print(name, res)
        # Never run yet (no GPU here): the bounds of the dense model's 2-GPU CP parity (test_megatron_cp.py::
        # test_cp2_parity_with_fsdp_on_two_gpus: about twice the one-GPU H200 bf16 figures, log-probs 2.5e-3,
        # update 6.0%); ``pytest -s -m gpu tests/multiprocess/test_megatron_mla.py -k two_gpus`` prints these figures
        assert res["lp_max_abs_diff"] < 5e-3, (name, res)
        assert all(v < 5e-2 for v in res["metric_rel"].values()), (name, res)
        assert res["update_rel_l2"] < 0.12, (name, res)


def _layout_worker(model_dir: str, out: str, flags_csv: str) -> None:
    from family_workers import parity_worker

    parity_worker(model_dir, out, (*MLA_FLAGS, *flags_csv.split(",")), tp=1, split_fsdp_experts=True)


if __name__ == "__main__":
    if sys.argv[1] == "gpt":
        _gpt_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]))
    elif sys.argv[1] == "parity":
        _parity_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "gpu":
        from family_workers import gpu_worker

        gpu_worker(sys.argv[2], sys.argv[3], seq=12, attn_implementation=None, router_dtype="fp32")
    elif sys.argv[1] == "layout":
        _layout_worker(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "train_gpu":         # one GPU per rank, each seen as cuda:0 (the worker's device)
        import os

        from family_workers import train_worker

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        local = int(os.environ["LOCAL_RANK"])
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local] if visible else str(local)
        train_worker(sys.argv[2], sys.argv[3], sys.argv[4], "cuda")
    elif sys.argv[1] == "cp_attention":
        _cp_attention_worker(sys.argv[3])


def test_embedded_engine_serves_glm4_moe_lite(tiny_glm_dir: Path, tmp_path: Path) -> None:
    """``python -m miles.engine`` (generic HF path) generates from the tiny GLM-4.7-Flash: greedy tokens equal
    transformers' greedy decoding, and the routers' ``e_score_correction_bias`` (exported by the Megatron trainer)
    is a weight the engine reports by name."""
    from family_workers import check_engine_greedy

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    check_engine_greedy(tiny_glm_dir, tmp_path / "e.log", [5, 17, 23, 42, 8], (bias,), values=False)   # 200 only
