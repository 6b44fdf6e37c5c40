"""The Megatron backend exports every family under the checkpoint's own names, shapes and bits.

For each family module of ``miles/trainer/megatron/families/`` (each of its tiny builders, ``miles/utils/tiny_*``):
the model megatron-core builds from config.json, loaded from the checkpoint by the converter (one gloo rank, TP 1,
CPU), exports (``export.iter_hf_buckets``: the weight sync's stream, which ``--save-hf`` writes) exactly the
checkpoint's safetensors tensors: the same key set, each tensor with the checkpoint's shape, dtype and bits. The FSDP
backend's export equals the same checkpoint (``tests/unit/trainer/test_fsdp_export_names.py``), so the two backends
sync the same names. A multimodal checkpoint trained text-only (``Family.text_prefix``: Gemma 4's, Kimi-K2.5's,
Qwen3.5's VL layout) exports its text model; ``--save-hf`` adds the towers from the checkpoint
(``_checkpoint_buffers``). A checkpoint with MTP layers builds and exports them. TP / EP / PP gathers of the same
stream: the families' multiprocess tests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")


def _builders() -> dict:
    """family module -> {case: tiny builder}: every family's checkpoints as its tiny builders write them."""
    from miles.utils import (
        tiny_dsa,
        tiny_dsv4,
        tiny_gemma4,
        tiny_glm4_moe,
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
        "dense": {"dense": tiny_model.build_tiny_model, "qwen3_moe": tiny_model.build_tiny_moe_model,
                  "qwen3_vl": tiny_vlm.build_tiny_vlm},
        "mla": {"glm4_moe_lite": tiny_mla.build_tiny_mla_model,
                "deepseek_v3": lambda p: tiny_mla.build_tiny_mla_model(p, model_type="deepseek_v3", n_group=2,
                                                                       topk_group=1),
                "kimi_k2": lambda p: tiny_mla.build_tiny_mla_model(p, model_type="kimi_k2"),
                "glm4_moe_lite_mtp": lambda p: tiny_mla.build_tiny_mla_model(p, mtp_layers=1)},
        "kimi_k25": {"kimi_k25": tiny_kimi_k25.build_tiny_kimi_k25},
        "gpt_oss": {"gpt_oss": tiny_gpt_oss.build_tiny_gpt_oss_model},
        "dsa": {"glm_moe_dsa": tiny_dsa.build_tiny_dsa_model,
                "deepseek_v32": lambda p: tiny_dsa.build_tiny_dsa_model(p, model_type="deepseek_v32"),
                "glm52_shared": lambda p: tiny_dsa.build_tiny_dsa_model(p, indexer_types=["full", "shared", "full"])},
        "nemotron_h": {"nemotron_h": tiny_nemotron.build_tiny_nemotron_model},
        "gemma4": {"gemma4": tiny_gemma4.build_tiny_gemma4,
                   "gemma4_moe": lambda p: tiny_gemma4.build_tiny_gemma4(p, moe=True)},
        "deepseek_v4": {"deepseek_v4": tiny_dsv4.build_tiny_dsv4_model},
        "qwen3_next": {"qwen3_next": lambda p: tiny_qwen35.build_tiny_qwen35_model(p, kind="qwen3_next"),
                       "qwen3_5_moe_text": tiny_qwen35.build_tiny_qwen35_model,
                       "qwen3_5_moe": lambda p: tiny_qwen35.build_tiny_qwen35_model(p, vlm=True),
                       "qwen3_5_moe_mtp": lambda p: tiny_qwen35.build_tiny_qwen35_model(p, vlm=True, mtp=True)},
        "glm4_moe": {"glm4_moe": tiny_glm4_moe.build_tiny_glm4_moe},
        "inkling": {"inkling_text": tiny_inkling.build_tiny_inkling_model,
                    "inkling_mm_model": lambda p: tiny_inkling.build_tiny_inkling_model(p, published=True)},
    }


# exports that differ from the checkpoint today (each with what differs): strict, so a fix turns them red
DIFFER: dict[str, str] = {}
CASES = [pytest.param(fam, case, id=case, marks=[pytest.mark.xfail(strict=True, reason=DIFFER[case])]
                      if case in DIFFER else []) for fam, cases in _builders().items() for case in cases]


