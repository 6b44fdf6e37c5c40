"""The FSDP backend's weight export of a Qwen3-MoE model (tiny, single gloo rank): transformers 5 holds the experts
fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); the export (weight-sync buckets,
``--save-hf``) uses the checkpoint's per-expert names and shapes, and the embedded engine takes them over
``/update_weights_from_distributed`` and ``/update_weights_from_disk`` (full and delta) to bitwise equality."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from trainer_harness import build_from_config, checkpoint_tensors, export_by_name, flags, parse, same_tensors


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_model import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"), mlp_only_layers=(1,), num_layers=3)


def _cfg(model_dir: Path, *extra: str):
    return parse(model_dir, flags("fsdp", list(extra)))


def _trainer(cfg, group):
    return build_from_config(cfg, group=group)


def _layout(model_dir: Path):
    from transformers import AutoModelForCausalLM

    from miles.trainer.weights import checkpoint_tensor_names
    from miles.weight_sync.hf_layout import CheckpointLayout

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return m, CheckpointLayout(m, [(n, p.shape) for n, p in m.named_parameters()], checkpoint_tensor_names(model_dir))


def test_layout_splits_fused_experts_as_views(moe_dir) -> None:
    """transformers' conversion reverted: the fused experts -> per-expert tensors, views of the fused ones (no copy),
    each expert's gate and up in their byte order; names the conversion leaves alone pass through unchanged."""
    m, layout = _layout(moe_dir)
    gu = dict(m.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].detach()
    down = dict(m.named_parameters())["model.layers.0.mlp.experts.down_proj"].detach()
    x = torch.ones(2)
    out = layout.revert([("model.layers.0.mlp.experts.gate_up_proj", gu),
                         ("model.layers.0.mlp.experts.down_proj", down), ("model.norm.weight", x)])
    e_count, half = gu.shape[0], gu.shape[1] // 2
    assert [n for n, _ in out] == [f"model.layers.0.mlp.experts.{e}.{k}_proj.weight" for e in range(e_count)
                                   for k in ("gate", "up")] + [f"model.layers.0.mlp.experts.{e}.down_proj.weight"
                                                               for e in range(e_count)] + ["model.norm.weight"]
    d = dict(out)
    assert torch.equal(d["model.layers.0.mlp.experts.1.gate_proj.weight"], gu[1, :half])
    assert torch.equal(d["model.layers.0.mlp.experts.1.up_proj.weight"], gu[1, half:])
    assert torch.equal(d["model.layers.0.mlp.experts.0.down_proj.weight"], down[0])
    assert d["model.layers.0.mlp.experts.1.up_proj.weight"].data_ptr() == gu[1, half:].data_ptr()   # a view
    assert d["model.norm.weight"] is x


