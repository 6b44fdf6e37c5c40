"""The FSDP backend exports every family under the checkpoint's own names and shapes.

transformers 5 converts some checkpoints on load (renames such as Nemotron-H's ``backbone.*`` -> ``model.*``, per-expert
MoE weights stacked into 3-D tensors, ...: ``transformers.conversion_mapping``). For every family the FSDP backend
loads, built tiny here and written by ``save_pretrained`` (the checkpoint's names), the export -- the weight sync's
buckets (small ones and one big one, fp32 and bf16), the p2p mode's local shards and the ``--save-hf`` directory --
holds exactly the checkpoint's safetensors tensors, name for name, shape for shape, and bit for bit right after load
(single gloo rank; the 2-rank gather: ``tests/multiprocess/test_moe_export_fsdp_vs_megatron.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_harness import build_from_config, checkpoint_tensors, export_by_name, flags, parse


def _families() -> dict:
    from miles.utils import (
        tiny_dsa,
        tiny_dsv4,
        tiny_gemma4,
        tiny_gpt_oss,
        tiny_inkling,
        tiny_kimi_k25,
        tiny_mla,
        tiny_model,
        tiny_nemotron,
        tiny_qwen35,
        tiny_vlm,
    )

    return {
        "dense": tiny_model.build_tiny_model,
        "qwen3_moe": tiny_model.build_tiny_moe_model,
        "nemotron_h": tiny_nemotron.build_tiny_nemotron_model,
        "gpt_oss": tiny_gpt_oss.build_tiny_gpt_oss_model,
        "qwen3_5_moe_text": tiny_qwen35.build_tiny_qwen35_model,
        "qwen3_next": lambda p: tiny_qwen35.build_tiny_qwen35_model(p, kind="qwen3_next"),
        "qwen3_5_moe": lambda p: tiny_qwen35.build_tiny_qwen35_model(p, vlm=True),
        "glm4_moe_lite": tiny_mla.build_tiny_mla_model,
        "deepseek_v3": lambda p: tiny_mla.build_tiny_mla_model(p, model_type="deepseek_v3", n_group=2, topk_group=1),
        "kimi_k2": lambda p: tiny_mla.build_tiny_mla_model(p, model_type="kimi_k2"),
        "glm_moe_dsa": tiny_dsa.build_tiny_dsa_model,
        "deepseek_v32": lambda p: tiny_dsa.build_tiny_dsa_model(p, model_type="deepseek_v32"),
        "deepseek_v4": tiny_dsv4.build_tiny_dsv4_model,
        "gemma4": tiny_gemma4.build_tiny_gemma4,
        "gemma4_moe": lambda p: tiny_gemma4.build_tiny_gemma4(p, moe=True),
        "kimi_k25": tiny_kimi_k25.build_tiny_kimi_k25,
        "qwen3_vl": tiny_vlm.build_tiny_vlm,
        "inkling_text": tiny_inkling.build_tiny_inkling_model,
    }


FAMILIES = list(_families())
# multimodal checkpoints the FSDP backend does not load here: Kimi-K2.5's image processor (transformers'
# Kimi_K25ImageProcessor, which the FSDP backend loads for a vision-language checkpoint) has a torchvision backend only,
# and torchvision is not installed; its names are checked on the engine's index only. (Qwen3.5-MoE's builder writes
# its preprocessor_config.json, a Qwen2-VL image processor with a PIL backend: checked here.)
NOT_ON_FSDP = ("kimi_k25",)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _families()[request.param](tmp_path_factory.mktemp(request.param))


def _check_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    assert [k for k in want if got[k].shape != want[k].shape] == []
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []


def test_fsdp_export_is_the_checkpoint(family, one_rank_group, tmp_path) -> None:
    from miles.weight_sync.buckets import pack_bucket
    from miles.weight_sync.p2p import pack_local, plan_bucket

    name, model_dir = family
    if name in NOT_ON_FSDP:
        pytest.skip(f"the FSDP backend does not load the tiny {name} (its image processor needs torchvision)")
    tr = build_from_config(parse(model_dir, flags("fsdp")), group=one_rank_group)
    ckpt = checkpoint_tensors(model_dir)
    buffers = dict(tr._checkpoint_buffers(set()))            # the router biases FSDP holds as buffers
    params = {k: v for k, v in ckpt.items() if k not in buffers}
    for bucket_bytes in (1 << 12, 64 << 20):
        _check_same(export_by_name(tr, bucket_bytes), params)
        _check_same(export_by_name(tr, bucket_bytes, torch.bfloat16), {k: v.to(torch.bfloat16) for k, v in params.items()})
        full, shards = list(tr.iter_weight_buckets(bucket_bytes)), list(tr.iter_weight_shards(bucket_bytes))
        assert [[n for n, _ in b] for b in full] == [[s.name for s in b] for b in shards]
        for fb, sb in zip(full, shards):                    # p2p: same names, shapes and flattened bytes
            flat, meta = pack_bucket(fb)
            plan = plan_bucket(sb, 1)
            assert plan.shapes == [m["shape"] for m in meta] and plan.total == flat.numel()
            assert torch.equal(pack_local(sb, torch.device("cpu")), flat)
    tr.save_hf(tmp_path / "hf")
    _check_same(checkpoint_tensors(tmp_path / "hf"), ckpt)


def test_engine_index_takes_the_checkpoint_names(family) -> None:
    """The embedded engine's parameter index (``model_runner.ParamIndex`` over transformers' model, with the
    checkpoint's renames and parts): every checkpoint name resolves to a live tensor (or a view of one) equal to the
    checkpoint's, and the checkpoint's names cover every live tensor (``/update_weights_from_disk``)."""
    from miles.engine.model_runner import ParamIndex
    from miles.engine.weights import check_full_coverage, checkpoint_parts, checkpoint_renames
    from miles.trainer.modeling import load_hf_model

    name, model_dir = family
    model = load_hf_model(model_dir, torch.device("cpu"))      # transformers' model (a VLM's too), as loaded
    index = ParamIndex(model.state_dict(keep_vars=True), checkpoint_renames(model_dir, model),
                       checkpoint_parts(model_dir, model))
    ckpt = checkpoint_tensors(model_dir)
    if name == "kimi_k25":     # its vision tower's fused wqkv: split and RoPE-permuted on load, not a view; never
        ckpt = {k: v for k, v in ckpt.items() if ".wqkv." not in k}   # sent (trainers train the text)
    assert [k for k in ckpt if k not in index] == []
    assert [k for k in ckpt if index[k].shape != ckpt[k].shape or not torch.equal(index[k].detach(), ckpt[k])] == []
    check_full_coverage(ckpt, index, partial=name == "kimi_k25")


def test_embedded_engine_takes_nemotron_h_s_export(one_rank_group, tmp_path) -> None:
    """Nemotron-H's export (``backbone.*``, per-expert ``mixer.experts.<e>.{up,down}_proj.weight``) into an embedded
    engine serving it: broadcast (flattened buckets), p2p (the trainer's own shards) and disk-delta (a full version,
    then a delta); ``--check-weight-update-equal`` (``check``: every exported tensor read back by that name) passes
    after each. (Qwen3-MoE's: ``test_fsdp_moe_export.py``.)"""
    import dataclasses
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "multiprocess"))
    from weight_sync_worker import perturb, start_engine, wait_healthy

    from miles.utils.tiny_nemotron import build_tiny_nemotron_model
    from miles.weight_sync.base import build_weight_sender

    model_dir = build_tiny_nemotron_model(tmp_path / "nemotron")
    cfg = parse(model_dir, flags("fsdp", ["--update-weight-buffer-size", "16KiB", "--update-weight-timeout", "60",
                                          "--update-weight-disk-dir", str(tmp_path / "versions")]))
    tr = build_from_config(cfg, group=one_rank_group)
    n_params = len(export_by_name(tr, 64 << 20))
    assert all(n.startswith(("backbone.", "lm_head.")) for n in export_by_name(tr, 64 << 20))
    sup, target = start_engine(str(model_dir), tmp_path / "engine.log")
    try:
        wait_healthy(target)
        version = 0
        for step, mode in enumerate(("broadcast", "p2p"), start=1):
            perturb(tr, step, 0)
            sender = build_weight_sender(dataclasses.replace(cfg.weights, update_weight_transfer_mode=mode), tr,
                                         is_source=True, engines=[target], status_group=one_rank_group,
                                         initial_version=version)
            sender.connect([target])
            version = sender.sync().version
            assert sender.check() == n_params, mode
            sender.close()
        dk = build_weight_sender(dataclasses.replace(cfg.weights, update_weight_transfer_mode="disk-delta"), tr,
                                 is_source=True, engines=[target], status_group=one_rank_group,
                                 initial_version=version, model_dir=str(model_dir))
        try:
            for step in (3, 4):                         # full version, then a delta on top of it
                perturb(tr, step, 0)
                dk.sync()
                assert dk.check() == n_params
            assert dk.fallbacks == 0
        finally:
            dk.close()
    finally:
        sup.stop()
