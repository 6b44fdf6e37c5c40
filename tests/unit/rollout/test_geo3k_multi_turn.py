"""The multi-turn geo3k VLM example as the custom generate function of a rollout here: ours, and Miles's own on demand.

tests/fixtures/miles_scripts/plugins/examples/geo3k_vlm/multi_turn/ is this project's small module of Miles's example
(radixark/miles@v0.1.0:examples/geo3k_vlm/multi_turn/: same module path, names, signatures, config keys and uses of
the plugin API, its own code). Each scenario also runs Miles's files themselves when ``MILES_REPO`` names a Miles
checkout or git directory (a bare mirror is fine; ``MILES_REV``, default v0.1.0): ``examples/__init__.py`` and
``examples/geo3k_vlm/multi_turn/`` are extracted into the test's tmp directory (nothing of Miles enters the
repository) and put on ``sys.path`` in place of the fixture; without ``MILES_REPO`` that variant is skipped.

The rollout runs with the flags of Miles's launcher (radixark/miles@v0.1.0:examples/geo3k_vlm/multi_turn/
run_geo3k_vlm_multi_turn.py: ``--input-key problem --label-key answer --multimodal-keys '{"image": "images"}'
--rm-type math --apply-chat-template --custom-generate-function-path examples.geo3k_vlm.multi_turn.rollout.generate
--custom-config-path .../geo3k_vlm_multi_turn_config.yaml``) on a tiny Qwen3-VL. What the example needs from the run,
as Miles gives it: ``GenerateState(args).processor`` (the checkpoint's processor) and ``.tokenizer``,
``sample.prompt`` as the chat-templated text, ``sample.multimodal_inputs``, ``args.partial_rollout``,
``args.apply_chat_template(_kwargs)``, the config's ``max_turns`` / ``rollout_interaction_env_path`` and the router
address.

The model answers every turn with one tool call, ``<tool_call>{"name": "calc_score", "arguments": {"answer": "3"}}
</tool_call>``, so that geo3k's environment scores it and the sample takes all of ``max_turns: 3``: three model turns,
two tool observations between them. The unit tests get it from a /generate stand-in; the multiprocess test from the
embedded engine on a tiny Qwen3-VL built to write it (greedy by construction, :func:`build_tool_calling_vlm`).

qwen_vl_utils: Miles installs it (its requirements.txt) and the example imports it to encode each observation; it
imports torchvision, which this project does not install. Without it the first observation fails the sample, the
error naming the module (checked). Where it is not importable, the other tests put in its place a stand-in of its
``process_vision_info`` for messages without images or videos (qwen-vl-utils 0.0.14 answers ``(None, None)`` for
them), the only messages geo3k's environment writes; a message with images is refused by the stand-in.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import types
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from miles.config import parse_args
from miles.rollout.data import DataSource, PromptDataset
from miles.rollout.manager import RolloutManager
from miles.rollout.multimodal import MEDIA_KEY, image_inputs, load_image
from miles.types import SampleStatus
from miles.utils.model_dir import load_tokenizer

PLUGINS = Path(__file__).resolve().parents[2] / "fixtures" / "miles_scripts" / "plugins"
EXAMPLE = Path("examples") / "geo3k_vlm" / "multi_turn"
CONFIG = EXAMPLE / "geo3k_vlm_multi_turn_config.yaml"
MILES_REPO, MILES_REV = os.environ.get("MILES_REPO"), os.environ.get("MILES_REV", "v0.1.0")
PAYLOAD = '{"name": "calc_score", "arguments": {"answer": "3"}}'
TOOL_CALL = f"<tool_call>{PAYLOAD}</tool_call>"
# the environment's answer to a right calc_score call, the fixture's and Miles's
OBSERVATIONS = {"ours": "calc_score says 1.0: the answer '3' is correct. Give the final answer as \\boxed{}.",
                "miles": "calc_score result: 1.0. Parsed answer '3' matches the reference. You can now stop reasoning "
                         "and provide the final solution in \\boxed{}."}
MAX_TURNS = 3


def test_generate_state_processor_as_miles(tiny_model_dir, vlm_dir):
    """GenerateState(args).processor: the checkpoint's processor (once per checkpoint), None for a text-only model
    or args without a checkpoint; a refused Miles flag a plugin reads has its value when not given."""
    from transformers import ProcessorMixin

    from miles.rollout.plugins import PluginArgs
    from miles.rollout.sglang_rollout import GenerateState

    vlm = GenerateState(types.SimpleNamespace(hf_checkpoint=str(vlm_dir))).processor
    assert isinstance(vlm, ProcessorMixin) and vlm is GenerateState(types.SimpleNamespace(
        tokenizer=load_tokenizer(str(vlm_dir), "--hf-checkpoint"))).processor   # else the tokenizer's directory
    assert GenerateState(types.SimpleNamespace(hf_checkpoint=str(tiny_model_dir))).processor is None
    assert GenerateState(types.SimpleNamespace()).processor is None
    c = parse_args(["--rollout-batch-size", "1", "--num-rollout", "1"], validate=False)
    assert PluginArgs(c.rollout, c.data).partial_rollout is False


# ----------------------------------------------------------------------------- the model, the data, the run
def build_tool_calling_vlm(out: Path) -> Path:
    """A tiny Qwen3-VL (miles.utils.tiny_vlm) that answers a generation prompt with ``TOOL_CALL`` and its EOS.

    ``<tool_call>``, ``</tool_call>`` (as Qwen's tokenizer has them) and the JSON payload are added to the tokenizer
    as plain tokens. The text layers' output projections (attention ``o_proj``, MLP ``down_proj``) are zeroed, so the
    last position's hidden state is its token's embedding; those embeddings and the untied LM head make each token
    of the chain ``"\\n" -> <tool_call> -> payload -> </tool_call> -> EOS`` predict the next with a logit margin of
    160 (greedy in effect at temperature 1). The vision tower and the image tokens are left as built."""
    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from miles.utils.tiny_vlm import build_tiny_vlm

    build_tiny_vlm(out, tie_word_embeddings=False)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(["<tool_call>", "</tool_call>", PAYLOAD])
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(out))
    model.resize_token_embeddings(len(tok))
    chain = [tok.convert_tokens_to_ids(t) for t in ("\n", "<tool_call>", PAYLOAD, "</tool_call>")] + [tok.eos_token_id]
    text = model.model.language_model
    with torch.no_grad():
        for layer in text.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = text.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        hidden = emb.shape[1]
        for i, (a, b) in enumerate(zip(chain, chain[1:])):
            emb[a] = 0.0
            emb[a, i] = hidden ** 0.5        # RMS 1: the final norm leaves it as is
            head[b, i] = 20.0                # logit 20 * sqrt(64) = 160 for the next token of the chain, 0 elsewhere
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return build_tool_calling_vlm(tmp_path_factory.mktemp("geo3k_mt_vlm"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """geo3k_imgurl's columns (``problem`` with an ``<image>``, ``answer``, ``images``); a row without an image."""
    from PIL import Image

    root = tmp_path_factory.mktemp("geo3k_mt_data")
    Image.fromarray((np.random.default_rng(0).random((32, 48, 3)) * 255).astype("uint8")).save(root / "0.png")
    rows = [{"problem": "<image>Find x.", "answer": "3", "images": ["0.png"]},
            {"problem": "No figure: find y.", "answer": "3", "images": []}]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _flags(vlm_dir: Path, data: Path, config: Path) -> list[str]:
    return ["--hf-checkpoint", str(vlm_dir), "--prompt-data", str(data), "--input-key", "problem",
            "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--rm-type", "math",
            "--apply-chat-template", "--custom-generate-function-path", "examples.geo3k_vlm.multi_turn.rollout.generate",
            "--custom-config-path", str(config),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "1024",
            "--rollout-max-context-len", "500", "--rollout-temperature", "1", "--num-rollout", "1",
            "--train-backend", "fsdp"]


def materialise_miles_example(repo: Path, rev: str, out: Path) -> Path:
    """Miles's ``examples/__init__.py`` and ``examples/geo3k_vlm/multi_turn/`` under ``out``, from a checkout (its
    files) or a git directory (``git archive`` of ``rev``)."""
    parts = ["examples/__init__.py", str(EXAMPLE)]
    if (repo / "examples").is_dir():
        shutil.copytree(repo / EXAMPLE, out / EXAMPLE)
        shutil.copy(repo / parts[0], out / parts[0])
    else:
        tar = subprocess.run(["git", "--git-dir", str(repo), "archive", rev, *parts], capture_output=True, timeout=60)
        assert tar.returncode == 0, tar.stderr.decode()
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
            t.extractall(out, filter="data")
    return out


@dataclass
class Example:
    source: str          # "ours" (the fixture) or "miles" (Miles's files from MILES_REPO)
    root: Path           # the directory holding examples/

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def observation(self) -> str:
        return OBSERVATIONS[self.source]


@pytest.fixture(params=["ours", "miles"])
def example_on_path(request, monkeypatch, tmp_path):
    """The example's ``examples`` package first on sys.path (ours, or Miles's: skipped without MILES_REPO); the
    ``examples.*`` modules imported before are set aside and put back after."""
    if request.param == "miles":
        if not MILES_REPO:
            pytest.skip("MILES_REPO (a Miles checkout or git directory) is not set: Miles's own example is not run")
        root = materialise_miles_example(Path(MILES_REPO), MILES_REV, tmp_path / "miles")
    else:
        root = PLUGINS
    assert (root / EXAMPLE / "rollout.py").is_file()
    mine = ("examples", "rollout_env_", "geo3k_env_")
    saved = {n: sys.modules.pop(n) for n in [m for m in sys.modules if m.startswith(mine)]}
    monkeypatch.syspath_prepend(str(root))
    yield Example(request.param, root)
    for name in [m for m in sys.modules if m.startswith(mine)]:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


@pytest.fixture
def vision_info(monkeypatch, example_on_path) -> Example:
    """The example on the path, with qwen_vl_utils or the stand-in of its process_vision_info for messages without
    images or videos."""
    try:
        import qwen_vl_utils  # noqa: F401
        return example_on_path
    except ImportError:
        pass

    def process_vision_info(conversations: list[dict[str, Any]]) -> tuple[None, None]:
        messages = [conversations] if isinstance(conversations[0], dict) else conversations
        for conversation in messages:
            for m in conversation:
                for item in m["content"] if isinstance(m["content"], list) else []:
                    if item.get("type", "text") in ("image", "image_url", "video") or {"image", "image_url",
                                                                                        "video"} & set(item):
                        raise NotImplementedError("the qwen_vl_utils stand-in reads no images or videos")
        return None, None

    stand_in = types.ModuleType("qwen_vl_utils")
    stand_in.process_vision_info = process_vision_info
    monkeypatch.setitem(sys.modules, "qwen_vl_utils", stand_in)
    return example_on_path


async def run_rollout(vlm_dir: Path, data: Path, client: Any, config: Path) -> tuple[Any, PromptDataset]:
    """One training rollout of the built-in rollout manager with the launcher's flags (2 prompts x 2 samples)."""
    cfg = parse_args(_flags(vlm_dir, data, config))
    tok = load_tokenizer(str(vlm_dir), "--hf-checkpoint")
    ds = PromptDataset(data, tok, cfg.data)
    manager = RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, tok, DataSource(ds), eval_cfg=cfg.eval,
                             sections=(cfg.algo, cfg.train), custom_config=cfg.custom_config)
    try:
        return await manager.generate_rollout(0), ds
    finally:
        await manager.aclose()


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of equal loss-mask values."""
    out: list[tuple[int, int]] = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


def check_samples(samples: list[Any], ds: PromptDataset, vlm_dir: Path, observation: str) -> None:
    """Each sample is Miles's multi-turn trajectory: the templated prompt's processor ids, then three tool-call turns
    (loss mask 1) with the environment's two observations between them (loss mask 0), the images kept."""
    from miles.rollout.sglang_rollout import GenerateState
    from miles.run.wire import decode_samples, encode_samples

    tok = load_tokenizer(str(vlm_dir), "--hf-checkpoint")
    processor = GenerateState(types.SimpleNamespace(hf_checkpoint=str(vlm_dir), tokenizer=tok)).processor
    pad = image_inputs(str(vlm_dir)).image_token_id
    assert len(samples) == 4
    for s in samples:
        item = ds.items[s.group_index]
        refs = item.metadata[MEDIA_KEY]["images"]
        assert s.status is SampleStatus.COMPLETED and "generate_error" not in s.metadata, s.metadata
        # Miles's sample.prompt: the chat-templated text; its processor ids are the data's prompt ids
        assert s.prompt == item.text and s.prompt.endswith("<|im_start|>assistant\n")
        images = [load_image(r) for r in refs] or None
        ids = processor(text=s.prompt, images=images, videos=None)["input_ids"][0]
        assert s.tokens[:s.prompt_length] == list(ids) == item.prompt_ids
        assert s.tokens.count(pad) == item.prompt_ids.count(pad)
        # the response: model turn, observation, model turn, observation, model turn
        response = s.tokens[s.prompt_length:]
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length == len(response)
        runs = _runs(s.loss_mask)
        assert [v for v, _ in runs] == [1, 0, 1, 0, 1], runs
        at, chunks = 0, []
        for _, n in runs:
            chunks.append(response[at:at + n])
            at += n
        for turn in chunks[0::2]:
            assert tok.decode(turn, skip_special_tokens=True) == TOOL_CALL
        for obs in chunks[1::2]:
            assert tok.decode(obs) == f"<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
        lp = np.asarray(s.rollout_log_probs)
        assert np.all(lp[np.asarray(s.loss_mask) == 0] == 0.0) and np.all(lp <= 0.0)
        assert s.response == tok.decode(response, skip_special_tokens=False)
        # the images: the sample's references unchanged, the processor's tensors of its one image
        assert s.metadata[MEDIA_KEY]["images"] == refs
        mm = s.multimodal_train_inputs
        if refs:
            assert set(mm) == {"pixel_values", "image_grid_thw"}, mm.keys()
            assert int(mm["image_grid_thw"].prod()) // 4 == s.tokens.count(pad) > 0
            assert mm["pixel_values"].shape[0] == int(mm["image_grid_thw"].prod())
        else:
            assert not mm and pad not in s.tokens
        assert s.reward in (0.0, 1.0)
    back = decode_samples(encode_samples(samples))
    assert [(b.tokens, b.loss_mask, b.metadata[MEDIA_KEY]) for b in back] == [
        (s.tokens, s.loss_mask, s.metadata[MEDIA_KEY]) for s in samples]


