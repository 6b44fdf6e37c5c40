"""megatron-core on real gloo ranks (torchrun, CPU; NCCL on a GPU host).

``test_gpt_model_matches_hf``: the CPU adaptation (``compat.py``), the model built from the HF config
(core attention on torch SDPA, or megatron-core's unfused one) and our HF -> megatron converter: each
rank builds the tiny Qwen3 at TP = world size, runs a forward,
gathers its vocabulary shard of the logits and compares with transformers' logits; a backward must
leave every parameter with a finite gradient.

``test_trainer_parity_with_fsdp``: 2 ranks. The FSDP trainer (DP 2) and the Megatron trainer (TP 2,
or TP 1 x DP 2 on an untied model) get the same samples split the same way between the ranks and train
the same 2 rollouts (GRPO with KL loss, KL reward, entropy bonus, TIS). Compared: the log-probs of every
sample before training, the step metrics (loss, pg_loss, entropy, kl_loss, grad_norm ...), and the
parameter update after the 2 steps, in HF names (``state_dict_for_check``, the weight-sync export);
the export of the untrained model equals the HF checkpoint bit for bit (fp32 and bf16), and ``--save-hf``
after training loads with transformers to exactly the exported weights.

``test_checkpoint_kill_mid_save_then_resume_matches_uninterrupted``: TP 1 x DP 2 with the distributed optimizer
and PPO (the critic is checkpointed too), a rank SIGKILLed inside a save (``kill_mid_save.py``) at the ``shards``
and ``rename`` points; the relaunch ends bitwise equal to an uninterrupted run.
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


def _worker(model_dir: str, out: str, core: str = "sdpa") -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo")
    from miles.trainer.megatron.compat import apply_cpu_compat, trainer_world

    apply_cpu_compat()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from miles.trainer.megatron import convert, model

    tp, rank = dist.get_world_size(), dist.get_rank()
    with trainer_world(tp):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1)
    shape = model.ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    padded = model.padded_vocab_size(shape.vocab_size, 128, tp)
    cpu = torch.device("cpu")
    gpt = model.build_gpt_model(shape, model.transformer_config(shape, tp_size=tp, device=cpu),
                                padded_vocab=padded, device=cpu, core_attention=core)
    convert.load_hf_into(gpt, convert.read_hf_state_dict(model_dir), shape, padded, rank, tp)

    torch.manual_seed(0)
    ids = torch.randint(4, shape.vocab_size, (2, 12))
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)
    hidden = gpt(ids, pos, attention_mask=None)                       # [s, b, h]
    local = hidden.transpose(0, 1) @ model.output_weight(gpt).t()     # [b, s, V/tp]
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.detach().contiguous())
    logits = torch.cat(shards, dim=-1)[..., :shape.vocab_size]
    local.float().square().mean().backward()
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gpt.parameters())

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    err = float((logits - ref).abs().max())
    if rank == 0:
        Path(out).write_text(json.dumps({"max_abs_err": err, "ref_scale": float(ref.abs().max()),
                                         "grads_ok": grads_ok, "padded_vocab": padded}))
    dist.destroy_process_group()


def _run(model_dir: Path, tmp_path: Path, nproc: int, port: int, core: str) -> dict:
    out = tmp_path / f"result_tp{nproc}.json"
    proc = torchrun_self(HERE, nproc, port, "gpt", str(model_dir), str(out), core, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc,core", [(1, "sdpa"), (2, "sdpa"), (2, "unfused")])
def test_gpt_model_matches_hf(tiny_model_dir: Path, tmp_path: Path, free_port: int, nproc: int, core: str) -> None:
    res = _run(tiny_model_dir, tmp_path, nproc, free_port, core)
    print(nproc, core, res)
    assert res["grads_ok"]
    # fp32 on CPU: same math in a different op order (fused qkv, split vocab), so float rounding only: measured
    # (2026-12-07, ``OMP_NUM_THREADS=1 python -m pytest -s tests/multiprocess/test_megatron.py -k gpt_model_matches_hf``)
    # 0 at TP 1, 2.1e-7 (SDPA) / 2.4e-7 (unfused) at TP 2 of logits up to 1.17; the bound about twice that
    assert res["max_abs_err"] < 4e-7 * max(res["ref_scale"], 1.0), res


# ------------------------------------------------------------------------------------ trainer parity
# Both backends' AdamW set alike: their defaults differ, as Miles's (``miles.config.train.BACKEND_DEFAULTS``: beta2
# 0.95 / 0.999, weight decay 0 / 0.01, lr decay constant / linear), and left to them the updates differ by 0.5%.
COMMON_FLAGS = ["--use-tis", "--lr", "2e-3", "--adam-beta2", "0.99", "--weight-decay", "0.0",
                "--lr-decay-style", "constant", "--micro-batch-size", "3", "--clip-grad", "1.0"]
ALGO_FLAGS = {
    "grpo": ["--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl", "--kl-coef", "0.02",
             "--entropy-coef", "0.01"],
    "ppo": ["--advantage-estimator", "ppo", "--normalize-advantages", "--gamma", "0.99", "--lambd", "0.95",
            "--calculate-per-token-loss", "--critic-lr", "5e-3"],
}


def _flags(backend: str, tp: int, distopt: bool = False, algo: str = "grpo",
           megatron_flags: tuple[str, ...] = ()) -> list[str]:
    """The parity run's flags (2 rollouts of 4 prompts x 4 samples, one optimizer step each) on ``backend``; every
    value whose default differs by backend given (``COMMON_FLAGS``)."""
    from miles.config.train import BACKEND_DEFAULTS

    fsdp, meg = BACKEND_DEFAULTS["fsdp"], BACKEND_DEFAULTS["megatron"]
    differ = {"--" + k.replace("_", "-") for k in fsdp.keys() | meg.keys() if fsdp.get(k) != meg.get(k)}
    assert differ <= set(COMMON_FLAGS), f"{sorted(differ - set(COMMON_FLAGS))}: defaults differ by backend; set them"
    assert not differ & set(megatron_flags), f"{sorted(differ & set(megatron_flags))} given to one backend only"
    extra = COMMON_FLAGS + ALGO_FLAGS[algo]
    extra += ["--tensor-model-parallel-size", str(tp), *megatron_flags] if backend == "megatron" else []
    extra += ["--use-distributed-optimizer"] if distopt else []
    return ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--num-steps-per-rollout", "1", "--rollout-temperature", "0.8", "--train-backend", backend] + extra


def _all_logprobs(tr, samples) -> list:
    data = [tr._sample_data(s, i) for i, s in enumerate(samples)]
    tr.model.eval()
    return tr._forward_pass(tr.model, lambda mb: tr._policy_forward(tr.model, mb)[0], data)


def _parity_worker(model_dir: str, out: str, tp: int, kind: str = "cpu", distopt: bool = False,
                   algo: str = "grpo", megatron_flags: str = "") -> None:
    """kind "cpu": gloo, fp32. kind "cuda": one rank on GPU 0 (NCCL), each backend with its GPU default
    bf16, the same recipe (bf16 parameters in the forward and backward, fp32 gradients and masters: FSDP's
    one-rank path and the Megatron backend through ``optim.MasterWeights``); the FSDP backend's varlen flash
    attention needs bf16."""
    import torch
    import torch.distributed as dist
    from family_workers import update_distance
    from safetensors.torch import load_file
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo" if kind == "cpu" else "nccl")
    rank, group = dist.get_rank(), dist.group.WORLD
    dev = torch.device("cpu") if kind == "cpu" else torch.device("cuda", 0)
    if kind == "cuda":
        torch.cuda.set_device(dev)
    samples = random_samples(4, 4, seed=7, vocab=90)
    world = dist.get_world_size()
    # whole groups of 4 per rank; 2 ranks: uneven (rank 1 pads micro-batches); 4 ranks: one group each
    mine = samples if world == 1 else (samples[:12] if rank == 0 else samples[12:]) if world == 2 else \
        samples[4 * rank:4 * rank + 4]
    res: dict = {}
    fsdp = build(model_dir, _flags("fsdp", 1, algo=algo), group=group, device=dev)
    res["fsdp_lp"] = _all_logprobs(fsdp, samples)
    res["fsdp_metrics"] = [fsdp.train(mine, rid) for rid in range(2)]
    fsdp_sd = fsdp.state_dict_for_check()
    if fsdp.critic is not None:                     # the value head's update depends on the whole critic
        res["fsdp_value_head"] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
                                  for p in fsdp.critic.model.value_head.parameters()]
    del fsdp

    meg = build(model_dir, _flags("megatron", tp, distopt, algo, tuple(f for f in megatron_flags.split(",") if f)),
                group=group, device=dev)
    init = meg.state_dict_for_check()
    init_bf16 = {n: t.detach().cpu().clone() for b in meg.iter_weight_buckets(4096, torch.bfloat16) for n, t in b}
    res["meg_lp"] = _all_logprobs(meg, samples)
    res["meg_metrics"] = [meg.train(mine, rid) for rid in range(2)]
    meg_sd = meg.state_dict_for_check()
    if meg.critic is not None:
        meg_head = [p.detach().cpu() for p in meg.critic.model.value_head.parameters()]
        res["value_head_max_abs_diff"] = max((a - b).abs().max().item() for a, b in
                                             zip(res.pop("fsdp_value_head"), meg_head))
        res["value_head_max_abs"] = max(t.abs().max().item() for t in meg_head)
    meg.save_hf(Path(out).parent / "hf_out")                       # --save-hf: a HF dir transformers loads
    if rank == 0:
        from transformers import AutoModelForCausalLM

        saved = dict(AutoModelForCausalLM.from_pretrained(Path(out).parent / "hf_out").named_parameters())
        res["save_hf_equal"] = all(torch.equal(saved[k].detach().cpu(), meg_sd[k]) for k in meg_sd)
        hf = load_file(str(Path(model_dir) / "model.safetensors"))
        res["export_keys_equal"] = sorted(init) == sorted(hf) == sorted(meg_sd) == sorted(fsdp_sd)
        res["export_bitwise"] = all(torch.equal(init[k], hf[k]) for k in hf)
        res["export_bf16_bitwise"] = all(torch.equal(init_bf16[k], hf[k].bfloat16()) for k in hf)
        res.update(update_distance(meg_sd, fsdp_sd, hf, list(hf)))
        res["lp_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(res["fsdp_lp"], res.pop("meg_lp")))
        res["bf16"] = meg.bf16
        res["distributed_optimizer"] = meg.distributed_optimizer
    res.pop("fsdp_lp")
    if rank == 0:
        torch.save(res, out)
        if os.environ.get("OUT"):           # the device tool brings $OUT back
            summary = {k: v for k, v in res.items() if "metrics" not in k}
            for key in ("loss", "pg_loss", "entropy", "kl_loss", "grad_norm"):
                summary[key] = [[m[key] for m in res[k]] for k in ("fsdp_metrics", "meg_metrics")]
            Path(os.environ["OUT"], "megatron_gpu.json").write_text(json.dumps(summary, indent=1, default=str))
    dist.destroy_process_group()


# the step metrics the parity tests compare, by algorithm
_SHARED_METRICS = ["loss", "pg_loss", "entropy", "ppo_kl", "tis", "grad_norm", "num_samples", "num_tokens",
                   "advantages_mean"]
PARITY_METRICS = {"grpo": _SHARED_METRICS + ["kl_loss", "reward_kl_mean"],
                  "ppo": _SHARED_METRICS + ["value_loss", "value_clipfrac", "critic_grad_norm"]}


def parity_figures(res: dict, keys: list[str]) -> dict:
    """The figures a parity bound is set from (``pytest -s`` prints them): the log-probs' and the update's distance,
    the largest relative distance of the step metrics ``keys``."""
    rel = max(abs(f[k] - m[k]) / max(1.0, abs(f[k])) for f, m in zip(res["fsdp_metrics"], res["meg_metrics"])
              for k in keys)
    return {"lp_max_abs_diff": res["lp_max_abs_diff"], "update_max_abs_diff": res["update_max_abs_diff"],
            "update_rel_l2": res["update_rel_l2"], "update_max_abs": res["update_max_abs"], "metric_rel_max": rel,
            **({"value_head_max_abs_diff": res["value_head_max_abs_diff"]} if "value_head_max_abs_diff" in res else {})}


FULL_RECOMPUTE = "--recompute-granularity,full,--recompute-method,uniform,--recompute-num-layers,1"


@pytest.mark.parametrize("nproc,tp,tied,distopt,algo,mflags", [
    (2, 2, True, False, "grpo", ""), (2, 1, False, True, "grpo", "--recompute-activations"),
    (2, 2, False, False, "ppo", "--attention-backend,unfused"), (4, 2, True, True, "grpo", FULL_RECOMPUTE)],
    ids=["tp2_tied", "tp1_dp2_untied_distributed_optimizer_selective_recompute", "tp2_untied_ppo_critic_unfused",
         "tp2_dp2_distributed_optimizer_full_recompute"])
def test_trainer_parity_with_fsdp(tiny_model_dir: Path, tmp_path: Path, free_port: int, nproc: int, tp: int,
                                  tied: bool, distopt: bool, algo: str, mflags: str) -> None:
    import torch

    model_dir = tiny_model_dir
    if not tied:
        from miles.utils.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp_path / "untied", hidden_size=64, num_layers=2, tie_word_embeddings=False)
    out = tmp_path / "parity.pt"
    proc = torchrun_self(HERE, nproc, free_port, "parity", str(model_dir), str(out), str(tp), "cpu",
                         str(int(distopt)), algo, mflags, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    keys = PARITY_METRICS[algo]
    print(parity_figures(res, keys))
    assert res["distributed_optimizer"] == distopt
    assert res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    assert res["save_hf_equal"], res
    # Bounds at about twice what was measured (2026-12-07, CPU fp32, the 2-core box, the same with OMP_NUM_THREADS=1
    # and 2; ``OMP_NUM_THREADS=1 python -m pytest -s tests/multiprocess/test_megatron.py -k "trainer_parity_with_fsdp
    # and not gpu"`` prints them; both backends' AdamW set alike by COMMON_FLAGS): log-probs 4.8e-7 apart (0 at TP 1),
    # step metrics 7.8e-8 relative, 2 AdamW steps of lr 2e-3 (updates up to 4.0e-3) 7.0e-6 apart (Adam's
    # normalisation amplifies rounding where a gradient is near 0), 9.0e-6 of the update's L2 norm; the PPO critic's
    # value head 3.4e-8. A wrong TP reduction of one norm's gradient gives 7e-3.
    assert res["lp_max_abs_diff"] < 1e-6, res
    for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]):
        for key in keys:
            assert abs(f[key] - m[key]) <= 1.6e-7 * max(1.0, abs(f[key])), (key, f[key], m[key])
    assert res["update_max_abs_diff"] < 1.4e-5 and res["update_rel_l2"] < 1.8e-5, res
    if algo == "ppo":        # the value head starts at 0: after 2 steps its weights equal the FSDP critic's
        assert res["value_head_max_abs"] > 1e-3 and res["value_head_max_abs_diff"] < 7e-8, res


# ------------------------------------------------------------------------------------ checkpoints
def make_trainer(model_dir: str, flags: list[str], group):
    """TP 1 x DP 2: the sharded AdamW state (--use-distributed-optimizer) and PPO (the critic's too), dropout (the
    TP RNG tracker is restored too). TP 2 is test_megatron_ckpt.py's."""
    from trainer_harness import build

    return build(model_dir, ["--train-backend", "megatron", "--hidden-dropout", "0.1", "--use-distributed-optimizer",
                             "--advantage-estimator", "ppo"] + flags, group=group)


