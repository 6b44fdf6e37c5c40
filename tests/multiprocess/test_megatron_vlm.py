"""Qwen3-VL on the Megatron backend (miles/trainer/megatron/vlm.py) on real gloo ranks: 2 ranks, TP 2 with
``--sequence-parallel``, the tiny Qwen3-VL of ``miles.utils.tiny_vlm``, fp32 on CPU, one torchrun launch.

Checked against transformers' ``Qwen3VLForConditionalGeneration`` of the same checkpoint, on a batch of two
right-padded rows with images of different sizes (and so different M-RoPE grids and deepstack positions):

- the per-token log-probs (vision tower, image features placed in each rank's sequence slice, interleaved
  M-RoPE, deepstack, megatron-core's TP decoder) equal HF's to 1e-4;
- the vision tower's gradients of a token loss, after ``parallel.finish_grads`` (the sequence-parallel partial
  gradients summed over TP), equal HF's, on both ranks; also under full recompute (megatron's reentrant
  checkpoint of each layer, the deepstack hooks replayed in the backward);
- one SGD step changes the vision weights identically on both ranks;
- the weight export (``export.iter_hf_buckets``, what ``--save-hf`` writes) of the untrained model is the HF
  checkpoint bit for bit, names included (``model.visual.*``, ``model.language_model.*``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def _batch(model_dir: str):
    """Two right-padded rows: text, an image (2x2 or 1x2 merged tokens), text; and their image inputs."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from miles.trainer.vlm import ImageProcessor

    cfg = AutoConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = ImageProcessor(model_dir, cfg.image_token_id)
    rows, pixels, grids = [], [], []
    for i, (h, w) in enumerate([(64, 64), (32, 64)]):
        img = Image.fromarray((np.random.default_rng(i).random((h, w, 3)) * 255).astype("uint8"))
        out = proc.processor(images=[img], return_tensors="pt")
        n = int(out["image_grid_thw"].prod()) // 4
        text = tok.encode(f"q{i}: find x" * (1 + 4 * i))     # row 1's image in the second half (TP rank 1)
        rows.append(text + [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
                    + tok.encode(f"x = {i + 3} since" * (3 - 2 * i)))
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
    s = -(-max(map(len, rows)) // 2) * 2                       # a multiple of TP (the sequence-parallel split)
    ids = torch.full((2, s), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(2, s, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    at = (ids == cfg.image_token_id).nonzero()[:, 1]
    assert bool((at < s // 2).any()) and bool((at >= s // 2).any()), at    # image tokens in both TP ranks' slices
    mm = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids),
          "mm_token_type_ids": (ids == cfg.image_token_id).to(torch.int32)}
    return ids, mask, mm


def _worker(model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    dist.init_process_group("gloo")
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    from miles.trainer.megatron import convert, export, model, parallel, vlm

    tp, rank = dist.get_world_size(), dist.get_rank()
    cpu = torch.device("cpu")
    groups = parallel.init_parallel(tp_size=tp, num_trainer_ranks=tp, seed=1, device=cpu)
    hf_config = AutoConfig.from_pretrained(model_dir)
    shape = model.ModelShape.from_hf_config(hf_config)
    padded = model.padded_vocab_size(shape.vocab_size, 128, tp)
    hf_state = convert.read_hf_state_dict(model_dir)
    ids, mask, mm = _batch(model_dir)
    real = mask.bool()[:, 1:]
    targets = ids[:, 1:]

    def build(recompute: str | None):
        config = model.transformer_config(shape, tp_size=tp, device=cpu, sequence_parallel=tp > 1, recompute=recompute,
                                          recompute_method="uniform" if recompute else None,
                                          recompute_num_layers=1 if recompute else None)
        gpt = model.build_gpt_model(shape, config, padded_vocab=padded, device=cpu, hf_config=hf_config)
        convert.load_hf_into(gpt, hf_state, shape, padded, rank, tp)
        return gpt

    def logprobs(gpt) -> torch.Tensor:
        hidden = vlm.forward(gpt, ids, mm, sequence_parallel=tp > 1, tp_rank=rank, tp_size=tp)      # [s/tp, b, h]
        if tp > 1:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=groups.tp)
        # [b, s, h], contiguous: the backward's all-reduce over TP (summing the vocabulary shards' gradients)
        hidden = copy_to_tensor_model_parallel_region(hidden.transpose(0, 1).contiguous(), group=groups.tp)
        local = hidden @ model.output_weight(gpt).t()                                         # [b, s, V/tp]
        logits = gather_from_tensor_model_parallel_region(local)[..., :shape.vocab_size]
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    hf = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    ref_logits = hf(input_ids=ids, attention_mask=mask, **mm).logits
    ref = torch.log_softmax(ref_logits[:, :-1].float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (-(ref * real).sum()).backward()
    hf_grads = {vlm.VISION_PREFIX + k: p.grad for k, p in hf.model.visual.named_parameters()}

    result: dict = {}
    for tag, recompute in (("plain", None), ("recompute", "full")):
        gpt = build(recompute)
        gpt.train()
        lp = logprobs(gpt)
        result[f"{tag}_logprob_err"] = float((lp - ref.detach())[real].abs().max())
        (-(lp * real).sum()).backward()
        parallel.finish_grads(gpt, groups)
        vis = {n: p for n, p in gpt.named_parameters() if vlm.is_vision(n)}
        result[f"{tag}_vision_params"] = len(vis)
        result[f"{tag}_vision_grad_err"] = max(float((p.grad - hf_grads[n]).abs().max()) for n, p in vis.items())
        result[f"{tag}_vision_grad_scale"] = max(float(hf_grads[n].abs().max()) for n in vis)
        if tag == "plain":
            before = {n: p.detach().clone() for n, p in vis.items()}
            with torch.no_grad():
                for p in gpt.parameters():
                    p -= 1e-2 * p.grad
            flat = torch.cat([(p.detach() - before[n]).reshape(-1) for n, p in vis.items()])
            every = [torch.empty_like(flat) for _ in range(tp)]
            dist.all_gather(every, flat)
            result["vision_changed"] = bool(flat.abs().max() > 0)
            result["vision_update_same_on_ranks"] = all(torch.equal(every[0], e) for e in every)
            result["vision_update_norm"] = float(flat.norm())
            exported = {}
            gpt_fresh = build(None)
            for bucket in export.iter_hf_buckets(gpt_fresh, shape, groups, device=cpu, bucket_bytes=1 << 20):
                exported.update(bucket)
            ckpt = convert.read_hf_state_dict(model_dir)
            result["export_names_equal"] = sorted(exported) == sorted(ckpt)
            result["export_bit_equal"] = sorted(exported) == sorted(ckpt) and all(
                torch.equal(exported[k], ckpt[k]) for k in ckpt)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def test_megatron_vlm_matches_hf_tp2_sequence_parallel(tmp_path: Path):
    from _torchrun import torchrun_self

    from miles.utils.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "vlm")
    out = tmp_path / "result.json"
    proc = torchrun_self(HERE, 2, 29731, str(model_dir), str(out), timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    r = json.loads(out.read_text())
    for tag in ("plain", "recompute"):
        assert r[f"{tag}_vision_params"] > 0
        assert r[f"{tag}_logprob_err"] < 1e-4, r
        assert r[f"{tag}_vision_grad_err"] < 1e-4 * max(1.0, r[f"{tag}_vision_grad_scale"]), r
    assert r["vision_changed"] and r["vision_update_same_on_ranks"] and r["vision_update_norm"] > 0, r
    assert r["export_names_equal"] and r["export_bit_equal"], r


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