def test_every_family_has_a_case() -> None:
    """A family module added to families/ without a tiny checkpoint here fails."""
    from miles.trainer.megatron import families

    assert set(_builders()) == {_module(f) for f in families.ALL}


def _module(family) -> str:
    """The families/ module that defines ``family`` (its ``FAMILY``)."""
    import importlib
    import pkgutil

    from miles.trainer.megatron import families

    for info in pkgutil.iter_modules(families.__path__):
        if getattr(importlib.import_module(f"{families.__name__}.{info.name}"), "FAMILY", None) is family:
            return info.name
    raise AssertionError(f"no module of families/ defines {family.name}")


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _megatron_export(model_dir: Path, bucket_bytes: int,
                     mtp: bool = False) -> tuple[list[tuple[str, torch.Tensor]], object]:
    """(HF name, tensor) of the Megatron export of ``model_dir`` loaded at TP 1 (names spelled as the checkpoint
    spells them, as the trainer's ``iter_weight_buckets``), and its ``ModelShape``. ``mtp``: the checkpoint's MTP
    layers built and exported too (``--mtp-num-layers``)."""
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from miles.trainer.megatron import compat, convert, export, model, moe, parallel
    from miles.trainer.weights import checkpoint_tensor_names
    from miles.utils.model_dir import load_config
    from miles.weight_sync.hf_layout import checkpoint_spelling

    cpu = torch.device("cpu")
    groups = parallel.init_parallel(tp_size=1, num_trainer_ranks=1, seed=1, device=cpu, timeout=60)
    try:
        shape = model.ModelShape.from_hf_config(load_config(model_dir))
        if mtp:
            shape = dataclasses.replace(shape, mtp_num_layers=shape.nextn_layers)
        kw = None
        if shape.num_experts:
            compat.apply_moe_compat()
            compat.apply_moe_cpu_compat()
            kw = moe.config_kwargs(shape, moe.MoeOptions(), ep=1, etp=1, te=False)
        padded = model.padded_vocab_size(shape.vocab_size, 128, 1)
        config = model.transformer_config(shape, tp_size=1, device=cpu, moe=kw)
        gpt = model.build_gpt_model(shape, config, padded_vocab=padded, device=cpu,
                                    hf_config=AutoConfig.from_pretrained(model_dir) if shape.vision else None)
        convert.load_hf_into(gpt, convert.read_hf_state_dict(model_dir), shape, padded, 0, 1)
        spelling = checkpoint_spelling(shape.model_type, checkpoint_tensor_names(model_dir))   # as the trainer's
        pairs = [(n, t.clone()) for b in export.iter_hf_buckets(gpt, shape, groups, device=cpu, bucket_bytes=bucket_bytes,
                                                                 spelling=spelling) for n, t in b]
    finally:
        ps.destroy_model_parallel()
    return pairs, shape


@pytest.mark.parametrize("family,case", CASES)
def test_megatron_export_is_the_checkpoint(family: str, case: str, one_rank_group, tmp_path: Path) -> None:
    model_dir = _builders()[family][case](tmp_path / case)
    ckpt = _checkpoint(model_dir)
    pairs, shape = _megatron_export(model_dir, 1 << 14, mtp=case.endswith("_mtp"))
    got = dict(pairs)
    assert len(got) == len(pairs), "a name exported twice"
    prefix = shape.family.text_prefix(shape)
    if prefix is not None:          # trained text-only: the towers are not exported (--save-hf copies them)
        towers = {k for k in ckpt if not k.startswith(prefix) and k not in got}
        assert towers and not any(k.startswith(prefix) for k in towers)
        ckpt = {k: v for k, v in ckpt.items() if k not in towers}
    assert sorted(set(got) - set(ckpt)) == [] and sorted(set(ckpt) - set(got)) == []
    assert [k for k in ckpt if got[k].shape != ckpt[k].shape or got[k].dtype != ckpt[k].dtype] == []
    assert [k for k in ckpt if not torch.equal(got[k], ckpt[k])] == []


