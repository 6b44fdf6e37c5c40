"""The FSDP backend's LoRA on a vision-language checkpoint's text model (``miles/trainer/lora_hf.py``'s
``VLM_MODEL_TYPES``, ``attach_hf_model``): tiny Qwen3.5-MoE as published (``qwen3_5_moe``:
``Qwen3_5MoeForConditionalGeneration``, the text model under ``model.language_model.``; ``miles.utils.tiny_qwen35``
with ``vlm=True``), one process.

The adapters sit on the text model's decoder layers (the attention, the gated DeltaNet, the routed and shared experts),
named as the text model's Megatron modules (``decoder.layers.L...``, the Megatron backend's draw) and exported under
the VLM's HF names (``model.language_model.layers.L...``, what the weight export merges into and PEFT names); the
vision tower is frozen and adapted nowhere. The merged-weights reference: the adapter forward gives the logits of a
plain VLM whose weights are ``W + (alpha / r) B @ A``; B = 0 the base model bit for bit (transformers' eager experts).
Kimi-K2.5 (``kimi_k25``) stays refused in one line: the FSDP backend does not load it here (its image processor needs
torchvision). FSDP against the Megatron backend: ``tests/multiprocess/test_fsdp_lora_vlm.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _lora_hf import merged_reference

from miles.config import ConfigError
from miles.config.lora import resolve
from miles.trainer import lora, lora_hf

RECIPE = "linear_qkv,linear_proj,linear_fc1,linear_fc2,in_proj,out_proj"   # Miles's Qwen3.5 recipe's paths' leaves


def _spec(targets: str) -> lora.LoraSpec:
    return lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=resolve(targets).leaves)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    return build_tiny_qwen35_model(tmp_path_factory.mktemp("qwen35_vlm"), vlm=True)


def _model(path, **kw):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, **kw)


def test_vlm_adapters_equal_their_merged_weights(vlm_dir) -> None:
    model, base = _model(vlm_dir), _model(vlm_dir, experts_implementation="eager")
    cfg = json.loads((vlm_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and "vision_config" in cfg
    spec = _spec(RECIPE)
    lora_hf.check_model(spec, cfg)                        # passes: no refusal
    ad = lora_hf.attach_hf_model(model, spec, seed=5)
    n = cfg["text_config"]["num_hidden_layers"]
    assert all(k.startswith("model.language_model.layers.") for k in ad.hf_targets())
    assert {k.split(".")[-1] for k in ad.targets} == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                                      "in_proj", "out_proj"}
    assert len([k for k in ad.targets if ".local_experts." in k]) == n * 4 * 2
    assert all(k.startswith("decoder.layers.") for k in ad.targets)
    assert not any(p.requires_grad for p in model.parameters())
    peft = dict(lora_hf.peft_tensors(ad))
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in peft)
    modules = {name for name, _ in model.named_modules()}
    assert all(k.removeprefix("base_model.model.").rsplit(".", 2)[0] in modules for k in peft
               if ".mlp.experts." not in k)

    r = merged_reference(model, base, ad, seq_len=12)
    assert r.base_exact                                   # B = 0: the base model bit for bit
    err, moved, ids = r.err, r.moved, r.ids
    print({"hooked_vs_merged": err, "moved": moved})
    # fp32 rounding: measured (2026-12-07, CPU; pytest -s) 1.7e-5 while the adapters move the logits by 0.81 (Qwen3-Next's
    # DeltaNet in test_lora_hf_gdn.py: 1.6e-5); bounded at about twice
    assert err < 3.3e-5 and moved > 1e-2, (err, moved)
    model(input_ids=ids).logits.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())           # the vision tower's included
    assert all(g.lora_A.grad is not None and g.lora_A.grad.abs().sum() > 0 for g in ad.groups.values())


def test_vlm_refusals() -> None:
    """Kimi-K2.5 (and any vision-language model type not in VLM_MODEL_TYPES) is refused in one line."""
    with pytest.raises(ConfigError, match=r"^--lora-rank with the vision-language --hf-checkpoint kimi_k25 is not "
                                          r"supported by the FSDP backend .*qwen3_5_moe\); drop --lora-rank\.$"):
        lora_hf.check_model(_spec("q_a_proj"), {"model_type": "kimi_k25", "vision_config": {},
                                                "text_config": {"model_type": "deepseek_v3", "kv_lora_rank": 16}})


def test_kimi_k25_on_fsdp_is_one_line(tmp_path) -> None:
    """The FSDP backend does not load Kimi-K2.5 here: its image processor (transformers' Kimi_K25ImageProcessor, which
    the tiny checkpoint's preprocessor_config.json names, as the published one does) has a torchvision backend only;
    loading it gives one line naming the checkpoint, the cause and the fix, not a traceback."""
    import importlib.util

    from miles.trainer import vlm
    from miles.utils.tiny_kimi_k25 import build_tiny_kimi_k25

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: Kimi-K2.5's image processor loads")
    path = build_tiny_kimi_k25(tmp_path / "k25")
    assert (path / "preprocessor_config.json").exists()
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint .*k25: the FSDP backend could not load this "
                                          r"vision-language checkpoint's image processor \(.*torchvision.*\); .* add "
                                          r"--train-backend megatron\.$") as e:
        vlm.ImageProcessor(str(path), 0)
    assert "\n" not in str(e.value)
