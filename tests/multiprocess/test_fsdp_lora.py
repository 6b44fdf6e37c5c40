"""LoRA on the FSDP backend (``--train-backend fsdp --lora-rank 4 --lora-alpha 8 --target-modules all-linear``), tiny
Qwen3, 2 real gloo ranks (FSDP2, DP 2), against the Megatron backend's LoRA (TP 1 x DP 2) on the same samples.

``test_fsdp_lora_matches_megatron_and_merged_reference``: at step 0 both exports equal the HF checkpoint bit for bit
(B = 0) and the KL to the reference is 0; after 2 rollouts (the same AdamW settings on both: the backends' defaults
differ) the step metrics of the two backends agree within 5e-5 relative (measured 1.5e-5) and their merged exports
within 1e-6 (relative L2 5e-6 of the update; measured 5.0e-7 and 2.3e-6); only q/k/v/o/gate/up/down moved, and no
base parameter of the FSDP model has a gradient or requires one. The merged reference: a plain HF model with
the FSDP run's merged export gives the same logits (fp32 rounding) as the base HF model with the run's adapters
hooked on (``lora_hf.attach_hf``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _worker(model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from trainer_harness import build, flags, random_samples
    from transformers import AutoModelForCausalLM

    from miles.trainer import lora, lora_hf

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    # the optimizer's defaults differ by backend (AdamW beta2 0.95 / 0.999, weight decay 0 / 0.01): set alike
    argv = ["--num-rollout", "2", "--n-samples-per-prompt", "3", "--lr", "1e-2", "--lr-decay-style", "constant",
            "--adam-beta2", "0.999", "--weight-decay", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1"]
    for backend in ("fsdp", "megatron"):
        tr = build(model_dir, flags(backend, "lora", argv))
        r = {"init": tr.state_dict_for_check(), "metrics": {}}
        for rid in range(2):
            r["metrics"][rid] = tr.train(random_samples(1, 3, seed=1000 * rid + rank, first_group=rank), rid)
        r["final"] = tr.state_dict_for_check()
        if backend == "fsdp":
            r["base_grads"] = sum(p.grad is not None for p in tr.model.parameters())
            r["base_trainable"] = sum(p.requires_grad for p in tr.model.parameters())
            adapters = {k: v.detach().clone() for k, v in tr.lora.state_dict().items()}
            spec = tr.lora.spec
        res[backend] = r
        del tr
    if rank == 0:
        torch.manual_seed(0)
        ids = torch.randint(4, 90, (2, 12))
        hooked = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ad = lora_hf.attach_hf(hooked, hooked.model.layers, spec, seed=0)
        ad.load_state_dict(adapters)
        merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        merged.load_state_dict(res["fsdp"]["final"], strict=False)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            a, b, c = hooked(input_ids=ids).logits, merged(input_ids=ids).logits, base(input_ids=ids).logits
        res["hooked_vs_merged"] = (a - b).abs().max().item()
        res["hooked_vs_base"] = (a - c).abs().max().item()
        res["scale"] = lora.LoraSpec.scale.fget(spec)
        torch.save(res, out)
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_lora_matches_megatron_and_merged_reference(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from _torchrun import torchrun_self

    from miles.trainer.megatron.convert import read_hf_state_dict
    from miles.utils.net import find_free_port

    out = tmp_path / "res.pt"
    r = torchrun_self(HERE, 2, find_free_port(), "run", str(tiny_model_dir), str(out), timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = torch.load(out, weights_only=False)
    base = read_hf_state_dict(tiny_model_dir)
    fs, mg = res["fsdp"], res["megatron"]
    for run in (fs, mg):
        assert all(torch.equal(run["init"][k], base[k]) for k in base)
        assert run["metrics"][0]["kl_loss"] == 0.0 and run["metrics"][1]["kl_loss"] != 0.0
        for k in base:
            assert (not torch.equal(run["final"][k], base[k])) == (k.split(".")[-2] in TARGETS), k
    assert fs["base_grads"] == 0 and fs["base_trainable"] == 0
    # two implementations (HF + FSDP2 vs megatron-core) after an AdamW step, the step metrics absolute (2 CPU gloo
    # ranks, 2026-12-07; pg_loss ~1e-8, kl_loss ~1e-3, grad norm ~0.5): loss, pg_loss, kl_loss, grad norm at most
    # 7.9e-9 / 9.3e-9 / 1.5e-8 / 6.0e-8 apart; bounded at about twice each
    metrics = {key: max(abs(fs["metrics"][rid][key] - mg["metrics"][rid][key]) for rid in (0, 1))
               for key in ("loss", "pg_loss", "kl_loss", "grad_norm")}
    metric_bounds = {"loss": 1.6e-8, "pg_loss": 1.9e-8, "kl_loss": 3e-8, "grad_norm": 1.2e-7}
    assert all(metrics[k] < b for k, b in metric_bounds.items()), (metrics, metric_bounds)
    diff = max((fs["final"][k] - mg["final"][k]).abs().max().item() for k in base)
    num = sum(((fs["final"][k] - mg["final"][k]) ** 2).sum().item() for k in base)
    den = sum(((mg["final"][k] - base[k]) ** 2).sum().item() for k in base)
    print({"max_abs": diff, "rel_l2": (num / den) ** 0.5, "hooked_vs_merged": res["hooked_vs_merged"],
           "hooked_vs_base": res["hooked_vs_base"], "metrics": metrics})
    # measured (2 CPU gloo ranks, 2026-12): max 5.0e-7, relative L2 2.3e-6 of the update (with each backend's own AdamW
    # defaults, beta2 0.95 / 0.999 and weight decay 0 / 0.01, it was 0.5% on every target); bounded at about twice that
    assert diff < 1e-6 and (num / den) ** 0.5 < 5e-6, (diff, (num / den) ** 0.5)
    # fp32 rounding: measured 3.3e-7 (2026-12), 2.7e-7 (2026-12-07) while the adapters move the logits by ~0.44
    assert res["hooked_vs_merged"] < 6.5e-7 and res["hooked_vs_base"] > 1e-3, res


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _worker(*sys.argv[2:4])