def test_dsv4_save_hf_is_the_checkpoint(one_rank_group, tmp_path: Path) -> None:
    """DeepSeek-V4: the export (DeepSeek's names: ``layers.L.attn.*``, ``embed.weight``, ``hc_head_fn``, experts one
    by one as ``ffn.experts.E.w1/w2/w3``) written as ``--save-hf`` writes it holds the checkpoint's key set bit for
    bit and loads in transformers with nothing missing or unexpected, to the weights the checkpoint loads to."""
    from transformers import AutoModelForCausalLM

    from miles.trainer.hf_export import write_hf_dir
    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    model_dir = build_tiny_dsv4_model(tmp_path / "dsv4")
    pairs, _ = _megatron_export(model_dir, 1 << 12)
    assert any(n == "layers.0.ffn.experts.1.w3.weight" for n, _ in pairs), "not DeepSeek's names"
    out = write_hf_dir(tmp_path / "saved", pairs, model_dir)
    ckpt, saved = _checkpoint(model_dir), _checkpoint(out)
    assert sorted(saved) == sorted(ckpt)
    assert [k for k in ckpt if saved[k].dtype != ckpt[k].dtype or not torch.equal(saved[k], ckpt[k])] == []
    a, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    b = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sb)


def _resaved_dsv4(tmp_path: Path) -> Path:
    """The tiny DeepSeek-V4 (DeepSeek's names) loaded by transformers and written again by ``save_pretrained``
    (its spelling: ``model.layers.L.attn.*``, ``model.embed_tokens.weight``, ``head.weight``), tokenizer beside."""
    from transformers import AutoModelForCausalLM

    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    native = build_tiny_dsv4_model(tmp_path / "native")
    saved = tmp_path / "saved"
    AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).save_pretrained(saved)
    names = _checkpoint(saved)
    assert "model.layers.0.attn.wq_a.weight" in names and sorted(names) != sorted(_checkpoint(native))
    for f in native.iterdir():
        if not f.name.endswith(".safetensors") and not (saved / f.name).exists():
            (saved / f.name).write_bytes(f.read_bytes())
    return saved


def test_dsv4_export_spells_names_as_the_checkpoint(one_rank_group, tmp_path: Path) -> None:
    """A DeepSeek-V4 checkpoint written by transformers' ``save_pretrained`` spells DeepSeek's names its own way
    (``model.layers.L.attn.wq_a.weight``, ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, ``head.weight``):
    the export (``hf_layout.checkpoint_spelling``, as the FSDP backend's ``CheckpointLayout``) holds that
    checkpoint's key set bit for bit."""
    saved = _resaved_dsv4(tmp_path)
    ckpt = _checkpoint(saved)
    got = dict(_megatron_export(saved, 1 << 14)[0])
    assert sorted(got) == sorted(ckpt)
    assert [k for k in ckpt if got[k].dtype != ckpt[k].dtype or not torch.equal(got[k], ckpt[k])] == []


def test_dsv4_trainer_save_hf_keeps_the_checkpoint_spelling(one_rank_group, tmp_path: Path) -> None:
    """The Megatron trainer itself (one gloo rank): on the ``save_pretrained``-spelled V4 checkpoint its weight
    export and its ``--save-hf`` directory hold that checkpoint's key set bit for bit (``iter_weight_buckets``
    spells the names by ``--hf-checkpoint``)."""
    from trainer_harness import build

    saved = _resaved_dsv4(tmp_path)
    tr = build(saved, ["--train-backend", "megatron", "--moe-router-score-function", "sqrtsoftplus",
                       "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "1.5",
                       "--moe-aux-loss-coeff", "0", "--expert-tensor-parallel-size", "1"], group=one_rank_group)
    ckpt = _checkpoint(saved)
    got = {n: t.clone() for b in tr.iter_weight_buckets(1 << 14) for n, t in b}
    assert sorted(got) == sorted(ckpt)
    tr.save_hf(tmp_path / "out")
    out = _checkpoint(tmp_path / "out")
    assert sorted(out) == sorted(ckpt)
    assert [k for k in ckpt if out[k].dtype != ckpt[k].dtype or not torch.equal(out[k], ckpt[k])] == []
