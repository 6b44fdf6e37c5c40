"""Gemma 4 (tiny, ``miles.utils.tiny_gemma4``, multimodal layout) on megatron-core, on real gloo ranks (torchrun, CPU).

``test_gemma4_gpt_matches_hf``: megatron-core's GPTModel with Gemma 4's blocks (``families/gemma4.py``: sandwich
norms on post-normed RowParallelLinears, the full layers' own head size / KV heads / K=V / proportional RoPE, the
weightless value norm, attention scale 1, sliding windows, layer scalars, the scaled embedding) loaded by the
family's names gives transformers' own ``Gemma4ForConditionalGeneration`` log-probs in fp32, at TP 1 and TP 2
(sequence parallel), on the windowed SDPA core attention and on megatron-core's unfused ``DotProductAttention``
(``--attention-backend unfused``, Miles's recorded value); rows of 20 tokens are longer than the window (4); every
parameter gets a finite gradient; the Megatron tensors converted back to HF names equal the checkpoint's bit for bit.

The model is built here from the family module's pieces (``layer_spec``, ``config_kwargs``, ``after_build``) until
the family registry plugs Gemma 4 into ``model.build_gpt_model``; then this worker becomes the shared one of
``test_megatron_gpt_oss.py`` (the trainer, export, torch_dist and FSDP checks included).

``test_gemma4_gpt_matches_hf_on_gpu`` (``gpu``): the same at TP 1 in bf16 on one GPU under real torchrun.
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
SEQ = 20
# fp32 CPU, measured 1.4e-6 (SDPA, TP 1 and TP 2) and 0.0 (unfused, TP 1) in log-prob:
# pytest tests/multiprocess/test_megatron_gemma4.py -k "not gpu"
BOUND = 3e-6


def _build(model_dir: str, tp: int, core: str, device, dtype):
    """megatron-core's GPTModel of the Gemma 4 checkpoint, loaded; (model, shape, groups, hf text state)."""
    import types

    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from transformers import AutoConfig

    from miles.trainer.megatron import convert, parallel
    from miles.trainer.megatron import model as mmodel
    from miles.trainer.megatron.families import gemma4

    groups = parallel.init_parallel(tp_size=tp, num_trainer_ranks=tp, seed=1, device=device)
    shape = types.SimpleNamespace(**gemma4.shape_fields(AutoConfig.from_pretrained(model_dir)))
    gemma4.prepare(device)
    on_gpu = device.type == "cuda"
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon,
        qk_layernorm=True, gated_linear_unit=True, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True, perform_initialization=False,
        attention_softmax_in_fp32=True, bias_dropout_fusion=on_gpu, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
        **gemma4.config_kwargs(shape))
    spec = gemma4.layer_spec(shape, gemma4.core_attention(shape) if core == "sdpa" else None)
    padded = mmodel.padded_vocab_size(shape.vocab_size, 128, tp)
    with mmodel._sequence_parallel_norms(config, spec) as spec:
        gpt = GPTModel(config, spec, vocab_size=padded, max_sequence_length=shape.max_position_embeddings,
                       position_embedding_type="rope", rotary_base=int(shape.rotary_base),
                       share_embeddings_and_output_weights=shape.tie_embeddings, parallel_output=True)
    gemma4.after_build(gpt, shape)
    hf = gemma4.text_state(convert.read_hf_state_dict(model_dir))
    with torch.no_grad():
        for name, p in list(gpt.named_parameters()) + gemma4.exported_buffers(gpt):
            if name == "embedding.word_embeddings.weight":
                full = convert._pad_rows(hf["model.embed_tokens.weight"], padded)
            elif name == "decoder.final_layernorm.weight":
                full = hf["model.norm.weight"]
            else:
                m = convert._LAYER.match(name)
                full = gemma4.hf_to_megatron(m.group(2), f"model.layers.{m.group(1)}.", hf, shape)
            piece = convert.shard(name, full, convert.partition_dim(name), groups.tp_rank, tp)
            assert tuple(piece.shape) == tuple(p.shape), (name, tuple(piece.shape), tuple(p.shape))
            p.copy_(piece.to(p.dtype))
    return gpt.to(device), shape, groups, hf


