"""MoE models (tiny Qwen3-MoE) and expert parallelism on the Megatron backend, on real gloo ranks (torchrun).

``test_moe_gpt_matches_hf``: megatron-core's MoE layers (router, token dispatcher, SequentialMLP experts)
built from config.json and loaded by our converter give transformers' ``Qwen3MoeForCausalLM`` logits, at
EP 1 (all-gather dispatcher, Megatron's default) and at EP 2 (all-to-all); every parameter gets a gradient.

``test_moe_trainer_parity_with_fsdp``: 2 ranks. The FSDP backend (HF Qwen3MoeForCausalLM under FSDP2, DP 2)
and the Megatron backend (EP 1 x DP 2, or EP 2: each rank holds half of the experts) train the same 2
rollouts (GRPO with KL loss, KL reward, entropy bonus, TIS) on the same samples. Compared: log-probs before
training, step metrics, the parameter update after 2 steps in HF names (the weight-sync export; the FSDP
backend's fused ``experts.gate_up_proj`` / ``down_proj`` split per expert for the comparison); the export of
the untrained model equals the HF checkpoint bit for bit (fp32 and bf16) in the checkpoint's names and
order, gathered over EP; ``--save-hf`` loads with transformers to exactly the exported weights; a checkpoint
(EP 2) saved and resumed (experts under their global index) restores the trained weights bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _torchrun import torchrun_self

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def _torchrun(nproc: int, port: int, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return torchrun_self(HERE, nproc, port, *args, timeout=timeout)


# ------------------------------------------------------------------------------------------- model vs HF
def _gpt_worker(model_dir: str, out: str, ep: int, dispatcher: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.trainer.megatron import convert, model, moe
    from miles.trainer.megatron.compat import apply_cpu_compat, apply_moe_cpu_compat, trainer_world

    dist.init_process_group("gloo")
    apply_cpu_compat()
    apply_moe_cpu_compat()
    with trainer_world(dist.get_world_size()):
        ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep,
                                     create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1)
    shape = model.ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    padded = model.padded_vocab_size(shape.vocab_size, 128, 1)
    cpu = torch.device("cpu")
    kw = moe.config_kwargs(shape, moe.MoeOptions(dispatcher=dispatcher), ep=ep, etp=1, te=False)
    gpt = model.build_gpt_model(shape, model.transformer_config(shape, tp_size=1, device=cpu, moe=kw),
                                padded_vocab=padded, device=cpu)
    convert.load_hf_into(gpt, convert.read_hf_state_dict(model_dir), shape, padded, 0, 1,
                         ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep)
    torch.manual_seed(0)
    ids = torch.randint(4, shape.vocab_size, (2, 12))
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)
    logits = (gpt(ids, pos, attention_mask=None).transpose(0, 1) @ model.output_weight(gpt).t())[..., :shape.vocab_size]
    logits.float().square().mean().backward()
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gpt.parameters())
    num_local = len(gpt.decoder.layers[0].mlp.experts.local_experts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"max_abs_err": float((logits - ref).abs().max()), "grads_ok": grads_ok,
                                         "ref_scale": float(ref.abs().max()), "num_local_experts": num_local}))
    dist.destroy_process_group()


@pytest.mark.parametrize("nproc,ep,dispatcher", [(1, 1, "allgather"), (2, 2, "alltoall")],
                         ids=["ep1", "ep2_alltoall"])
def test_moe_gpt_matches_hf(tiny_moe_dir: Path, tmp_path: Path, free_port: int, nproc: int, ep: int,
                            dispatcher: str) -> None:
    out = tmp_path / "gpt.json"
    proc = _torchrun(nproc, free_port, "gpt", str(tiny_moe_dir), str(out), str(ep), dispatcher, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["grads_ok"] and res["num_local_experts"] == 4 // ep, res
    print("max_abs_err", res["max_abs_err"], "ref_scale", res["ref_scale"])
    # measured: 1.8e-7 of 0.63 at EP 1 and EP 2 (fp32 rounding of another op order; CPU, 2026-12-08); a wrong expert
    # or gate/up order gives > 1e-2
    assert res["max_abs_err"] < 4e-7 * max(res["ref_scale"], 1.0), res


# ------------------------------------------------------------------------------------------- trainer parity
def split_fused_experts(sd: dict) -> dict:
    """transformers' fused ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] -> the checkpoint's
    per-expert ``mlp.experts.<e>.{gate,up,down}_proj.weight``; other tensors unchanged."""
    out = {}
    for name, t in sd.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name[:-len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _parity_worker(model_dir: str, out: str, ep: int, dispatcher: str, kind: str = "cpu", tp: int = 1,
                   offload: str = "", mflags: str = "") -> None:
    """Both backends on the same samples (module docstring); rank 0 writes the comparison to ``out``. kind
    "cpu_ckpt": also a checkpoint round trip of the Megatron trainer (its trained weights also in ``out.meg_sd``).
    ``tp`` > 1: attention TP-split under --sequence-parallel, experts whole (--expert-tensor-parallel-size 1).
    ``offload`` "offload": Miles's Qwen3-MoE optimizer flags (--optimizer-cpu-offload, fraction 0.5, ...).
    ``mflags``: more Megatron flags, comma-separated (pipeline, context parallelism)."""
    with_ckpt = kind == "cpu_ckpt"
    kind = "cpu" if with_ckpt else kind
    import torch
    import torch.distributed as dist
    from family_workers import update_distance
    from safetensors.torch import load_file
    from test_megatron import _all_logprobs, _flags
    from trainer_harness import PRESETS, build, random_samples

    dist.init_process_group("gloo" if kind == "cpu" else "nccl")
    rank, group, world = dist.get_rank(), dist.group.WORLD, dist.get_world_size()
    dev = torch.device("cpu") if kind == "cpu" else torch.device("cuda", 0)
    if kind == "cuda":
        torch.cuda.set_device(dev)
    samples = random_samples(4, 4, seed=7, vocab=90)
    mine = samples if world == 1 else (samples[:12] if rank == 0 else samples[12:]) if world == 2 else \
        samples[4 * rank:4 * rank + 4]
    res: dict = {}
    fsdp = build(model_dir, _flags("fsdp", 1), group=group, device=dev)
    res["fsdp_lp"] = _all_logprobs(fsdp, samples)
    res["fsdp_metrics"] = [fsdp.train(mine, rid) for rid in range(2)]
    fsdp_sd = split_fused_experts(fsdp.state_dict_for_check())
    del fsdp

    flags = ("--expert-model-parallel-size", str(ep), *PRESETS["moe_fp32_router"], "--num-experts", "4",
             "--moe-router-topk", "2")
    flags += ("--moe-token-dispatcher-type", dispatcher) if dispatcher != "default" else ()
    flags += ("--save", str(Path(out).parent / "ckpt")) if with_ckpt else ()
    flags += ("--sequence-parallel", "--expert-tensor-parallel-size", "1") if tp > 1 else ()
    flags += ("--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5", "--overlap-cpu-optimizer-d2h-h2d",
              "--use-precision-aware-optimizer") if offload == "offload" else ()
    flags += tuple(f for f in mflags.split(",") if f)
    meg = build(model_dir, _flags("megatron", tp, megatron_flags=flags), group=group, device=dev)
    res["offloaded"] = getattr(meg.optimizer, "offloaded", 0)
    res["distributed_optimizer"] = meg.distributed_optimizer
    res["layout"] = {k: getattr(meg.groups, k) for k in ("tp_size", "pp_size", "cp_size", "ep_size", "dp_size",
                                                           "edp_size")}
    res["trained"] = sum(p.requires_grad for p in meg.model.parameters())
    init_order = [n for b in meg.iter_weight_buckets(4096) for n, _ in b]
    init = meg.state_dict_for_check()
    init_bf16 = {n: t.detach().cpu().clone() for b in meg.iter_weight_buckets(4096, torch.bfloat16) for n, t in b}
    res["meg_lp"] = _all_logprobs(meg, samples)
    res["meg_metrics"] = [meg.train(mine, rid) for rid in range(2)]
    meg_sd = meg.state_dict_for_check()
    meg.save_hf(Path(out).parent / "hf_out")
    reloaded = None
    if with_ckpt:                                   # checkpoint round trip (experts under their global index)
        meg.checkpoint(1, {"rollout_id": 1})
        meg.train(mine, 2)                              # move away, then load the checkpoint back
        res["resumed_extra"] = meg.resume()
        reloaded = meg.state_dict_for_check()
    res["num_params"], res["num_active_params"] = meg.num_params, meg.num_active_params
    if rank == 0:
        from transformers import AutoModelForCausalLM

        if with_ckpt:
            torch.save(meg_sd, f"{out}.meg_sd")
        res["ckpt_reload_bitwise"] = reloaded is None or (sorted(reloaded) == sorted(meg_sd) and all(
            torch.equal(reloaded[k], meg_sd[k]) for k in meg_sd))
        hf_model = AutoModelForCausalLM.from_pretrained(Path(out).parent / "hf_out")
        saved = split_fused_experts({n: p.detach().cpu() for n, p in hf_model.named_parameters()})
        res["save_hf_equal"] = sorted(saved) == sorted(meg_sd) and all(torch.equal(saved[k], meg_sd[k]) for k in meg_sd)
        res["hf_num_params"] = sum(p.numel() for p in hf_model.parameters())
        hf_experts = sum(p.numel() for n, p in hf_model.named_parameters() if ".mlp.experts." in n)
        cfg = hf_model.config  # MFU's N: the top-k share of the routed experts
        res["hf_active_params"] = res["hf_num_params"] - hf_experts * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
        hf = load_file(str(Path(model_dir) / "model.safetensors"))
        res["export_keys_equal"] = sorted(init) == sorted(hf) == sorted(meg_sd) == sorted(fsdp_sd)
        res["export_order"] = init_order
        res["export_bitwise"] = all(torch.equal(init[k], hf[k]) for k in hf)
        res["export_bf16_bitwise"] = all(torch.equal(init_bf16[k], hf[k].bfloat16()) for k in hf)
        res.update(update_distance(meg_sd, fsdp_sd, hf, list(hf)))
        res["experts_moved"] = min((fsdp_sd[k] - hf[k]).abs().max().item() for k in hf if ".experts." in k)
        res["lp_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(res["fsdp_lp"], res.pop("meg_lp")))
        res["ep_size"], res["tp_size"] = meg.groups.ep_size, meg.groups.tp_size
    res.pop("fsdp_lp")
    if rank == 0:
        torch.save(res, out)
        if os.environ.get("OUT"):           # the device tool brings $OUT back
            summary = {k: v for k, v in res.items() if "metrics" not in k and k != "export_order"}
            Path(os.environ["OUT"], "megatron_moe_gpu.json").write_text(json.dumps(summary, indent=1, default=str))
    dist.destroy_process_group()


@pytest.mark.parametrize("nproc,tp,ep,dispatcher,kind,offload", [
    (2, 1, 1, "allgather", "cpu", ""), (2, 1, 2, "alltoall", "cpu_ckpt", ""), (2, 1, 2, "default", "cpu", ""),
    (2, 2, 1, "allgather", "cpu_ckpt", ""), (4, 2, 2, "alltoall", "cpu", ""),
    (2, 2, 1, "allgather", "cpu_ckpt", "offload")],
    ids=["ep1_dp2_allgather", "ep2_alltoall_checkpoint", "ep2_default_dispatcher", "tp2_ep1_sp_checkpoint",
         "tp2_ep2_sp_alltoall", "tp2_optimizer_cpu_offload_checkpoint"])
def test_moe_trainer_parity_with_fsdp(tiny_moe_dir: Path, tmp_path: Path, free_port: int, nproc: int, tp: int,
                                      ep: int, dispatcher: str, kind: str, offload: str) -> None:
    """tp2_*: attention split over TP 2 (--sequence-parallel), experts whole on every TP rank (ETP 1); their
    gradients summed over the TP ranks' sequence parts (expert-DP group). The export equals the HF checkpoint
    bit for bit, as at TP 1. *_optimizer_cpu_offload_*: half of the parameters' AdamW on CPU, the same update."""
    import torch
    from test_megatron import PARITY_METRICS, parity_figures

    out = tmp_path / "parity.pt"
    proc = _torchrun(nproc, free_port, "parity", str(tiny_moe_dir), str(out), str(ep), dispatcher, kind, str(tp),
                     offload, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    print(parity_figures(res, PARITY_METRICS["grpo"]))
    assert res["ep_size"] == ep and res["tp_size"] == tp
    assert (0 < res["offloaded"] < res["trained"]) if offload else res["offloaded"] == 0, res
    assert res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    # experts in the EP 1 model's order (layer, expert 0..E-1, gate/up/down), whatever the EP size
    experts = [n for n in res["export_order"] if ".experts." in n]
    assert experts == [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in range(2) for e in range(4)
                       for p in ("gate", "up", "down")], experts
    assert res["save_hf_equal"] and res["ckpt_reload_bitwise"], res
    if kind == "cpu_ckpt":
        assert res["resumed_extra"]["rollout_id"] == 1, res
    assert res["num_params"] == res["hf_num_params"], res
    assert res["num_active_params"] == res["hf_active_params"] < res["num_params"], {k: res[k] for k in ("num_active_params", "hf_active_params", "num_params")}
    # Bounds at about twice what was measured (2026-12-07, CPU fp32, the 2-core box; ``OMP_NUM_THREADS=1 python -m
    # pytest -s tests/multiprocess/test_megatron_moe.py -k "test_moe_trainer_parity_with_fsdp and not gpu"`` prints
    # them): log-probs 9.5e-7 in each, step metrics 1.2e-7 relative (EP 1 and EP 2 at DP 2), updates (up to 4.0e-3)
    # 6.2e-6 apart (EP 2), 1.1e-5 of the update's L2 norm; TP 2 (+ offload) 4.8e-6 / 8.5e-6, TP 2 x EP 2 3.5e-6 /
    # 7.9e-6
    assert res["lp_max_abs_diff"] < 2e-6, res
    for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]):
        for key in PARITY_METRICS["grpo"]:
            assert abs(f[key] - m[key]) <= 2.5e-7 * max(1.0, abs(f[key])), (key, f[key], m[key])
    # every expert trained; without the division of the EP-reduced expert gradients by DP, grad_norm is 0.5% off
    assert res["experts_moved"] > 1e-4, res
    assert res["update_max_abs_diff"] < 1.3e-5 and res["update_rel_l2"] < 2.2e-5, res


