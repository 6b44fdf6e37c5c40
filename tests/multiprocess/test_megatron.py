"""megatron-core GPTModel on real gloo ranks (torchrun, CPU): the CPU adaptation (``compat.py``), the
model built from the HF config and our HF -> megatron converter, checked against the HF model.

Each rank builds the tiny Qwen3 at TP = world size, loads the HF weights, runs a forward on two
rows, gathers its vocabulary shard of the logits and compares with transformers' logits; then a
backward must leave every parameter with a finite gradient (the CUDA RNG tracker, rotary and mask
spots of megatron-core run on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def _worker(model_dir: str, out: str) -> None:
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
                                padded_vocab=padded, device=cpu)
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


def _run(model_dir: Path, tmp_path: Path, nproc: int, port: int) -> dict:
    out = tmp_path / f"result_tp{nproc}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr",
           "127.0.0.1", "--master-port", str(port),
           str(HERE), str(model_dir), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc", [1, 2])
def test_gpt_model_matches_hf(tiny_model_dir: Path, tmp_path: Path, free_port: int, nproc: int) -> None:
    res = _run(tiny_model_dir, tmp_path, nproc, free_port)
    assert res["grads_ok"]
    # fp32 on CPU: same math in a different op order (fused qkv, split vocab), so float rounding only
    assert res["max_abs_err"] < 1e-4 * max(res["ref_scale"], 1.0), res


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
