"""Images in RL rollouts (Miles's geo3k GRPO launcher, tests/fixtures/miles_scripts/grpo_geo3k_vlm.flags): the
prompts' image tokens expanded at load, each /generate carrying SGLang's ``image_data`` (one
``data:image/png;base64,...`` per image, as Miles sends), for the default generate, Miles's
``miles.rollout.sglang_rollout.generate`` and the geo3k plugin (``Sample.multimodal_train_inputs``), in training
rollouts and evaluation; ``--rm-type math`` against ``--label-key answer``; the wire keeps the image references.
The engine is an in-process stand-in recording every request (tests/e2e/test_miles_vlm_grpo.py runs the real one)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from miles.config import parse_args
from miles.rollout.data import DataSource, PromptDataset
from miles.rollout.manager import RolloutManager
from miles.rollout.multimodal import MEDIA_KEY, image_inputs, load_image
from miles.utils.model_dir import load_tokenizer

PLUGINS = Path(__file__).resolve().parents[2] / "fixtures" / "miles_scripts" / "plugins"
SIZES = [(32, 48), (64, 64), (48, 40)]       # (h, w): different grids, so different token counts


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """geo3k_imgurl's columns: ``problem`` with an ``<image>`` placeholder, ``answer``, ``images``; one text row."""
    from PIL import Image

    root = tmp_path_factory.mktemp("geo")
    rows = []
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray((np.random.default_rng(i).random((h, w, 3)) * 255).astype("uint8")).save(root / f"{i}.png")
        rows.append({"problem": f"<image>Find x. ({i})", "answer": str(i), "images": [f"{i}.png"]})
    rows.append({"problem": "No figure. (7)", "answer": "7", "images": []})
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Engine:
    """/generate stand-in: answers ``\\boxed{N}`` (N read from the prompt) to every other request, else ``no``."""

    def __init__(self, tok) -> None:
        self.tok, self.requests = tok, []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, extra=None, **kw):
        self.requests.append({"input_ids": list(input_ids), **(extra or {})})
        n = re.findall(r"\((\d)\)", self.tok.decode(input_ids))[-1]
        text = f"\\boxed{{{n}}}" if len(self.requests) % 2 else "no"
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return {"text": text, "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": "1",
                                            "output_token_logprobs": [[-0.5, t, None] for t in ids]}}

    async def generate_group(self, input_ids, sampling_params, n, return_logprob=True, rid=None, extra=None, **kw):
        seed = sampling_params.get("sampling_seed", 0)
        return [await self.generate(input_ids, {**sampling_params, "sampling_seed": seed + j}, extra=extra)
                for j in range(n)]

    async def abort(self, rid):
        return None


def _cfg(vlm_dir: Path, data: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(vlm_dir), "--prompt-data", str(data), "--input-key", "problem",
                       "--label-key", "answer", "--apply-chat-template", "--multimodal-keys", '{"image": "images"}',
                       "--rm-type", "math", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                       "--num-rollout", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                       "--eval-prompt-data", "geo", str(data), *extra])


def _expected_tokens(vlm_dir: Path, ref: str) -> int:
    """The image's merged-patch count from the image processor directly (grid t*h*w / merge^2)."""
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(str(vlm_dir))
    t, h, w = proc(images=[load_image(ref)], return_tensors="pt")["image_grid_thw"][0].tolist()
    return t * h * w // proc.merge_size ** 2


def test_prompt_ids_hold_each_images_tokens(vlm_dir: Path, data: Path):
    cfg = _cfg(vlm_dir, data)
    tok = load_tokenizer(str(vlm_dir), "--hf-checkpoint")
    ds = PromptDataset(data, tok, cfg.data)
    pad = image_inputs(str(vlm_dir)).image_token_id
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    counts = []
    for item in ds.items[:3]:
        (ref,) = item.metadata[MEDIA_KEY]["images"]
        n = _expected_tokens(vlm_dir, ref)
        counts.append(n)
        at = item.prompt_ids.index(start)
        assert item.prompt_ids[at + 1:at + 2 + n] == [pad] * n + [end], item.prompt_ids
        rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text":
                                            f"Find x. ({item.index})"}]}], tokenize=False, add_generation_prompt=True)
        assert tok.decode(item.prompt_ids) == rendered.replace("<|image_pad|>", "<|image_pad|>" * n)
    assert len(set(counts)) > 1, counts                                       # the grids differ
    assert pad not in ds.items[3].prompt_ids and ds.items[3].metadata[MEDIA_KEY] == {"images": []}
    longest = max(ds.items[:3], key=lambda it: len(it.prompt_ids))
    limit = len(longest.prompt_ids) - 1                  # above its length before the expansion: the limit counts them
    assert len(longest.prompt_ids) - max(counts) + 1 <= limit
    short = PromptDataset(data, tok, _cfg(vlm_dir, data, "--rollout-max-prompt-len", str(limit)).data)
    assert short.num_dropped_too_long == 1 and longest.prompt_ids not in [i.prompt_ids for i in short.items]