def test_layout_keeps_a_fused_checkpoint_fused(moe_dir, tmp_path) -> None:
    """A checkpoint that stores the experts fused (transformers' own layout, ``save_original_format=False``) loads
    without conversion, and its export keeps them fused."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).save_pretrained(
        tmp_path / "fused", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in checkpoint_tensors(tmp_path / "fused")
    m, layout = _layout(tmp_path / "fused")
    assert layout.parts == {} and layout.groups == {} and layout.computed == set()


@pytest.mark.parametrize("bucket_bytes", [1 << 12, 64 << 20], ids=["small_buckets", "one_bucket"])
def test_fsdp_export_equals_the_checkpoint(moe_dir, one_rank_group, bucket_bytes) -> None:
    tr = _trainer(_cfg(moe_dir), one_rank_group)
    ckpt = checkpoint_tensors(moe_dir)
    assert same_tensors(export_by_name(tr, bucket_bytes), ckpt)                  # fp32: names, shapes, bits
    bf16 = export_by_name(tr, bucket_bytes, torch.bfloat16)
    assert same_tensors(bf16, {k: v.to(torch.bfloat16) for k, v in ckpt.items()})
    assert tr.state_dict_for_check().keys() == ckpt.keys()


def test_save_hf_round_trips_with_the_checkpoint_names(moe_dir, one_rank_group, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    tr = _trainer(_cfg(moe_dir), one_rank_group)
    with torch.no_grad():                                       # trained weights, not the checkpoint's
        for p in tr.model.parameters():
            p.add_(0.01)
    exported = export_by_name(tr, 1 << 20)
    tr.save_hf(tmp_path / "hf")
    saved = checkpoint_tensors(tmp_path / "hf")
    assert sorted(saved) == sorted(checkpoint_tensors(moe_dir)) and same_tensors(saved, exported)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    live = {n: p.detach() for n, p in tr.model.named_parameters()}
    from miles.trainer.modeling import hf_name

    live = {hf_name(n): t for n, t in live.items()}
    assert same_tensors({n: p.detach() for n, p in back.named_parameters()}, live)


def test_embedded_engine_takes_the_fsdp_export(moe_dir, one_rank_group, tmp_path) -> None:
    """broadcast (flattened buckets), p2p (the trainer's own shards) and disk-delta (a full version, then a delta) from the FSDP trainer into an
    embedded engine serving the MoE model: ``--check-weight-update-equal`` passes after each."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "multiprocess"))
    from weight_sync_worker import perturb, start_engine, wait_healthy

    from miles.weight_sync.base import build_weight_sender

    cfg = _cfg(moe_dir, "--update-weight-buffer-size", "16KiB", "--update-weight-timeout", "60",
               "--update-weight-disk-dir", str(tmp_path / "versions"))
    tr = _trainer(cfg, one_rank_group)
    sup, target = start_engine(str(moe_dir), tmp_path / "engine.log")
    try:
        wait_healthy(target)
        pg = one_rank_group
        perturb(tr, 1, 0)
        bc = build_weight_sender(cfg.weights, tr, is_source=True, engines=[target], status_group=pg,
                                 initial_version=0)
        bc.connect([target])
        r = bc.sync()
        assert bc.check() == len(checkpoint_tensors(moe_dir))
        bc.close()
        perturb(tr, 4, 0)                               # p2p: the trainer's own shards, per-expert names
        p2 = build_weight_sender(dataclasses.replace(cfg.weights, update_weight_transfer_mode="p2p"), tr,
                                 is_source=True, engines=[target], status_group=pg, initial_version=r.version)
        p2.connect([target])
        r = p2.sync()
        assert p2.check() == len(checkpoint_tensors(moe_dir))
        p2.close()
        dk = build_weight_sender(dataclasses.replace(cfg.weights, update_weight_transfer_mode="disk-delta"), tr,
                                 is_source=True, engines=[target], status_group=pg, initial_version=r.version,
                                 model_dir=str(moe_dir))
        try:
            for step in (2, 3):                         # full version, then a delta on top of it
                perturb(tr, step, 0)
                dk.sync()
                assert dk.check() == len(checkpoint_tensors(moe_dir))
            assert dk.fallbacks == 0                    # the engine applied the delta itself (no full fallback)
            assert any(p.name.startswith("delta_v") for p in (tmp_path / "versions").iterdir())
        finally:
            dk.close()
    finally:
        sup.stop()


def test_disk_coverage_counts_per_expert_names_for_fused_experts() -> None:
    """``/update_weights_from_disk`` of a full dir: per-expert names cover a fused expert tensor only when every
    expert's gate, up and down are there."""
    from miles.engine.model_runner import ParamIndex
    from miles.engine.weights import WeightUpdateError, check_full_coverage

    live = ParamIndex({"l.mlp.experts.gate_up_proj": torch.zeros(2, 4, 3), "l.mlp.experts.down_proj": torch.zeros(2, 3, 2),
                       "l.norm.weight": torch.zeros(3)})
    full = {n: torch.zeros(1) for n in ["l.norm.weight"] + [f"l.mlp.experts.{e}.{k}_proj.weight" for e in range(2)
                                                            for k in ("gate", "up", "down")]}
    check_full_coverage(full, live)                                              # per-expert names
    check_full_coverage({n: live[n] for n in live}, live)                        # fused names
    with pytest.raises(WeightUpdateError, match=r"lacks 1 of the model's tensors, e.g. \['l.mlp.experts.down_proj'\]"):
        check_full_coverage({n: t for n, t in full.items() if n != "l.mlp.experts.1.down_proj.weight"}, live)


@pytest.mark.parametrize("bucket_bytes", [1 << 12, 64 << 20], ids=["small_buckets", "one_bucket"])
def test_p2p_shards_use_the_checkpoint_names_and_the_same_bytes(moe_dir, one_rank_group, bucket_bytes) -> None:
    """``--update-weight-transfer-mode p2p``: the trainer's own shards go out in the buckets, names, shapes and
    flattened bytes of the gathering export (per-expert names, not transformers' fused ones)."""
    from miles.weight_sync.buckets import pack_bucket
    from miles.weight_sync.p2p import pack_local, plan_bucket

    tr = _trainer(_cfg(moe_dir), one_rank_group)
    full = list(tr.iter_weight_buckets(bucket_bytes))
    shards = list(tr.iter_weight_shards(bucket_bytes))
    assert [[n for n, _ in b] for b in full] == [[s.name for s in b] for b in shards]
    assert any(".mlp.experts.0.gate_proj.weight" in s.name for b in shards for s in b)
    for fb, sb in zip(full, shards):
        flat, meta = pack_bucket(fb)
        plan = plan_bucket(sb, 1)
        assert plan.shapes == [m["shape"] for m in meta] and plan.total == flat.numel()
        assert torch.equal(pack_local(sb, torch.device("cpu")), flat)


def test_revert_shards_keeps_every_rank_s_byte_ranges(moe_dir) -> None:
    """Two trainer ranks, experts split 2 + 2 on dim 0 (and a 3 + 1 split of a 4-row tensor that is not an expert
    tensor): the per-expert shards tile the bucket with the fused tensor's byte ranges, each rank packs the same
    bytes, and its data are the rows of the experts it holds."""
    from miles.weight_sync.p2p import LocalShard, _splits, pack_local, plan_bucket, revert_shards

    m, layout = _layout(moe_dir)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    gu = dict(m.named_parameters())[name].detach()
    e_count, half = gu.shape[0], gu.shape[1] // 2
    splits = _splits(e_count, 2, True)
    for rank in range(2):
        a, b = splits[rank]
        fused = [LocalShard(name, tuple(gu.shape), torch.float32, splits, gu[a:b].contiguous()),
                 LocalShard("model.norm.weight", (2,), torch.float32, _splits(2, 2, False),
                            torch.ones(2) if rank == 0 else torch.ones(0))]
        split = revert_shards(fused, rank, layout)
        assert [s.name for s in split] == [f"model.layers.0.mlp.experts.{e}.{k}_proj.weight" for e in range(e_count)
                                           for k in ("gate", "up")] + ["model.norm.weight"]
        assert plan_bucket(split, 2).ranges == plan_bucket(fused, 2).ranges
        assert torch.equal(pack_local(split, torch.device("cpu")), pack_local(fused, torch.device("cpu")))
        up1 = split[3].data
        assert torch.equal(up1, gu[1, half:]) if a <= 1 < b else up1.numel() == 0


def test_save_hf_keeps_the_router_bias_buffers(one_rank_group, tmp_path) -> None:
    """GLM-4.7-Flash / DeepSeek-V3 routers hold ``e_score_correction_bias`` as a buffer, not a parameter: --save-hf
    writes it as the checkpoint has it."""
    from miles.utils.tiny_mla import build_tiny_mla_model

    src = build_tiny_mla_model(tmp_path / "glm")
    ckpt = checkpoint_tensors(src)
    biases = sorted(k for k in ckpt if k.endswith("e_score_correction_bias"))
    assert biases
    tr = _trainer(_cfg(src), one_rank_group)
    tr.save_hf(tmp_path / "hf")
    saved = checkpoint_tensors(tmp_path / "hf")
    assert sorted(saved) == sorted(ckpt)
    assert all(saved[k].dtype == ckpt[k].dtype and torch.equal(saved[k], ckpt[k]) for k in biases)