def _gpt_worker(model_dir: str, out: str, core: str, device_name: str = "cpu") -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText

    from miles.trainer.megatron import convert
    from miles.trainer.megatron.compat import apply_cpu_compat
    from miles.trainer.megatron.families import gemma4

    on_gpu = device_name == "cuda"
    dist.init_process_group("nccl" if on_gpu else "gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    else:
        apply_cpu_compat()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gpt, shape, groups, hf = _build(model_dir, tp, core, device, dtype)

    torch.manual_seed(0)
    ids = torch.randint(4, shape.vocab_size - 4, (2, SEQ))          # no image / video token ids
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    logits = gpt(ids.to(device), pos.to(device), attention_mask=None)   # [b, s, V / tp]
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
    logits = logits[..., :shape.vocab_size].float()
    cap = shape.variant.final_logit_softcapping
    logits = cap * torch.tanh(logits / cap)
    logits.square().mean().backward()
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gpt.parameters())
    lp = torch.log_softmax(logits.detach().cpu(), -1)

    same, exported = [], []                                       # megatron -> HF names, bitwise
    for name, p in list(gpt.named_parameters()) + gemma4.exported_buffers(gpt):
        m = convert._LAYER.match(name)
        if m is None:
            continue
        dim = convert.partition_dim(name)
        t = p.detach().float().cpu().contiguous()
        if tp > 1 and dim is not None:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather_object(shards, t)
            t = convert.unshard(name, shards, dim)
        for hn, full in gemma4.megatron_to_hf(m.group(2), f"model.layers.{m.group(1)}.", t, shape):
            exported.append(hn)
            if torch.equal(full, hf[hn].to(dtype).float()):
                same.append(hn)

    ref_model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        ref = torch.log_softmax(ref_model.to(device)(input_ids=ids.to(device)).logits.float().cpu(), -1)
    if rank == 0:
        layers = sorted(k for k in hf if k.startswith("model.layers."))
        Path(out).write_text(json.dumps({
            "lp_max_abs_err": float((lp - ref).abs().max()), "grads_ok": grads_ok, "exported": sorted(exported),
            "same": sorted(same), "layers": layers}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_gemma4_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_gemma4 import build_tiny_gemma4

    return build_tiny_gemma4(tmp_path_factory.mktemp("tiny_gemma4"))


@pytest.mark.parametrize("tp,core", [(1, "sdpa"), (2, "sdpa"), (1, "unfused"), (2, "unfused")])
def test_gemma4_gpt_matches_hf(tiny_gemma4_dir: Path, tmp_path: Path, free_port: int, tp: int, core: str) -> None:
    out = tmp_path / f"gpt_tp{tp}_{core}.json"
    proc = torchrun_self(HERE, tp, free_port, "gpt", str(tiny_gemma4_dir), str(out), core, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    assert res["grads_ok"], res
    assert res["lp_max_abs_err"] < BOUND, (tp, core, res["lp_max_abs_err"])
    assert res["exported"] == res["layers"] and res["same"] == res["layers"]     # every layer tensor, bit for bit


@pytest.mark.gpu
def test_gemma4_gpt_matches_hf_on_gpu(tiny_gemma4_dir: Path, tmp_path: Path, free_port: int) -> None:
    """One GPU, bf16, TP 1 (real torchrun): megatron-core's Gemma 4 within bf16 rounding of transformers'."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "gpt_gpu.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port), str(HERE), "gpt", str(tiny_gemma4_dir), str(out), "sdpa", "cuda"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    print(res["lp_max_abs_err"])
    assert res["grads_ok"] and res["same"] == res["layers"], res
    # Not measured yet (no GPU here): bf16 through 5 layers of a 64-wide model, log-probs of a ~4.6 nats scale; the
    # bound is a bf16 budget (8 ulps of 4.6 = 0.125, halved) until the lead's run replaces it by twice the measured
    # value: pytest -s -m gpu tests/multiprocess/test_megatron_gemma4.py -k gpu
    assert res["lp_max_abs_err"] < 0.06, res


if __name__ == "__main__":
    if sys.argv[1] == "gpt":
        _gpt_worker(*sys.argv[2:6])