def _decoded(uri: str) -> np.ndarray:
    from PIL import Image

    head, _, payload = uri.partition(",")
    assert head == "data:image/png;base64"
    img = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert img.format == "PNG" and img.mode == "RGB"
    return np.asarray(img)


@pytest.mark.parametrize("generate", [None, "miles.rollout.sglang_rollout.generate", "examples.geo3k_vlm.rollout.generate"])
def test_requests_carry_the_images_and_rewards_work(vlm_dir: Path, data: Path, generate: str | None, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    extra = ["--custom-generate-function-path", generate] if generate else []
    cfg = _cfg(vlm_dir, data, *extra)
    tok = load_tokenizer(str(vlm_dir), "--hf-checkpoint")
    ds = PromptDataset(data, tok, cfg.data)
    engine = Engine(tok)
    manager = RolloutManager(cfg.rollout, cfg.data, cfg.reward, engine, tok, DataSource(ds), eval_cfg=cfg.eval,
                             sections=(cfg.algo, cfg.train))
    try:
        result = asyncio.run(manager.generate_rollout(0))
        metrics = asyncio.run(manager.evaluate({"geo": ds}))
    finally:
        asyncio.run(manager.aclose())
        sys.modules.pop("examples.geo3k_vlm.rollout", None)
    by_prompt = {tuple(item.prompt_ids): item for item in ds.items}
    assert len(engine.requests) == 4 * 2 + 4                                  # the rollout's 8 samples, then eval
    for req in engine.requests:
        item = by_prompt[tuple(req["input_ids"])]                             # the expanded prompt ids, unchanged
        refs = item.metadata[MEDIA_KEY]["images"]
        if not refs:
            assert "image_data" not in req
            continue
        assert len(req["image_data"]) == len(refs) == 1
        assert np.array_equal(_decoded(req["image_data"][0]), np.asarray(load_image(refs[0])))
    samples = [s for g in result.samples for s in g]
    assert len(samples) == 8 and all(s.status.value == "completed" for s in samples)
    for s in samples:
        assert s.tokens[:s.prompt_length] in [i.prompt_ids for i in ds.items]
        assert s.reward == (1.0 if s.response.startswith("\\boxed") else 0.0), (s.response, s.label, s.reward)
        refs = s.metadata[MEDIA_KEY]["images"]
        mm = s.multimodal_train_inputs
        if not refs:
            assert mm is None
            continue
        assert set(mm) == {"pixel_values", "image_grid_thw"}, mm.keys()
        n = int(mm["image_grid_thw"].prod()) // 4
        assert s.tokens.count(image_inputs(str(vlm_dir)).image_token_id) == n
        assert mm["pixel_values"].shape[0] == int(mm["image_grid_thw"].prod())
    assert 0.0 < metrics["eval/geo"] < 1.0 and "eval/geo/response_len" in metrics, metrics
    from miles.run.wire import decode_samples, encode_samples

    back = decode_samples(encode_samples(samples))
    assert [b.metadata[MEDIA_KEY] for b in back] == [s.metadata[MEDIA_KEY] for s in samples]


def test_group_requests_and_multi_turn_send_the_images(vlm_dir: Path, data: Path):
    """One n-sample request per group (the embedded engine) and every turn of a multi-turn sample send them too."""
    from miles.rollout import generate as gen
    from miles.types import Sample

    tok = load_tokenizer(str(vlm_dir), "--hf-checkpoint")
    ds = PromptDataset(data, tok, _cfg(vlm_dir, data).data)
    item = ds.items[0]
    sample = Sample(tokens=list(item.prompt_ids), metadata=dict(item.metadata))
    engine = Engine(tok)
    turn = gen.MultiTurn(sample, tok, {"max_new_tokens": 16})
    asyncio.run(turn.generate_turn(engine))
    turn.add_observation(text="(0)")
    asyncio.run(turn.generate_turn(engine))
    assert [len(r["image_data"]) for r in engine.requests] == [1, 1]
    assert engine.requests[1]["input_ids"][:len(item.prompt_ids)] == item.prompt_ids
    assert gen.request_extra(0, False, gen.sample_image_data(sample)) == {"image_data": engine.requests[0]["image_data"]}
    assert gen.sample_image_data(Sample(tokens=[1])) is None
    cfg = _cfg(vlm_dir, data)
    engine = Engine(tok)
    manager = RolloutManager(cfg.rollout, cfg.data, cfg.reward, engine, tok, DataSource(ds), group_requests=True)
    try:
        result = asyncio.run(manager.generate_rollout(0))
    finally:
        asyncio.run(manager.aclose())
    assert len(engine.requests) == 8 and all(s.reward is not None for g in result.samples for s in g)
    for req in engine.requests:
        images = next(i for i in ds.items if i.prompt_ids == req["input_ids"]).metadata[MEDIA_KEY]["images"]
        assert len(req.get("image_data") or []) == len(images)