# ------------------------------------------------------------------------------------------- EP with PP, CP
LAYOUTS = {
    # id: (nproc, tp, ep, dispatcher, kind, Megatron flags, the layout a checkpoint of it is loaded into: (nproc, ep,
    # flags) or None)
    "ep2_pp2_checkpoint_to_ep2": (4, 1, 2, "alltoall", "cpu_ckpt", "--pipeline-model-parallel-size,2",
                                  (2, 2, "")),
    "ep2_cp2_checkpoint_to_one_rank": (4, 1, 2, "alltoall", "cpu_ckpt", "--context-parallel-size,2", (1, 1, "")),
    "tp2_cp2_sp": (4, 2, 1, "allgather", "cpu", "--context-parallel-size,2", None),
    # Miles's amd Qwen3-30B-A3B layout (PP 2 x CP 2 x EP 4, SP at TP 1) at EP 2: the EP group is the CP pair
    "ep2_pp2_cp2_sp": (4, 1, 2, "alltoall", "cpu", "--pipeline-model-parallel-size,2,--context-parallel-size,2,"
                       "--sequence-parallel", None),
}


def _load_worker(model_dir: str, out: str, ckpt: str, flags_csv: str) -> None:
    """A Megatron trainer of another layout loads the checkpoint ``ckpt`` (weights and AdamW state); rank 0 writes
    its weights (the export) to ``out``."""
    import torch
    import torch.distributed as dist
    from test_megatron import _flags
    from trainer_harness import PRESETS, build

    dist.init_process_group("gloo")
    flags = (*PRESETS["moe_fp32_router"], "--num-experts", "4", "--moe-router-topk", "2",
             *[f for f in flags_csv.split(",") if f])
    meg = build(model_dir, _flags("megatron", 1, megatron_flags=flags))
    meg.load(Path(ckpt))
    sd = meg.state_dict_for_check()
    if dist.get_rank() == 0:
        torch.save(sd, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_moe_parallel_layouts_match_fsdp(tiny_moe_dir: Path, tmp_path: Path, free_port: int, case: str) -> None:
    """Expert parallelism with pipeline parallelism (each stage's EP group all-to-alls its own layer), with context
    parallelism (each CP rank routes its chunks' tokens), and TP x CP on the MoE model, on 4 ranks with the sharded
    optimizer (Miles's default: dense state over DP (x CP), the experts' over the expert-DP group): the same
    log-probs, metrics and update as the FSDP backend over the same ranks, the export equal to the HF checkpoint
    bit for bit in its order; the checkpoint (torch_dist, megatron-core's global keys) loads into another layout to
    the same weights."""
    import torch

    from miles.utils.net import find_free_port

    nproc, tp, ep, dispatcher, kind, mflags, reshard = LAYOUTS[case]
    out = tmp_path / "parity.pt"
    proc = _torchrun(nproc, free_port, "parity", str(tiny_moe_dir), str(out), str(ep), dispatcher, kind, str(tp), "",
                     mflags, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    print(case, {k: res[k] for k in ("layout", "lp_max_abs_diff", "update_max_abs_diff", "update_rel_l2")})
    pp = 2 if "pipeline" in mflags else 1
    cp = 2 if "context" in mflags else 1
    assert res["layout"] == {"tp_size": tp, "pp_size": pp, "cp_size": cp, "ep_size": ep,
                             "dp_size": nproc // (tp * pp * cp), "edp_size": nproc // (pp * ep)}, res["layout"]
    assert res["distributed_optimizer"], res
    assert res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    experts = [n for n in res["export_order"] if ".experts." in n]
    assert experts == [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in range(2) for e in range(4)
                       for p in ("gate", "up", "down")], experts
    assert res["save_hf_equal"] and res["ckpt_reload_bitwise"], res
    assert res["num_params"] == res["hf_num_params"] and res["num_active_params"] == res["hf_active_params"], res
    # Measured (2026-12-06, CPU fp32, this test): log-probs 9.5e-7 (EP2 x PP2, EP2 x CP2, EP2 x PP2 x CP2 + SP) and
    # 4.8e-7 (TP2 x CP2 + SP); update max 6.3e-6 / 5.4e-6 / 5.8e-6 / 4.7e-6, relative L2 9.8e-6 / 8.8e-6 / 8.4e-6 /
    # 1.1e-5. Bounds: about twice the largest.
    assert res["lp_max_abs_diff"] < 2e-6, res
    # the step metrics (relative to the value, absolute below 1): measured 8.9e-8 (EP2 x CP2), 3.0e-8 / 2.6e-8 / 3.0e-8
    # in the other layouts (2026-12-08, CPU fp32; ``pytest -s`` prints them); bound about twice the largest
    keys = ("loss", "pg_loss", "entropy", "ppo_kl", "tis", "grad_norm", "num_samples", "num_tokens", "advantages_mean",
            "kl_loss", "reward_kl_mean")
    rel = {k: max(abs(f[k] - m[k]) / max(1.0, abs(f[k])) for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]))
           for k in keys}
    print(case, "metric_rel_max", max(rel.values()))
    assert max(rel.values()) <= 2e-7, rel
    assert res["experts_moved"] > 1e-4, res
    assert res["update_max_abs_diff"] < 1.3e-5 and res["update_rel_l2"] < 2.2e-5, res
    if reshard is None:
        return
    other_nproc, other_ep, other_flags = reshard
    loaded = tmp_path / "loaded.pt"
    flags = ",".join(f for f in ("--expert-model-parallel-size", str(other_ep), other_flags) if f)
    proc = _torchrun(other_nproc, find_free_port(), "load", str(tiny_moe_dir), str(loaded),
                     str(tmp_path / "ckpt" / "iter_0000001"), flags, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got, want = torch.load(loaded, weights_only=False), torch.load(f"{out}.meg_sd", weights_only=False)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), sorted(got)[:4]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["ep2_pp2_checkpoint_to_ep2", "ep2_cp2_checkpoint_to_one_rank"])
