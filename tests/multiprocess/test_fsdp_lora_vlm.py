"""LoRA on a vision-language checkpoint's text model on the FSDP backend against the Megatron backend's, real gloo ranks
(torchrun): tiny Qwen3.5-MoE as published (``qwen3_5_moe``: ``Qwen3_5MoeForConditionalGeneration``, the vision tower
beside the text model ``model.language_model.*``, ``preprocessor_config.json`` for its image processor;
``miles.utils.tiny_qwen35`` with ``vlm=True``), the leaf names of Miles's Qwen3.5 LoRA recipe's targets
(radixark/miles@v0.1.0:scripts/run_qwen3_5_35b_a3b_lora.py: ``language_model.decoder.layers.*.{self_attention.linear_qkv,
self_attention.linear_proj, mlp.experts.linear_fc1/2, mlp.shared_experts.linear_fc1/2, self_attention.in_proj,
self_attention.out_proj}``; the FSDP backend takes leaf names, not module paths).

FSDP2 (DP 2, transformers' VLM, text-only samples) and the Megatron backend (TP 1 x DP 2, the text model) train 2
rollouts on the same samples from the same adapters (``test_fsdp_lora_gdn.py``'s worker): step metrics, log-probs
after training, every ``A``, and the merged weight-sync exports of the text model agree; the FSDP export at step 0 is
the checkpoint bit for bit (the vision tower included) and exactly the targets moved (not the vision tower); the
adapters' PEFT names are the text model's modules (``model.language_model.layers.L...``) on the FSDP backend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lora_parity import distance, launch_and_load, logprob_distance, metric_diffs, train_backends

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
RECIPE = "linear_qkv,linear_proj,linear_fc1,linear_fc2,in_proj,out_proj"     # the recipe's paths' leaves


def _after(tr, backend: str) -> dict:
    """Every target's ``A``; on the FSDP backend the adapters' PEFT names and the vision tower's trainable count."""
    import test_fsdp_lora_gdn as gdn

    from miles.trainer import lora_hf

    r = {"a": gdn._a_factors(tr, backend)}
    if backend == "fsdp":
        r["peft"] = sorted(k for k, _ in lora_hf.peft_tensors(tr.lora))
        r["vision_trainable"] = sum(p.requires_grad for n, p in tr.model.named_parameters() if ".visual." in n)
    return r


def _worker(model_dir: str, out: str) -> None:
    import test_fsdp_lora_gdn as gdn

    train_backends(model_dir, out, lambda backend: gdn._flags(backend, "qwen3_5_moe") + ["--target-modules", RECIPE],
                   before=lambda tr, backend: {"a0": gdn._a_factors(tr, backend)}, after=_after)


def test_fsdp_lora_qwen35_vlm_matches_megatron(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from test_fsdp_lora_gdn import MOVED

    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    model_dir = build_tiny_qwen35_model(tmp_path / "qwen35_vlm", vlm=True)
    assert (model_dir / "preprocessor_config.json").exists()
    base = load_file(str(model_dir / "model.safetensors"))
    out = tmp_path / "res.pt"
    res = launch_and_load(HERE, 2, out, "run", str(model_dir), str(out), timeout=600)
    fs, mg = res["fsdp"], res["megatron"]
    # the Megatron backend trains the text model only and exports it; the FSDP backend exports the vision tower too
    assert set(mg["init"]) <= set(fs["init"]) and all(".visual." in k for k in set(fs["init"]) - set(mg["init"]))
    assert any(".visual." in k for k in fs["init"]) and fs["vision_trainable"] == 0
    for run in (fs, mg):
        assert set(run["init"]) <= set(base) and all(torch.equal(run["init"][k], base[k]) for k in run["init"])
        for k in run["init"]:
            target = k.endswith(".weight") and k.split(".")[-2] in MOVED and ".visual." not in k
            assert (not torch.equal(run["final"][k], base[k])) == target, k
    assert sorted(fs["a0"]) == sorted(mg["a0"]) and all(torch.equal(fs["a0"][k], mg["a0"][k]) for k in fs["a0"])
    assert len([k for k in fs["a0"] if k.endswith((".in_proj", ".out_proj"))]) == 2 * 3
    assert len([k for k in fs["a0"] if ".local_experts." in k]) == 4 * 4 * 2
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in fs["peft"]), fs["peft"][:3]
    # the step metrics, absolute (2026-12-08; pg_loss ~4e-8, kl_loss ~2e-3, grad norm ~0.32): loss, pg_loss, kl_loss at
    # most 5.2e-9 / 9.3e-9 / 3.9e-8 apart, about twice each; the grad norm equal (measured 0), bounded at 2 of its
    # fp32 ulps (3e-8 each)
    metrics = metric_diffs(fs, mg)
    print({"metrics": metrics})
    metric_bounds = {"loss": 1.1e-8, "pg_loss": 2e-8, "kl_loss": 8e-8, "grad_norm": 6e-8}
    assert all(metrics[k] < b for k, b in metric_bounds.items()), (metrics, metric_bounds)
    lp = logprob_distance(fs, mg)
    ad = max((fs["a"][k] - mg["a"][k]).abs().max().item() for k in fs["a"])
    diff, rel = distance(fs["final"], mg["final"], {k: base[k] for k in sorted(set(fs["init"]) & set(mg["init"]))})
    print({"lp": lp, "a": ad, "max_abs": diff, "rel_l2": rel})
    # measured (2 CPU gloo ranks, 2026-12-07; pytest -s): log-probs 9.5e-7, A 1.1e-5 (a routed expert's), exports max
    # 6.1e-6, relative L2 of the update 1.4e-5: the text-only Qwen3.5-MoE's figures (test_fsdp_lora_gdn.py); about twice
    bounds = (2e-6, 2.5e-5, 1.2e-5, 2.8e-5)
    assert all(x <= b for x, b in zip((lp, ad, diff, rel), bounds)), ((lp, ad, diff, rel), bounds)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _worker(*sys.argv[2:4])