# ----------------------------------------------------------------------------- against a /generate stand-in
class GenerateStandIn:
    """SGLang's /generate on a local port: records each payload, answers ``TOOL_CALL`` and EOS as the model would."""

    def __init__(self, tok: Any) -> None:
        self.payloads: list[dict[str, Any]] = []
        ids = tok(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        answer = json.dumps({"text": TOOL_CALL, "meta_info": {
            "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.25, t, None] for t in ids]}}).encode()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                owner.payloads.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.urls = [f"http://127.0.0.1:{self.server.server_address[1]}"]   # what the manager reads the router from
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    async def abort(self, rid: Any) -> None:
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in(vlm_dir):
    server = GenerateStandIn(load_tokenizer(str(vlm_dir), "--hf-checkpoint"))
    yield server
    server.close()


def test_geo3k_multi_turn_against_a_generate_stand_in(vlm_dir, data, stand_in, vision_info):
    """Three turns per sample, the observations between them (check_samples). Every /generate of a sample holds its tokens so far and, for the row with an image, that image as SGLang's
    image_data (PNG of its pixels), on each of its three turns."""
    import base64

    from PIL import Image

    result, ds = asyncio.run(run_rollout(vlm_dir, data, stand_in, vision_info.config))
    samples = [s for g in result.samples for s in g]
    check_samples(samples, ds, vlm_dir, vision_info.observation)
    assert len(stand_in.payloads) == 4 * MAX_TURNS
    for s in samples:
        mine = [p for p in stand_in.payloads if p["input_ids"] == s.tokens[:len(p["input_ids"])]]
        assert sorted(len(p["input_ids"]) for p in mine)[0] == s.prompt_length
        refs = s.metadata[MEDIA_KEY]["images"]
        for p in mine:
            assert p["return_logprob"] is True and p["sampling_params"]["max_new_tokens"] > 0
            if not refs:
                assert "image_data" not in p
                continue
            (uri,) = p["image_data"]
            img = Image.open(io.BytesIO(base64.b64decode(uri.partition(",")[2])))
            assert np.array_equal(np.asarray(img), np.asarray(load_image(refs[0])))


def test_without_qwen_vl_utils_the_first_observation_fails_in_one_line(vlm_dir, data, stand_in, example_on_path,
                                                                       monkeypatch):
    """The example imports qwen_vl_utils (Miles's requirement) to encode an observation once a processor is set; without the package
    each sample fails there, and a rollout whose samples all failed stops with one line naming the module."""
    from miles.rollout.manager import RolloutError

    monkeypatch.setitem(sys.modules, "qwen_vl_utils", None)    # not importable, whether installed or not
    with pytest.raises(RolloutError) as e:
        asyncio.run(run_rollout(vlm_dir, data, stand_in, example_on_path.config))
    assert "every one of 4 samples failed" in str(e.value) and "qwen_vl_utils" in str(e.value), e.value
    assert "\n" not in str(e.value)
    assert len(stand_in.payloads) == 4       # one model turn each, then the observation's encoding failed


# ----------------------------------------------------------------------------- against the embedded engine
@pytest.mark.multiprocess
def test_geo3k_multi_turn_on_the_embedded_engine(vlm_dir, data, vision_info, tmp_path):
    """The embedded engine serves the tiny Qwen3-VL (images through its vision tower); the example drives it
    through the router address args with ``miles.utils.http_utils.post``, three turns per sample."""
    from embedded_engines import start_engine, wait_engines

    from miles.fleet.client import EngineClient

    async def go() -> tuple[Any, PromptDataset]:
        await wait_engines([(url, sup)])
        async with EngineClient(url, timeout=120, max_retries=1, concurrency=8) as client:
            return await run_rollout(vlm_dir, data, client, vision_info.config)

    sup, url = start_engine(vlm_dir, tmp_path / "engine.log", None, name="geo3k")
    try:
        result, ds = asyncio.run(go())
    finally:
        sup.stop()
    samples = [s for g in result.samples for s in g]
    check_samples(samples, ds, vlm_dir, vision_info.observation)
    for s in samples:
        assert all(lp > -1e-3 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m)   # the chain: p ~ 1