def test_moe_parallel_layouts_match_fsdp_on_four_gpus(tiny_moe_dir: Path, tmp_path: Path, free_port: int,
                                                      case: str) -> None:
    """EP 2 x PP 2 and EP 2 x CP 2 on 4 GPUs (NCCL: the pipeline's p2p and the experts' all-to-all on one host, the
    sharded optimizer's fused AdamW), each backend in its GPU default bf16, against FSDP DP 4."""
    import torch
    from family_workers import check_gpu_bf16_parity

    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs (one per rank)")
    nproc, tp, ep, dispatcher, _, mflags, _ = LAYOUTS[case]
    out = tmp_path / "parity_gpu.pt"
    proc = _torchrun(nproc, free_port, "parity", str(tiny_moe_dir), str(out), str(ep), dispatcher, "cuda", str(tp), "",
                     mflags, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    print(case, {k: v for k, v in res.items() if "metrics" not in k and k != "export_order"})
    assert res["distributed_optimizer"] and res["layout"]["ep_size"] == 2, res
    assert res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    # Never run yet (4 GPUs): the bounds of test_moe_trainer_parity_with_fsdp_on_gpu (one GPU, bf16); ``pytest -s -m
    # gpu tests/multiprocess/test_megatron_moe.py -k four_gpus`` prints what this run measures
    check_gpu_bf16_parity(res)


# ------------------------------------------------------------------------------------------- engine
def post_bucket_and_check(engine_url: str, bucket: list) -> list[str]:
    """Hand one weight bucket (``[(name, tensor)]``) to the engine at ``engine_url`` through
    ``/update_weights_from_tensor`` (a flattened bucket), then read each tensor back by name (``/get_weights_by_name``)
    and compare it bitwise (``weight_sync.check.compare`` raises otherwise). Returns the names checked."""
    import requests

    from miles.weight_sync.check import compare
    from miles.weight_sync.tensor import pack_shared, serialize_bucket

    flat, meta = pack_shared(bucket)
    r = requests.post(engine_url + "/update_weights_from_tensor", timeout=60,
                      json={"serialized_named_tensors": [serialize_bucket(flat, meta)],
                            "load_format": "flattened_bucket", "flush_cache": True})
    assert r.status_code == 200, r.text
    for name, t in bucket:
        r = requests.post(engine_url + "/get_weights_by_name", json={"name": name, "truncate_size": t.shape[0]},
                          timeout=30)
        assert r.status_code == 200, (name, r.text)
        compare(name, t, r.json(), engine_url)         # raises unless bitwise equal
    return [name for name, _ in bucket]


def _engine_worker(model_dir: str, out: str, engine_url: str) -> None:
    """Megatron EP 2 trains one rollout, then rank 0 hands every bucket to the embedded engine (generic HF path,
    fused experts in transformers) through ``/update_weights_from_tensor``; rank 0 reads each tensor back."""
    import requests
    import torch
    import torch.distributed as dist
    from test_megatron import _flags
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meg = build(model_dir, _flags("megatron", 1, megatron_flags=("--expert-model-parallel-size", "2")))
    samples = random_samples(4, 4, seed=7, vocab=90)
    meg.train(samples[:8] if rank == 0 else samples[8:], 0)
    res = {"names": [], "posted": 0}
    before = {}
    for bucket in meg.iter_weight_buckets(16 << 10):
        if rank != 0:
            continue
        for name, t in bucket:
            r = requests.post(engine_url + "/get_weights_by_name", json={"name": name, "truncate_size": t.shape[0]},
                              timeout=30)
            before[name] = r.status_code == 200 and torch.equal(torch.tensor(r.json(), dtype=t.dtype).reshape(t.shape), t)
        res["names"] += post_bucket_and_check(engine_url, bucket)
        res["posted"] += 1
    if rank == 0:
        res["changed"] = sum(not v for v in before.values())
        g = requests.post(engine_url + "/generate", timeout=60,
                          json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        res["generate_ok"] = g.status_code == 200 and len(g.json()["output_ids"]) == 4
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def test_moe_weight_update_leaves_engine_equal_to_trainer(tiny_moe_dir: Path, tmp_path: Path, free_port: int) -> None:
    """The embedded engine loads the Qwen3-MoE model (generic HF path) and, after an update from the Megatron
    trainer at EP 2 (experts in the checkpoint's per-expert names), holds the trainer's weights bit for bit."""
    from safetensors.torch import load_file

    from miles.engine.testing import EngineProc

    eng = EngineProc(tiny_moe_dir, "--max-running-requests", "2", log=tmp_path / "engine.log")
    try:
        out = tmp_path / "engine.json"
        proc = _torchrun(2, free_port, "engine", str(tiny_moe_dir), str(out), eng.url)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        res = json.loads(out.read_text())
    finally:
        eng.stop()
    assert "generic HF" in (tmp_path / "engine.log").read_text()
    assert sorted(res["names"]) == sorted(load_file(str(tiny_moe_dir / "model.safetensors"))), res["names"][:5]
    assert res["changed"] > 30 and res["generate_ok"], res


@pytest.mark.gpu
def test_moe_trainer_parity_with_fsdp_on_gpu(tiny_moe_dir: Path, tmp_path: Path, free_port: int) -> None:
    """One rank on a GPU (NCCL, EP 1), both backends in bf16: Megatron's MoE stays within bf16 rounding of FSDP's."""
    import torch
    from family_workers import check_gpu_bf16_parity

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "parity_gpu.pt"
    proc = _torchrun(1, free_port, "parity", str(tiny_moe_dir), str(out), "1", "alltoall", "cuda")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    print({k: v for k, v in res.items() if "metrics" not in k and k != "export_order"})
    assert res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    # Bounds at about twice the figures reported for the one-H200 run of 2026-12-01 (EP 1, bf16; no log of it is kept):
    # log-probs 2.4e-3 apart, update 6.0% apart in relative L2 (as the dense model's, test_megatron.py). Not
    # re-measured since these bounds were set (no GPU here): ``pytest -s -m gpu tests/multiprocess/test_megatron_moe.py
    # -k parity`` prints them.
    check_gpu_bf16_parity(res)


if __name__ == "__main__":
    if sys.argv[1] == "gpt":
        _gpt_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "engine":
        _engine_worker(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "parity":
        if sys.argv[6:7] == ["cuda"] and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:   # the worker runs on
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")                                  # cuda:0: a GPU per rank
            local = int(os.environ["LOCAL_RANK"])
            os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local] if visible else str(local)
        _parity_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], *sys.argv[6:7],
                       *map(int, sys.argv[7:8]), *sys.argv[8:10])
    elif sys.argv[1] == "load":
        _load_worker(*sys.argv[2:6])
