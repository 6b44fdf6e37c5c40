"""The FSDP backend's export of an MoE model equals the Megatron backend's export of the same weights, on 2 real
gloo ranks (torchrun): Qwen3-MoE (transformers 5 fuses its per-expert gate/up/down) and Nemotron-H (transformers 5
renames its ``backbone.*`` to ``model.*`` and stacks its gate-less per-expert ``up_proj`` / ``down_proj``).

FSDP2 at DP 2 (every parameter sharded on dim 0, the fused experts gathered from both ranks) exports the
untrained checkpoint and then perturbed ("trained") weights, which it writes with ``--save-hf``. The Megatron
backend at EP 2 (each rank holds half of the experts) loads the checkpoint, then that ``--save-hf`` directory:
both of its exports equal FSDP's bit for bit (names, shapes, values; fp32 and bf16), and the first equals the
checkpoint's safetensors. The FSDP export holds parameters only: the tensors the checkpoint keeps as buffers
(Nemotron-H's router ``e_score_correction_bias``) are compared apart, in ``--save-hf``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


MEGATRON_FLAGS = {
    "qwen3_moe": ("--num-experts", "4", "--moe-router-topk", "2"),
    "nemotron_h": ("--expert-tensor-parallel-size", "1", "--position-embedding-type", "none", "--moe-latent-size", "32"),
}


def _worker(model_dir: str, out: str, family: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from test_megatron import _flags
    from trainer_harness import PRESETS, build, export_by_name, same_tensors

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saved = str(Path(out).parent / "fsdp_hf")
    fsdp = build(model_dir, _flags("fsdp", 1))
    f_init, f_init_bf16 = export_by_name(fsdp, 16 << 10), export_by_name(fsdp, 16 << 10, torch.bfloat16)
    buffers = sorted(n for n, _ in fsdp._checkpoint_buffers(set()))      # in the checkpoint, not parameters
    g = torch.Generator().manual_seed(11 + rank)
    with torch.no_grad():                                    # "trained": every local shard moves differently
        for p in fsdp.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.01 * torch.randn(local.shape, generator=g))
    f_trained = export_by_name(fsdp, 16 << 10)
    fsdp.save_hf(saved)
    del fsdp

    res = {}
    flags = ("--expert-model-parallel-size", "2", *PRESETS["moe_fp32_router"], *MEGATRON_FLAGS[family])
    ckpt = load_file(str(Path(model_dir) / "model.safetensors"))
    res["buffers"] = buffers
    for tag, src in (("init", model_dir), ("trained", saved)):
        meg = build(src, _flags("megatron", 1, megatron_flags=flags))
        res[f"ep_{tag}"] = meg.groups.ep_size
        m = export_by_name(meg, 16 << 10)
        res[f"meg_buffers_{tag}"] = sorted(set(m) - set(f_init))
        m_bufs = {k: m.pop(k) for k in buffers if k in m}
        if tag == "init":
            res["init_equal"] = same_tensors(m, f_init)
            m_bf16 = export_by_name(meg, 16 << 10, torch.bfloat16)
            res["init_bf16_equal"] = same_tensors({k: v for k, v in m_bf16.items() if k not in buffers}, f_init_bf16)
            res["init_is_checkpoint"] = same_tensors(f_init, {k: v for k, v in ckpt.items() if k not in buffers})
            res["buffers_are_checkpoint"] = same_tensors(m_bufs, {k: ckpt[k] for k in buffers})
        else:
            on_disk = load_file(str(Path(saved) / "model.safetensors"))
            res["trained_equal"] = same_tensors(m, f_trained)
            res["trained_moved"] = not same_tensors(f_trained, f_init)
            res["saved_names"] = sorted(on_disk) == sorted(ckpt)
            res["saved_shapes"] = all(on_disk[k].shape == ckpt[k].shape for k in ckpt)
        del meg
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("family", list(MEGATRON_FLAGS))
def test_fsdp_moe_export_equals_megatron_export(tmp_path: Path, free_port: int, family: str) -> None:
    import torch

    if family == "nemotron_h":
        from miles.utils.tiny_nemotron import build_tiny_nemotron_model as build_model
    else:
        from miles.utils.tiny_model import build_tiny_moe_model as build_model
    model = build_model(tmp_path / family)
    out = tmp_path / "res.pt"
    from _torchrun import torchrun_self

    proc = torchrun_self(HERE, 2, free_port, str(model), str(out), family, timeout=600)
    text = proc.stdout
    assert proc.returncode == 0, text[-5000:]
    res = torch.load(out, weights_only=False)
    assert res["ep_init"] == res["ep_trained"] == 2, res
    assert res["meg_buffers_init"] == res["meg_buffers_trained"] == res["buffers"], res   # only those differ
    assert res["init_is_checkpoint"] and res["init_equal"] and res["init_bf16_equal"], res
    assert res["buffers_are_checkpoint"], res
    assert res["trained_moved"] and res["trained_equal"] and res["saved_names"] and res["saved_shapes"], res


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
