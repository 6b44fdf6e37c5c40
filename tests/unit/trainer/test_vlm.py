"""The FSDP trainer's VLM forward (miles.trainer.vlm) on a tiny Qwen3-VL: the images reach the log-probs, the
vision tower gets gradients, a micro-batch without images still gives every vision parameter a (zero) gradient,
and a sample whose image tokens do not match its images is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.trainer import modeling, vlm
from miles.trainer.batching import SampleData, pack, padded_rows
from miles.types import Sample


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


def _png(path: Path, seed: int) -> str:
    import numpy as np
    from PIL import Image

    Image.fromarray((np.random.default_rng(seed).random((32, 48, 3)) * 255).astype("uint8")).save(path)
    return str(path)


def _sample(tok, image_token: int, n_image_tokens: int, refs: list[str]) -> Sample:
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    prompt = tok("look: ", add_special_tokens=False)["input_ids"] + [start] + [image_token] * n_image_tokens + [end]
    resp = tok("red.", add_special_tokens=False)["input_ids"]
    return Sample(tokens=prompt + resp, response_length=len(resp), loss_mask=[1] * len(resp),
                  metadata={vlm.MEDIA_KEY: {"images": refs}} if refs else {})


def test_images_reach_the_loss_and_the_vision_tower(vlm_dir: Path, tmp_path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vlm_dir))
    hf = modeling.load_hf_model(vlm_dir, torch.device("cpu"))
    assert vlm.is_vlm(hf.config) and hf.config._attn_implementation == "sdpa"
    blocks = modeling.decoder_blocks(hf)
    assert blocks and not any(vlm.is_vision_block(b) for b in blocks)   # the vision tower stays in the root unit
    model = modeling.PolicyModel(hf)
    images = vlm.ImageProcessor(str(vlm_dir), hf.config.image_token_id)
    pad = images.image_token_id
    samples = [_sample(tok, pad, 2, [_png(tmp_path / f"{i}.png", i)]) for i in range(2)]
    samples.append(_sample(tok, pad, 0, []))                           # a text-only sample in the same batch
    mm = [images.sample_inputs(s, f"sample {i}") for i, s in enumerate(samples)]
    assert mm[2] is None and mm[0]["image_grid_thw"].tolist() == [[1, 2, 4]]
    data = [SampleData(torch.tensor(s.tokens), s.response_length, torch.ones(s.response_length)) for s in samples]

    def logprobs(ids_, mm_list):
        mb = pack(data, ids_)
        rows, pos, index = padded_rows(mb, 0)
        kw = vlm.batch_inputs(mm_list, mb.sample_ids, rows, pad, torch.device("cpu"))
        return model(rows, pos, index, mb.targets, mb.cu_seqlens, mb.max_seqlen, mm=kw)[0], mb

    lp, mb = logprobs([0, 1, 2], mm)
    lp.sum().backward()
    visual = [p for n, p in model.named_parameters() if ".visual." in n]
    assert visual and all(p.grad is not None for p in visual)
    assert sum(float(p.grad.abs().sum()) for p in visual) > 0           # the images are trained through
    model.zero_grad()
    swapped = [mm[1], mm[0], None]                                      # each sample now sees the other's image
    lp2, _ = logprobs([0, 1, 2], swapped)
    n0, n1 = mb.lengths[0], mb.lengths[1]
    assert not torch.allclose(lp[:n0], lp2[:n0]) and not torch.allclose(lp[n0:n0 + n1], lp2[n0:n0 + n1])
    assert torch.equal(lp[n0 + n1:], lp2[n0 + n1:])       # the text-only sample is unaffected (measured: bit for bit)
    model.zero_grad(set_to_none=True)
    lp3, _ = logprobs([2], mm)                                          # no images: the vision anchor
    lp3.sum().backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0 for p in visual)
    with pytest.raises(ValueError, match=r"sample 0: 3 image token\(s\) but its 1 image\(s\) need 2"):
        images.sample_inputs(_sample(tok, pad, 3, [_png(tmp_path / "x.png", 9)]), "sample 0")
    with pytest.raises(ValueError, match=r"2 image token\(s\) but no images"):
        images.sample_inputs(_sample(tok, pad, 2, []), "sample 0")
