"""GRPO on a vision-language model (Miles's geo3k launcher, tests/fixtures/miles_scripts/grpo_geo3k_vlm.flags) in
both trainers, on 2 gloo ranks, fp32 on CPU, the tiny Qwen3-VL of ``miles.utils.tiny_vlm``: FSDP2 over the 2 ranks
(``miles/trainer/vlm.py``) and the Megatron backend with TP 2 + ``--sequence-parallel`` (``miles/trainer/megatron/
vlm.py``).

Samples as the rollout makes them: an image per prompt (different sizes: different grids, M-RoPE positions and
deepstack positions), its tokens expanded in the prompt ids, the image as a reference in
``metadata["multimodal_inputs"]``, a response, a reward and the engine's log-probs. ``train`` runs the fixture's
GRPO loss (``--eps-clip 0.2 --eps-clip-high 0.28``, ``--kl-loss-type low_var_kl``; here with a KL coefficient and 2
steps a rollout, so the old and the reference log-probs are separate forward passes). Checked against
transformers' ``Qwen3VLForConditionalGeneration`` forward of each sample alone (its pixels from the same image
processor, logits / --rollout-temperature):

- the trainer's old and reference per-token log-probs of every response token equal HF's to 1e-6;
- ``train_rollout_logprob_abs_diff`` (old vs. the rollout's log-probs, here HF's) is ~0; the KL to the reference
  grows from 0 once the first step has moved the policy;
- the step trains the vision tower (its exported weights change) and every rank ends with the same weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
TEMPERATURE = 0.8
SIZES = [(32, 48), (64, 64), (48, 32), (64, 48)]
GRPO = ["--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl",
        "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]
MEGATRON = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def _samples(model_dir: str) -> list:
    """Two groups of two samples, each prompt with one image (as the rollout builds them: image tokens expanded)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    from miles.rollout.multimodal import MEDIA_KEY, image_inputs
    from miles.types import Sample

    tok = AutoTokenizer.from_pretrained(model_dir)
    images = image_inputs(model_dir)
    out = []
    for i, (h, w) in enumerate(SIZES):
        path = Path(model_dir).parent / f"img{i}.png"
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")   # every rank writes it: atomically, never half-read
        Image.fromarray((np.random.default_rng(i).random((h, w, 3)) * 255).astype("uint8")).save(tmp, format="PNG")
        os.replace(tmp, path)
        text = tok.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": f"Find x. ({i // 2})" * (1 + i)}]}],
            tokenize=False, add_generation_prompt=True)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        counts = images.tokens_per_image(images.pixels([str(path)])["image_grid_thw"])
        ids, _ = images.expand(ids, [0] * len(ids), counts, f"sample {i}")
        resp = list(tok(f"x = {i % 3} so \\boxed{{{i % 2}}}" + "." * i, add_special_tokens=False)["input_ids"])
        out.append(Sample(group_index=i // 2, index=i, tokens=ids + resp, response_length=len(resp),
                          loss_mask=[1] * len(resp), reward=float(i % 2), label=str(i // 2),
                          metadata={MEDIA_KEY: {"images": [str(path)]}}))
    return out


def _hf_logprobs(model_dir: str, samples: list) -> list:
    """transformers' per-token log-probs of each sample's response tokens (one sample per forward, no padding)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from miles.rollout.multimodal import MEDIA_KEY, image_inputs

    hf = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    images = image_inputs(model_dir)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            px = images.pixels(s.metadata[MEDIA_KEY]["images"])
            logits = hf(input_ids=ids, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                        mm_token_type_ids=(ids == hf.config.image_token_id).to(torch.int32)).logits[0, :-1].float()
            lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(lp[-s.response_length:])
    return out


def _visual(tr) -> dict:
    """The vision tower's weights under their HF names (every rank iterates the buckets)."""
    out = {}
    for bucket in tr.iter_weight_buckets(1 << 20):
        out.update((n, t.detach().float().cpu().clone()) for n, t in bucket if n.startswith("model.visual."))
    return out


def _worker(model_dir: str, out: str, backend: str) -> None:
    import torch
    import torch.distributed as dist
    from trainer_harness import build

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    samples = _samples(model_dir)
    ref = _hf_logprobs(model_dir, samples)
    for s, lp in zip(samples, ref):
        s.rollout_log_probs = lp.tolist()               # the engine's log-probs: here HF's
    backend_flags = MEGATRON if backend == "megatron" else ["--train-backend", "fsdp"]
    tr = build(model_dir, ["--num-rollout", "2", "--num-steps-per-rollout", "2", "--rollout-temperature",
                           str(TEMPERATURE), *GRPO, *backend_flags], group=group)
    seen: dict = {}
    prepare = tr._prepare

    def spy(batch, data, policy):                       # the trainer's own passes, as train() runs them
        per, n = prepare(batch, data, policy)
        seen.update(indices=[s.index for s in batch], old=per["old"], ref=per["ref"])
        return per, n

    tr._prepare = spy
    before = _visual(tr)
    metrics = tr.train(samples[2 * rank:2 * rank + 2], 0)    # each rank's share (Megatron: gathered over TP)
    after = _visual(tr)
    res: dict = {"backend": backend, "indices": seen["indices"], "metrics": metrics}
    for name in ("old", "ref"):
        res[f"{name}_err"] = max(float((seen[name][j] - ref[i]).abs().max()) for j, i in enumerate(seen["indices"]))
        res[f"{name}_lens"] = [int(seen[name][j].numel()) for j in range(len(seen["indices"]))]
    res["ref_scale"] = max(float(r.abs().max()) for r in ref)
    res["visual_params"] = len(before)
    res["visual_changed"] = sum(int(not torch.equal(before[k], after[k])) for k in before)
    flat = torch.cat([after[k].reshape(-1) for k in sorted(after)])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    res["same_on_ranks"] = all(torch.equal(every[0], e) for e in every)
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_vlm_grpo_logprobs_match_hf(tmp_path: Path, backend: str):
    from _torchrun import torchrun_self

    from miles.utils.net import find_free_port
    from miles.utils.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "vlm", tie_word_embeddings=backend == "fsdp")
    proc = torchrun_self(HERE, 2, find_free_port(), str(model_dir), str(tmp_path), backend, timeout=500)
    assert proc.returncode == 0, proc.stdout[-6000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        print(backend, {k: v for k, v in r.items() if k != "metrics"})
        # FSDP: each rank its own 2 samples; Megatron TP 2: one replica, the ranks' shares gathered (all 4)
        assert sorted(r["indices"]) == ([0, 1, 2, 3] if backend == "megatron" else sorted(r["indices"]))
        # about twice what was measured: 4.8e-7 on both backends and ranks (2026-12-06, the 2-core CPU box,
        # ``pytest -s tests/multiprocess/test_vlm_grpo.py`` prints them)
        assert r["old_err"] < 1e-6 and r["ref_err"] < 1e-6, r
        assert all(n > 0 for n in r["old_lens"]), r
        m = r["metrics"]
        # the trainer's log-probs against the engine's (mean |diff|): measured 1.4e-7 / 1.3e-7 (FSDP / Megatron,
        # 2026-12-07, the same box and command)
        assert m["train_rollout_logprob_abs_diff"] < 3e-7, m
        assert 0 < m["kl_loss"] < 1 and m["grad_norm"] > 0, m      # step 2's policy has moved from the reference
        assert r["visual_params"] > 0 and r["visual_changed"] == r["visual_params"], r   # the ViT is trained
        assert r["same_on_ranks"], r
    keys = [k for k in r0["metrics"] if k in ("loss", "pg_loss", "kl_loss", "grad_norm", "pg_clipfrac", "entropy",
                                              "train_rollout_logprob_abs_diff", "num_samples", "num_tokens")]
    assert [r0["metrics"][k] for k in keys] == [r1["metrics"][k] for k in keys]
    if backend == "fsdp":
        assert sorted(r0["indices"] + r1["indices"]) == [0, 1, 2, 3]


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