@pytest.mark.parametrize("point", ["shards", "rename"])
def test_checkpoint_kill_mid_save_then_resume_matches_uninterrupted(tiny_model_dir: Path, tmp_path: Path,
                                                                    point: str) -> None:
    from kill_mid_save import kill_then_resume, reference

    from miles.trainer.checkpoint.layout import ITER
    from miles.trainer.megatron import torch_dist

    ref = reference(HERE, tmp_path / "ref.pt", tiny_model_dir)
    kill_then_resume(HERE, tmp_path, ref, point, ITER, tiny_model_dir)
    common = torch_dist.read_common(tmp_path / "ckpt" / "iter_0000004")
    meta = common["miles"]
    assert meta["backend"] == "megatron" and common["args"].tensor_model_parallel_size == 1 and meta["has_optim"]
    assert meta["has_critic"] and (tmp_path / "ckpt" / "iter_0000004" / "critic").is_dir()


@pytest.mark.gpu
def test_trainer_parity_with_fsdp_on_gpu(tiny_model_dir: Path, tmp_path: Path, free_port: int) -> None:
    """One rank on a GPU (NCCL, TP 1), both backends in bf16: Megatron stays within bf16 rounding of FSDP."""
    import torch
    from family_workers import check_gpu_bf16_parity

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "parity_gpu.pt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parents[1]),  # tests/: trainer_harness
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port), str(HERE), "parity", str(tiny_model_dir), str(out), "1", "cuda"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    print({k: v for k, v in res.items() if "metrics" not in k})
    assert res["bf16"] and res["export_keys_equal"] and res["export_bitwise"] and res["export_bf16_bitwise"], res
    # Bounds at about twice the figures docs/trainer.md and docs/benchmarks.md state for one H200 (2026-12-01, TP 1,
    # bf16): log-probs 2.5e-3 apart, update 6.0% apart in relative L2 (7.9% before both backends ran the same bf16
    # recipe; the FSDP backend differs from itself by 2.6% with another micro-batching). Not re-measured since these
    # bounds were set (no GPU here): ``pytest -s -m gpu tests/multiprocess/test_megatron.py -k parity`` prints them.
    check_gpu_bf16_parity(res)


if __name__ == "__main__":
    if sys.argv[1] == "parity":
        _parity_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6:7] == ["1"],
                       *sys.argv[7:9])
    elif sys.argv[1] == "kill_mid_save":
        import kill_mid_save

        kill_mid_save.worker(make_trainer, *sys.argv[2:])
    else:
        _worker(sys.argv[2], sys.argv[3], sys.argv[4])
