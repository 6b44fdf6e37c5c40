"""--multimodal-keys (images: SFT, and RL through the built-in rollout): the data path, Miles's placeholder split, the SFT rollout's tokens and the
refusals, on a tiny Qwen3-VL built locally (miles.utils.tiny_vlm)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.config import ConfigError, parse_args
from miles.rollout.data import DataError

SFT = ["--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
       "--input-key", "messages", "--apply-chat-template", "--debug-train-only", "--rollout-batch-size", "2",
       "--global-batch-size", "2", "--disable-compute-advantages-and-returns", "--num-epoch", "1",
       "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"]
KEYS = ["--multimodal-keys", '{"image": "images"}']
REPO = Path(__file__).resolve().parents[3]


def _png(path: Path, h: int, w: int, seed: int) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(path)
    return path


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(4):
        _png(tmp_path / "img" / f"{i}.png", 32 + 16 * (i % 2), 48, i)
        rows.append({"messages": [{"role": "user", "content": f"<image>What is {i}?"},
                                  {"role": "assistant", "content": f"It is {i}."}], "images": [f"img/{i}.png"]})
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(vlm_dir: Path, data: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(vlm_dir), "--prompt-data", str(data), "--train-backend", "fsdp",
                       *SFT, *KEYS, *extra, "--dry-run"], is_async=True)


def test_row_media_references(tmp_path: Path):
    from miles.rollout.multimodal import MediaError, load_image, row_media

    img = _png(tmp_path / "a.png", 20, 30, 0)
    uri = "data:image/png;base64," + base64.b64encode(img.read_bytes()).decode()
    row = {"images": ["a.png", str(img), f"file://{img}", uri, {"bytes": img.read_bytes(), "path": None}]}
    refs = row_media(row, {"image": "images"}, "f:1", tmp_path)["images"]
    assert refs[:3] == [str(img.resolve())] * 3 and refs[3] == uri and refs[4].startswith("data:image/png;base64,")
    assert all(load_image(r).size == (30, 20) for r in refs)
    (tmp_path / "not.png").write_text("text")
    for bad, why in [("missing.png", "image file .* does not exist"), ("not.png", ".*not.png. is not a readable image"),
                     ("https://x/y.png", "remote images are not fetched"), (3, "expected a path"),
                     ("data:image/png;base64,@@", "bad base64")]:
        with pytest.raises(MediaError, match=f"^f:1: --multimodal-keys image column 'images' item 0: {why}"):
            row_media({"images": [bad]}, {"image": "images"}, "f:1", tmp_path)
    with pytest.raises(MediaError, match="missing column 'pics'"):
        row_media(row, {"image": "pics"}, "f:1", tmp_path)


def test_placeholders_become_image_items():
    from miles.rollout.multimodal import MediaError, content_messages

    msgs = [{"role": "user", "content": "<image>left <image> right"}, {"role": "assistant", "content": "ok"}]
    out = content_messages(msgs, {"images": ["a", "b"]}, "f:1")
    assert out[0]["content"] == [{"type": "image"}, {"type": "text", "text": "left "}, {"type": "image"},
                                 {"type": "text", "text": " right"}]
    assert out[1] == msgs[1] and msgs[0]["content"].startswith("<image>")  # the input is not changed
    with pytest.raises(MediaError, match="2 image placeholder.* but the row has 1 image"):
        content_messages(msgs, {"images": ["a"]}, "f:1")


def test_refusals_are_one_line_naming_the_flag(vlm_dir: Path, data: Path):
    base = ["--hf-checkpoint", str(vlm_dir), "--prompt-data", str(data), *SFT]
    cases = [
        (["--train-backend", "fsdp", "--multimodal-keys", '{"video": "v"}'], "video inputs are not supported"),
        (["--train-backend", "fsdp", "--multimodal-keys", '{"imgs": "v"}'], "unknown media type 'imgs'"),
        (["--train-backend", "fsdp", "--multimodal-keys", '{"image": 3}'], "must be a non-empty string"),
    ]
    for extra, text in cases:
        with pytest.raises(ConfigError) as ei:
            parse_args(base + extra, is_async=True)
        msg = str(ei.value)
        assert msg.startswith("--multimodal-keys ") and text in msg and "\n" not in msg, msg
    rl = ["--hf-checkpoint", str(vlm_dir), "--prompt-data", str(data), "--train-backend", "fsdp", *KEYS,
          "--input-key", "messages", "--apply-chat-template", "--rollout-batch-size", "2", "--num-rollout", "1"]
    parse_args(rl + ["--eval-prompt-data", "e", str(data)])         # RL and evaluation with images: accepted
    for extra, start in (
            (["--rollout-function-path", "my.rollout"], "--multimodal-keys {\"image\": \"images\"} with "
                                                        "--rollout-function-path my.rollout: images reach the built-in"),
            (["--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout"],
             "--multimodal-keys {\"image\": \"images\"} with --rollout-function-path "
             "miles.rollout.sft_rollout.generate_rollout needs --loss-type sft_loss (got policy_loss)"),
            (["--advantage-estimator", "ppo"], "--advantage-estimator ppo with --multimodal-keys"),
            (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t/generate"],
             "--use-opd --opd-type sglang with --multimodal-keys")):
        with pytest.raises(ConfigError) as ei:
            parse_args(rl + extra)
        assert str(ei.value).startswith(start) and "\n" not in str(ei.value), ei.value
    raw = [a for a in base if a != "--apply-chat-template"] + ["--train-backend", "fsdp", *KEYS]
    with pytest.raises(ConfigError, match=r"^--multimodal-keys .* needs --apply-chat-template"):
        parse_args(raw, is_async=True)


def test_megatron_backend_takes_qwen3_vl_and_names_what_it_does_not_run(vlm_dir: Path, data: Path):
    """--train-backend megatron trains Qwen3-VL SFT (miles/trainer/megatron/vlm.py) with TP + sequence parallelism;
    pipeline or context parallelism, MTP and LoRA are refused in one line naming the flag."""
    from miles.run.entry import dry_run

    two = ["--train-backend", "megatron", "--actor-num-gpus-per-node", "2"]
    assert "role plan" in dry_run(_cfg(vlm_dir, data, *two, "--tensor-model-parallel-size", "2",
                                       "--sequence-parallel"))
    for extra, start in ((["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2 with a "
                                                                    "vision-language --hf-checkpoint (Qwen3-VL)"),
                         (["--context-parallel-size", "2"], "--context-parallel-size 2 with a vision-language"),
                         (["--mtp-num-layers", "1"], "--mtp-num-layers 1 with a vision-language"),
                         (["--lora-rank", "4", "--target-modules", "all-linear"], "--lora-rank with a vision-language")):
        with pytest.raises(ConfigError) as ei:
            dry_run(_cfg(vlm_dir, data, *two, *extra))
        msg = str(ei.value)
        assert start in msg and "\n" not in msg, msg


def test_dry_run_passes_and_names_a_bad_image(vlm_dir: Path, data: Path, tiny_model_dir: Path):
    from miles.run.entry import dry_run

    assert "role plan" in dry_run(_cfg(vlm_dir, data))
    rows = data.read_text().splitlines()
    bad = json.loads(rows[2])
    bad["images"] = ["img/nope.png"]
    data.write_text("\n".join(rows[:2] + [json.dumps(bad)] + rows[3:]) + "\n")
    with pytest.raises(DataError) as ei:
        dry_run(_cfg(vlm_dir, data))
    assert str(ei.value).startswith(f"{data}:3: --multimodal-keys image column 'images' item 0: image file "
                                    f"'img/nope.png' does not exist (looked in the data file's folder '{data.parent}'")
    argv = ["--hf-checkpoint", str(vlm_dir), "--prompt-data", str(data), "--train-backend", "fsdp", *SFT, *KEYS]
    r = subprocess.run([sys.executable, "train_async.py", *argv, "--dry-run"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if "--multimodal-keys" in ln]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    with pytest.raises(ConfigError, match="needs a vision-language --hf-checkpoint"):  # a text model
        dry_run(_cfg(tiny_model_dir, data))


def test_sft_rollout_expands_image_tokens(vlm_dir: Path, data: Path):
    from miles.rollout.data import DataSource, PromptDataset
    from miles.rollout.multimodal import MEDIA_KEY, image_inputs
    from miles.rollout.rollout_fn import MilesDataBuffer
    from miles.rollout.sft_rollout import generate_rollout
    from miles.utils.model_dir import load_tokenizer

    cfg = _cfg(vlm_dir, data)
    tok = load_tokenizer(str(vlm_dir), "--hf-checkpoint")
    buffer = MilesDataBuffer(DataSource(PromptDataset(data, tok, cfg.data)), 1)
    groups = generate_rollout(SimpleNamespace(rollout_batch_size=2, tokenizer=tok, hf_checkpoint=str(vlm_dir)), 0,
                              buffer)
    images = image_inputs(str(vlm_dir))
    pad = images.image_token_id
    for (s,), h in zip(groups, (32, 48)):
        grid = images.pixels(s.metadata[MEDIA_KEY]["images"])["image_grid_thw"]
        n = int(grid.prod()) // 4     # merged 2x2 patches: 32x48 is resized to 32x64 (2 tokens), 48x48 to 64x64
        assert n == {32: 2, 48: 4}[h], grid
        assert s.tokens.count(pad) == n and s.tokens.count(pad - 2) == 1    # <|vision_start|> once
        start = s.tokens.index(pad)
        assert s.tokens[start:start + n] == [pad] * n
        assert pad not in s.tokens[-s.response_length:]                   # images are in the prompt, not trained
        assert tok.decode(s.tokens[-s.response_length:]) == f"It is {s.group_index}.<|im_end|>\n"
        assert s.loss_mask == [1] * s.response_length


def test_parquet_image_structs(vlm_dir: Path, tmp_path: Path):
    """geo3k's shape (Miles's README): a Parquet file whose ``images`` column holds image structs (bytes, path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from miles.rollout.data import PromptDataset
    from miles.rollout.multimodal import MEDIA_KEY, load_image
    from miles.utils.model_dir import load_tokenizer

    png = _png(tmp_path / "a.png", 40, 40, 3).read_bytes()
    rows = [{"messages": [{"role": "user", "content": "<image>Find x."}, {"role": "assistant", "content": "x = 2"}],
             "images": [{"bytes": png, "path": "a.png"}]}] * 2
    path = tmp_path / "train_formatted.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = _cfg(vlm_dir, path)
    ds = PromptDataset(path, load_tokenizer(str(vlm_dir), "--hf-checkpoint"), cfg.data)
    (ref,) = ds[1].metadata[MEDIA_KEY]["images"]
    assert ref.startswith("data:image/png;base64,") and load_image(ref).size == (40, 40)
