"""LoRA on the DeepSeek lineage's newer families on the FSDP backend against the Megatron backend's LoRA, real gloo
ranks (torchrun): DeepSeek sparse attention (tiny GLM-5 / 5.1 ``glm_moe_dsa``, GLM-5.2's shared top-k layers,
DeepSeek-V3.2 ``deepseek_v32``; ``miles.utils.tiny_dsa`` with 8 indexer heads, as tests/multiprocess/test_megatron_dsa.py
builds them so that no indexer top-k is left to a tie) and DeepSeek-V4 (``miles.utils.tiny_dsv4``).

``test_fsdp_lora_dsa_matches_megatron``: Miles's GLM-5.1 / 5.2 LoRA recipe (radixark/miles@v0.1.0:scripts/
run_glm5_2_744b_a40b_lora.py: ``--target-modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,q_a_proj,
kv_a_proj_with_mqa,q_b_proj,kv_b_proj --experts-shared-outer-loras``, rank 4, alpha 8 here) on GLM-5 and GLM-5.2, and
per-expert adapters on DeepSeek-V3.2: FSDP2 (DP 2, transformers' model) and the Megatron backend (EP 1 x DP 2,
megatron-core's MLA with its DSAttention, ``families/dsa.py``) train 2 rollouts on the same samples from the same
adapters (``A`` drawn from the trainer seed and the Megatron module name on both, ``B`` = 0). Compared: the step
metrics, the log-probs after training, every adapter under its PEFT name (the same names on both backends: the MLA
projections', the dense and shared experts' MLPs', each routed expert's ``mlp.experts.E.gate_proj`` ...), the merged
weight-sync exports (HF names). On each backend the step-0 export is the checkpoint bit for bit and only the target
linears moved (not the indexer, the router, the norms); every MLA projection's ``B`` moved; no base parameter of the
FSDP model has a gradient; shared-outer holds one fc1 ``A`` and one fc2 ``B`` per MoE layer.

``test_fsdp_lora_dsv4_matches_megatron``: DeepSeek-V4 with ``--target-modules all-linear``, per-expert: its LoRA
targets on both backends are the MoE layers' routed experts (the clamped SwiGLU, hash and sqrtsoftplus routing) and
shared experts; V4's attention (``q_a_proj`` / ``q_b_proj`` / ``kv_proj`` / the grouped ``o_a_proj`` / ``o_b_proj``,
Megatron ``wq_a`` ...) is no target on either (``all-linear``'s MLA names select nothing there, as on the Megatron
backend). The same comparison, the exports under DeepSeek's checkpoint names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lora_parity import distance, launch_and_load, logprob_distance, metric_diffs, train_backends

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
# radixark/miles@v0.1.0:scripts/run_glm5_2_744b_a40b_lora.py's _DEFAULT_TARGET_MODULES (the DSA indexer left out)
GLM5_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,q_a_proj,kv_a_proj_with_mqa,q_b_proj,kv_b_proj"
INDEX_HEADS = 8          # test_megatron_dsa.py's: with 4, exact-zero scores straddle the top-k boundary


DSV4_TARGETS = "all-linear"


def _flags(backend: str, shared: bool, family: str) -> list[str]:
    from test_fsdp_lora_moe import MLA_FLAGS
    from test_megatron_dsv4 import DSV4_FLAGS
    from trainer_harness import flags

    v4 = family == "dsv4"
    model = list(DSV4_FLAGS) if v4 else MLA_FLAGS
    # the optimizer's defaults differ by backend (AdamW beta2 0.95 / 0.999, weight decay 0 / 0.01): set alike
    return flags(backend, "lora", "kl", ["--num-rollout", "2", "--n-samples-per-prompt", "3", "--lr", "1e-2",
                                         "--lr-decay-style", "constant", "--adam-beta2", "0.999", "--weight-decay",
                                         "0.01", "--target-modules", DSV4_TARGETS if v4 else GLM5_TARGETS,
                                         *(model if backend == "megatron" else []),
                                         *(["--experts-shared-outer-loras"] if shared else [])])


def _peft(tr, backend: str) -> dict:
    """PEFT name -> tensor of every adapter (``--save-hf``'s ``adapter/``, ``--sglang-enable-lora``'s sync)."""
    from miles.trainer import lora, lora_hf

    tensors = lora_hf.peft_tensors(tr.lora) if backend == "fsdp" else lora.peft_tensors(tr.lora, tr.shape)
    return {k: t.detach().clone() for k, t in tensors}      # (the Megatron backend's may be views of the adapters)


def _after(tr, backend: str) -> dict:
    """What ``_compare`` reads of a trained backend: the expert, MLA and PEFT-named adapters; the FSDP model's base
    gradients and shared-outer adapters."""
    from test_fsdp_lora_moe import _expert_adapters, _mla_adapters

    r = {"adapters": _expert_adapters(tr, backend), "mla": _mla_adapters(tr, backend), "peft": _peft(tr, backend)}
    if backend == "fsdp":
        r["base_grads"] = sum(p.grad is not None for p in tr.model.parameters())
        r["base_trainable"] = sum(p.requires_grad for p in tr.model.parameters())
        r["shared"] = len(tr.lora.shared)
    return r


def _worker(model_dir: str, out: str, shared: str, family: str) -> None:
    train_backends(model_dir, out, lambda backend: _flags(backend, shared == "1", family),
                   before=lambda tr, backend: {"peft0": _peft(tr, backend)}, after=_after)


FAMILIES = {"glm5": (dict(), True), "glm52": (dict(indexer_types=["full", "shared", "full"]), True),
            "dsv32": (dict(model_type="deepseek_v32", n_group=2, topk_group=1, routed_scaling_factor=2.5), False)}


def _run(model_dir: Path, tmp_path: Path, family: str, shared: bool) -> dict:
    out = tmp_path / "res.pt"
    return launch_and_load(HERE, 2, out, "run", str(model_dir), str(out), str(int(shared)), family, timeout=900)


def _compare(res: dict, base: dict, is_target, *, frozen: tuple[str, ...], moe_layers: tuple[int, ...],
             shared: bool, kl0: float = 0.0) -> tuple[float, float, float, float]:
    """The checks both families share; -> (log-probs, adapters, export max abs, export relative L2) distances.
    ``kl0``: the largest KL loss of the first step (the policy is the reference model there)."""
    import torch

    fs, mg = res["fsdp"], res["megatron"]
    print({"kl0": (fs["metrics"][0]["kl_loss"], mg["metrics"][0]["kl_loss"])})
    # the FSDP export holds the parameters: the routers' frozen buffers are not in it
    assert set(base) - set(fs["init"]) == {k for k in base if k.endswith(frozen)}, set(base) - set(fs["init"])
    for run in (fs, mg):
        assert set(run["init"]) <= set(base) and all(torch.equal(run["init"][k], base[k]) for k in run["init"])
        assert abs(run["metrics"][0]["kl_loss"]) <= kl0 and run["metrics"][1]["kl_loss"] != 0.0
        for k in run["init"]:         # only the targets moved: not the indexer, the router, the norms, the mHC
            assert (not torch.equal(run["final"][k], base[k])) == is_target(k), k
    assert fs["base_grads"] == 0 and fs["base_trainable"] == 0
    # the same adapters under the same PEFT names, the same A drawn on both, B = 0, before training
    assert sorted(fs["peft0"]) == sorted(mg["peft0"]) == sorted(fs["peft"]) == sorted(mg["peft"])
    assert all(torch.equal(fs["peft0"][k], mg["peft0"][k]) for k in fs["peft0"]), [
        (k, (fs["peft0"][k] - mg["peft0"][k]).abs().max().item()) for k in fs["peft0"]
        if not torch.equal(fs["peft0"][k], mg["peft0"][k])]
    assert all(not fs["peft0"][k].any() for k in fs["peft0"] if k.endswith("lora_B.weight"))
    assert sorted(fs["adapters"]) == sorted(mg["adapters"])
    assert len(fs["adapters"]) == len(moe_layers) * 4 * 2                   # MoE layers x experts x fc1, fc2
    moved = {k: bool(b.abs().max() > 0) for k, (_a, b) in fs["adapters"].items()}
    assert moved == {k: bool(b.abs().max() > 0) for k, (_a, b) in mg["adapters"].items()}
    assert sum(moved.values()) >= len(moved) - 2, moved        # grouped routing may leave an expert without tokens
    for layer in moe_layers:
        a1 = [fs["adapters"][f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1"][0] for e in range(4)]
        b2 = [fs["adapters"][f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc2"][1] for e in range(4)]
        assert (all(torch.equal(a1[0], x) for x in a1) and all(torch.equal(b2[0], x) for x in b2)) == shared
    assert fs["shared"] == (2 * len(moe_layers) if shared else 0)
    # the step metrics, absolute (2026-12-08, the 4 families; pg_loss ~4e-8, kl_loss ~1e-3 .. 2e-2, grad norm ~0.15 ..
    # 0.5): loss, pg_loss, kl_loss, grad norm at most 1.8e-8 (dsv4) / 9.3e-9 / 1.4e-7 (glm5) / 6.0e-8 apart; about twice
    metrics = metric_diffs(fs, mg)
    print({"metrics": metrics})
    metric_bounds = {"loss": 4e-8, "pg_loss": 2e-8, "kl_loss": 3e-7, "grad_norm": 1.2e-7}
    assert all(metrics[k] < b for k, b in metric_bounds.items()), (metrics, metric_bounds)
    lp = logprob_distance(fs, mg)
    ad = max((fs["peft"][k] - mg["peft"][k]).abs().max().item() for k in fs["peft"])
    diff, rel = distance(fs["final"], mg["final"], {k: base[k] for k in fs["init"]})
    return lp, ad, diff, rel


@pytest.mark.parametrize("family", ["glm5", "glm52", "dsv32"],
                         ids=["glm5_shared_outer", "glm52_shared_outer", "dsv32_per_expert"])
def test_fsdp_lora_dsa_matches_megatron(tmp_path: Path, family: str) -> None:
    from safetensors.torch import load_file
    from test_fsdp_lora_moe import _is_target

    from miles.utils.tiny_dsa import build_tiny_dsa_model

    kw, shared = FAMILIES[family]
    model_dir = build_tiny_dsa_model(tmp_path / family, index_n_heads=INDEX_HEADS, **kw)
    base = load_file(str(model_dir / "model.safetensors"))
    res = _run(model_dir, tmp_path, family, shared)
    fs, mg = res["fsdp"], res["megatron"]
    assert all(any(".self_attn.indexer.wq_b." in k for k in run["init"]) for run in (fs, mg))
    assert not any(".indexer." in k for k in fs["peft"])
    mla = sorted(f"decoder.layers.{i}.self_attention.linear_{t}" for i in range(3)
                 for t in ("q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj"))
    assert sorted(fs["mla"]) == sorted(mg["mla"]) == mla, sorted(fs["mla"])
    assert all(b.abs().max() > 0 for run in (fs, mg) for _a, b in run["mla"].values())
    lp, ad, diff, rel = _compare(res, base, _is_target, frozen=("e_score_correction_bias",), moe_layers=(1, 2),
                                 shared=shared)
    print({"family": family, "lp": lp, "adapters": ad, "max_abs": diff, "rel_l2": rel})
    # measured: beside BOUNDS
    assert all(x < b for x, b in zip((lp, ad, diff, rel), BOUNDS[family])), (lp, ad, diff, rel)


def _is_dsv4_target(name: str) -> bool:
    """An exported V4 tensor (DeepSeek's checkpoint names) that LoRA changes: a routed or shared expert's linear."""
    return (".ffn.experts." in name or ".ffn.shared_experts." in name) and name.endswith(("w1.weight", "w2.weight",
                                                                                          "w3.weight"))


def test_fsdp_lora_dsv4_matches_megatron(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    model_dir = build_tiny_dsv4_model(tmp_path / "dsv4")
    base = load_file(str(model_dir / "model.safetensors"))
    res = _run(model_dir, tmp_path, "dsv4", False)
    fs, mg = res["fsdp"], res["megatron"]
    assert not fs["mla"] and not mg["mla"]                   # V4's attention: no target on either backend
    modules = {k.rsplit(".", 2)[0].removeprefix("base_model.model.model.layers.") for k in fs["peft"]}
    assert {m.split(".", 1)[1] for m in modules} == {"mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                                     "mlp.shared_experts.down_proj"} | {
        f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}, modules
    lp, ad, diff, rel = _compare(res, base, _is_dsv4_target, frozen=(".ffn.gate.bias", ".ffn.gate.tid2eid"),
                                 moe_layers=(0, 1, 2, 3), shared=False,
                                 kl0=DSV4_KL0)
    print({"family": "dsv4", "lp": lp, "adapters": ad, "max_abs": diff, "rel_l2": rel})
    # measured: beside BOUNDS
    assert all(x < b for x, b in zip((lp, ad, diff, rel), BOUNDS["dsv4"])), (lp, ad, diff, rel)


# (log-probs, every adapter under its PEFT name, export max abs, export relative L2 of the update) bounds, about twice
# the measured (2 CPU gloo ranks, 2026-12-07; OMP_NUM_THREADS=1 pytest -s tests/multiprocess/test_fsdp_lora_deepseek.py):
# GLM-5 shared-outer log-probs 9.5e-7, adapters 5.7e-5 (the routed experts' and MLA's 8.8e-7: AdamW's first steps
# normalise a near-zero gradient entry to +-lr), export 2.3e-6, relative L2 8.9e-6; GLM-5.2 shared-outer 9.5e-7,
# 1.2e-5, 5.0e-7, 2.5e-6; DeepSeek-V3.2 per-expert 9.5e-7, 2.6e-6, 4.3e-7, 1.4e-6 (the non-LoRA DSA parity,
# test_megatron_dsa.py: log-probs 4.8e-7 .. 9.5e-7); DeepSeek-V4 per-expert 1.4e-6, 4.0e-5, 3.5e-6, 1.2e-5 (the
# non-LoRA V4 parity, test_megatron_dsv4.py: log-probs 4.8e-7, update 2.0e-5)
BOUNDS = {"glm5": (2e-6, 1.2e-4, 4.5e-6, 1.8e-5), "glm52": (2e-6, 2.5e-5, 1e-6, 5e-6),
          "dsv32": (2e-6, 5.5e-6, 9e-7, 2.8e-6), "dsv4": (3e-6, 8e-5, 7e-6, 2.5e-5)}
# DeepSeek-V4's first KL loss on the FSDP backend: -2.6e-8 measured (the adapted policy runs the experts through
# lora_hf's eager loop, the reference model through transformers' default grouped_mm: another summation order)
DSV4_KL0 = 5e-8


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _worker(*sys.argv[2:6])
