"""The engine on a tiny Qwen3-VL with SGLang's ``image_data`` (a real server process, HF as the reference)."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
import requests
import torch
from transformers import GenerationConfig

from miles.engine.testing import EngineProc, build_engine_vlm, image_data_url, serialized_ipc


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_engine_vlm(tmp_path_factory.mktemp("engine_vlm"))


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(vlm_dir).eval()


@pytest.fixture(scope="module")
def eng(vlm_dir, tmp_path_factory):
    e = EngineProc(vlm_dir, "--max-running-requests", "4", "--max-context-len", "256", "--random-seed", "0",
                   log=tmp_path_factory.mktemp("engine_vlm_log") / "engine.log")
    yield e
    e.stop()


IMG_A, IMG_B = image_data_url(1), image_data_url(2)          # 64x64: grid 1x4x4, 4 image tokens, rope delta -2
IMG_SMALL = image_data_url(3, (48, 40))                        # grid 1x2x4: 2 image tokens


def image_prompt(cfg, counts: list[int], text: tuple[int, ...] = (7, 8, 9)) -> list[int]:
    """``5 6 <vision_start> <image_pad>*n <vision_end> ...`` for each image, then ``text``."""
    ids = [5, 6]
    for n in counts:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id, 11]
    return ids + list(text)


def hf_inputs(vlm_dir, refs: list[str]) -> dict[str, torch.Tensor]:
    """pixel_values / image_grid_thw straight from the checkpoint's image processor (not the engine's code)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(vlm_dir)
    images = [Image.open(io.BytesIO(base64.b64decode(r.partition(",")[2]))).convert("RGB") for r in refs]
    out = proc(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@torch.no_grad()
def hf_logits(hf, ids: list[int], mm: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF's full forward (no cache: M-RoPE positions of the whole sequence from ``get_rope_index``) -> [T, V]."""
    t = torch.tensor([ids])
    kw = dict(mm, mm_token_type_ids=(t == hf.config.image_token_id).to(torch.int32)) if mm else {}
    return hf(input_ids=t, **kw).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], mm: dict[str, torch.Tensor], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf_logits(hf, seq, mm)[-1].argmax()))
    return seq[len(ids):]


def generate(eng, ids, images, n=12, **kw):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, **kw}
    if images is not None:
        body["image_data"] = images
    return eng.generate(body)


def test_image_prompt_greedy_tokens_and_logprobs_equal_hf(eng, hf_vlm, vlm_dir):
    cfg = hf_vlm.config
    ids = image_prompt(cfg, [4])
    mm = hf_inputs(vlm_dir, [IMG_A])
    out = generate(eng, ids, [IMG_A], n=16, logprob_start_len=0)
    toks = out["output_ids"]
    assert toks == hf_greedy(hf_vlm, ids, mm, 16)
    assert len(set(toks)) > 3                      # not degenerate
    assert cfg.eos_token_id in toks                # ignore_eos went on past it
    # HF's own generate (its cache and rope-delta bookkeeping) gives the same tokens (no eos: ignore_eos)
    t = torch.tensor([ids])
    with torch.no_grad():
        gen = hf_vlm.generate(input_ids=t, attention_mask=torch.ones_like(t), **mm,
                              mm_token_type_ids=(t == cfg.image_token_id).to(torch.int32),
                              generation_config=GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=[],
                                                                 pad_token_id=0))
    assert gen[0, len(ids):].tolist() == toks
    # without ignore_eos the request stops at the first eos, as HF's generate does
    stop = generate(eng, ids, [IMG_A], n=16, sampling_params={"max_new_tokens": 16, "temperature": 0})
    first = toks.index(cfg.eos_token_id)
    assert stop["output_ids"] == toks[: first + 1] and stop["meta_info"]["finish_reason"]["type"] == "stop"
    ref = torch.log_softmax(hf_logits(hf_vlm, ids + toks, mm), -1)
    lps = out["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in lps] == toks
    # fp32 against the HF forward: measured 4.2e-6 (output) / 2.4e-6 (prompt) (CPU, 2026-12-07)
    for i, (lp, tok, _) in enumerate(lps):
        assert abs(lp - ref[len(ids) - 1 + i, tok].item()) < 8.5e-6, i
    inp = out["meta_info"]["input_token_logprobs"]
    assert inp[0][0] is None and [tok for _, tok, _ in inp] == ids
    for i in range(1, len(ids)):
        assert abs(inp[i][0] - ref[i - 1, ids[i]].item()) < 5e-6, i


def test_two_images_one_prompt_and_temperature_sampling_equal_hf(eng, hf_vlm, vlm_dir):
    ids = image_prompt(hf_vlm.config, [4, 2])
    refs = [IMG_B, IMG_SMALL]
    mm = hf_inputs(vlm_dir, refs)
    T = 0.8
    outs = eng.generate({"input_ids": ids, "image_data": refs, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 10, "temperature": T, "sampling_seed": 5, "n": 2,
                                             "ignore_eos": True}})
    assert len(outs) == 2 and outs[0]["output_ids"] != outs[1]["output_ids"]
    for out in outs:
        toks = out["output_ids"]
        ref = torch.log_softmax(hf_logits(hf_vlm, ids + toks, mm) / T, -1)
        for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            assert abs(lp - ref[len(ids) - 1 + i, tok].item()) < 1e-5         # measured 4.8e-6 (CPU, 2026-12-07)


def test_different_images_same_tokens_never_share(eng, hf_vlm, vlm_dir):
    ids = image_prompt(hf_vlm.config, [4])
    a = generate(eng, ids, [IMG_A], n=8)
    b = generate(eng, ids, [IMG_B], n=8)
    la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
    lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(la, lb)) > 1e-2
    # one batch: equal token ids, different images, a text-only prompt beside them (admitted in one prefill)
    text = [5, 6, 7, 8, 9, 10]
    batch = eng.generate({"input_ids": [ids, ids, text], "image_data": [[IMG_A], [IMG_B], None], "return_logprob": True,
                          "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    assert batch[0]["output_ids"] == a["output_ids"] and batch[1]["output_ids"] == b["output_ids"]
    for got, want in ((batch[0], a), (batch[1], b)):
        for (x, _, _), (y, _, _) in zip(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]):
            assert x == y                                    # measured: bit for bit (CPU, 2026-12-07)
    assert batch[2]["output_ids"] == hf_greedy(hf_vlm, text, {}, 8)
    assert batch[1]["output_ids"] == hf_greedy(hf_vlm, ids, hf_inputs(vlm_dir, [IMG_B]), 8)


@pytest.mark.parametrize("body, words", [
    ({"n_tokens": [3], "image_data": [IMG_A]}, ["3 image token", "need [4]"]),
    ({"n_tokens": [4], "image_data": [IMG_A, IMG_B]}, ["2 image(s)", "1 run(s) of image tokens"]),
    ({"n_tokens": [4, 3], "image_data": [IMG_A, IMG_B]}, ["runs [4, 3]", "need [4, 4]"]),
    ({"n_tokens": [4], "image_data": None}, ["image token", "no image_data"]),
    ({"n_tokens": [4], "image_data": ["data:image/png;base64,@@@"]}, ["base64"]),
    ({"n_tokens": [4], "image_data": ["data:image/png;base64," + base64.b64encode(b"not a png").decode()]},
     ["not a readable image"]),
    ({"n_tokens": [4], "image_data": ["http://example.com/cat.png"]}, ["remote images"]),
    ({"n_tokens": [4], "image_data": ["/no/such/file.png"]}, ["neither"]),
    ({"n_tokens": [4], "image_data": [5]}, ["image_data[0]"]),
    ({"n_tokens": [4], "image_data": [IMG_A], "video_data": ["v.mp4"]}, ["video_data", "not supported"]),
    ({"n_tokens": [4], "image_data": [IMG_A], "audio_data": ["a.wav"]}, ["audio_data", "not supported"]),
])
def test_bad_image_requests_are_one_line_400s(eng, hf_vlm, body, words):
    body = dict(body)
    req = {"input_ids": image_prompt(hf_vlm.config, body.pop("n_tokens")), "sampling_params": {"max_new_tokens": 2},
           **{k: v for k, v in body.items() if v is not None}}
    r = eng.post("/generate", req)
    assert r.status_code == 400, r.text
    msg = r.json()["message"]
    assert "\n" not in msg and "Traceback" not in msg
    for w in words:
        assert w in msg, msg
    assert generate(eng, [5, 6, 7], None, n=2)["meta_info"]["completion_tokens"] == 2


def test_image_paths_and_bare_base64_equal_the_data_url(eng, hf_vlm, tmp_path):
    ids = image_prompt(hf_vlm.config, [4])
    want = generate(eng, ids, [IMG_A], n=6)["output_ids"]
    raw = base64.b64decode(IMG_A.partition(",")[2])
    path = tmp_path / "a.png"
    path.write_bytes(raw)
    for ref in (str(path), f"file://{path}", base64.b64encode(raw).decode()):
        assert generate(eng, ids, [ref], n=6)["output_ids"] == want, ref
    assert generate(eng, ids, IMG_A, n=6)["output_ids"] == want          # a single prompt's one image as a string


@pytest.mark.parametrize("body, want", [
    ({"input_ids": [1, 2], "image_data": "x"}, [["x"]]),
    ({"input_ids": [1, 2], "image_data": ["x", "y"]}, [["x", "y"]]),
    ({"input_ids": [1, 2], "image_data": []}, [None]),
    ({"input_ids": [[1], [2], [3]], "image_data": ["x", None, ["y", "z"]]}, [["x"], None, ["y", "z"]]),
])
def test_image_data_shapes(body, want):
    from miles.engine import protocol as P

    req = P.decode(json.dumps(body).encode(), P.GenerateReqInput)
    specs, _ = P.normalize_generate(req, None, 100, lambda: "r", image_error=None)
    assert [s.image_data for s in specs] == want
    if body["image_data"] != []:   # a text-only model: one line saying why (an empty list is no images)
        with pytest.raises(P.BadRequest, match="takes no images"):
            P.normalize_generate(req, None, 100, lambda: "r")


def test_image_data_of_a_batch_needs_one_entry_per_prompt():
    from miles.engine import protocol as P

    req = P.decode(b'{"input_ids": [[1], [2]], "image_data": ["x"]}', P.GenerateReqInput)
    with pytest.raises(P.BadRequest, match="one entry per prompt of the batch"):
        P.normalize_generate(req, None, 100, lambda: "r", image_error=None)


def test_abort_returns_every_slot(eng, hf_vlm):
    ids = image_prompt(hf_vlm.config, [4])
    body = {"input_ids": ids, "image_data": [IMG_A], "rid": "vlm-victim", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    last = None
    with requests.post(eng.url + "/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for i, line in enumerate(x for x in r.iter_lines() if x):
            if line == b"data: [DONE]":
                break
            last = json.loads(line[6:])
            if i == 3:
                assert eng.post("/abort_request", {"rid": "vlm-victim"}).status_code == 200
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < 200
    deadline = time.monotonic() + 10
    while (load := eng.get("/get_load").json()[0])["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    # all 4 slots are free again: 4 image prompts run at once and still equal one at a time
    one = generate(eng, ids, [IMG_A], n=6)["output_ids"]
    many = eng.generate({"input_ids": [ids] * 4, "image_data": [[IMG_A]] * 4,
                         "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert [m["output_ids"] for m in many] == [one] * 4


def test_retracting_pause_recomputes_the_image_prompt_seamlessly(eng, hf_vlm):
    ids = image_prompt(hf_vlm.config, [4])
    ref = generate(eng, ids, [IMG_B], n=150)
    body = {"input_ids": ids, "image_data": [IMG_B], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}}
    last, seen = None, None
    with requests.post(eng.url + "/generate", json=body, stream=True, timeout=60) as r:
        for i, line in enumerate(x for x in r.iter_lines() if x):
            if line == b"data: [DONE]":
                break
            last = json.loads(line[6:])
            if i == 2:
                assert eng.post("/pause_generation", {"mode": "retract"}).status_code == 200
                seen = eng.get("/get_load").json()[0]
                eng.post("/continue_generation", {})
    assert seen["num_running_reqs"] == 0 and seen["num_waiting_reqs"] == 1     # really retracted mid-generation
    assert last["output_ids"] == ref["output_ids"]
    for (x, _, _), (y, _, _) in zip(last["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]):
        assert abs(x - y) < 4e-6                                  # measured 2.0e-6 (CPU, 2026-12-07)


def test_runner_slots_hold_nothing_after_release(vlm_dir):
    from miles.engine.model_runner import ModelRunner, RunnerOptions
    from miles.engine.vlm import VisionInputs

    rn = ModelRunner(vlm_dir, RunnerOptions(max_running_requests=3, max_context_len=128))
    vis = VisionInputs(str(vlm_dir), rn.config)
    ids = image_prompt(rn.config, [4])
    mm = vis.prepare([IMG_A], ids)
    rn.prefill(0, [ids, [5, 6, 7]], [False, False], [mm, None])
    assert rn.impl.deltas[:2] == [-2, 0]
    rn.share_prefix(0, 2, len(ids))
    rn.move_slot(2, 1, len(ids))
    assert rn.impl.deltas == [-2, -2, 0] and rn.impl.caches[2] is None
    for s in range(3):
        rn.release_slot(s)
    assert rn.impl.caches == [None] * 3 and rn.impl.deltas == [0] * 3


def test_weight_updates_by_vlm_names_and_memory_release(eng, hf_vlm, vlm_dir, tmp_path):
    import copy

    import torch.multiprocessing as mp
    from transformers import Qwen3VLForConditionalGeneration

    mp.set_sharing_strategy("file_system")
    ids = image_prompt(hf_vlm.config, [4])
    mm = hf_inputs(vlm_dir, [IMG_A])
    before = generate(eng, ids, [IMG_A], n=10)["output_ids"]
    names = ["model.visual.blocks.0.mlp.linear_fc1.weight", "model.language_model.layers.0.mlp.down_proj.weight",
             "lm_head.weight"]
    ref = copy.deepcopy(hf_vlm)
    params = dict(ref.named_parameters())
    new = {}
    g = torch.Generator().manual_seed(7)
    for n in names:
        new[n] = (params[n].detach() + torch.randn(params[n].shape, generator=g) * 0.2).contiguous().share_memory_()
        with torch.no_grad():
            params[n].copy_(new[n])
    got = eng.post("/get_weights_by_name", {"name": names[0], "truncate_size": 3})
    assert got.status_code == 200 and torch.equal(torch.tensor(got.json()), hf_vlm.get_parameter(names[0])[:3])
    r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized_ipc(list(new.items()))],
                                                 "weight_version": "vlm1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    out = generate(eng, ids, [IMG_A], n=10)
    assert out["meta_info"]["weight_version"] == "vlm1"
    assert out["output_ids"] == hf_greedy(ref, ids, mm, 10) != before
    logits = torch.log_softmax(hf_logits(ref, ids + out["output_ids"], mm), -1)
    # fp32 against the HF forward: measured 1.9e-6 here, 3.2e-6 after the vision-tower update below (CPU, 2026-12-07)
    for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - logits[len(ids) - 1 + i, tok].item()) < 4e-6
    # a vision-tower-only change moves the image prompt's log-probs as HF's do
    vname = "model.visual.merger.linear_fc2.weight"
    vnew = (params[vname].detach() * -1.0).contiguous().share_memory_()
    with torch.no_grad():
        params[vname].copy_(vnew)
    r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized_ipc([(vname, vnew)])]})
    assert r.status_code == 200 and r.json()["success"], r.text
    out2 = generate(eng, ids, [IMG_A], n=10)
    assert out2["output_ids"] == hf_greedy(ref, ids, mm, 10)
    logits = torch.log_softmax(hf_logits(ref, ids + out2["output_ids"], mm), -1)
    for i, (lp, tok, _) in enumerate(out2["meta_info"]["output_token_logprobs"]):
        assert abs(lp - logits[len(ids) - 1 + i, tok].item()) < 6.5e-6
    # release / resume memory keeps the updated weights
    assert eng.post("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}).status_code == 200
    assert eng.post("/resume_memory_occupation", {"tags": None}).status_code == 200
    assert generate(eng, ids, [IMG_A], n=10)["output_ids"] == out2["output_ids"]
    # from disk: the original checkpoint back (HF names as save_pretrained writes them)
    r = eng.post("/update_weights_from_disk", {"model_path": str(vlm_dir), "weight_version": "default"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert generate(eng, ids, [IMG_A], n=10)["output_ids"] == before
    # and a modified copy from disk equals HF on that copy
    m2 = Qwen3VLForConditionalGeneration.from_pretrained(vlm_dir)
    with torch.no_grad():
        for p in m2.parameters():
            p.mul_(0.9)
    m2.save_pretrained(str(tmp_path / "m2"))
    r = eng.post("/update_weights_from_disk", {"model_path": str(tmp_path / "m2"), "weight_version": "d2"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert generate(eng, ids, [IMG_A], n=10)["output_ids"] == hf_greedy(m2.eval(), ids, mm, 10)
    r = eng.post("/update_weights_from_disk", {"model_path": str(vlm_dir), "weight_version": "default"})
    assert r.status_code == 200


def test_model_info_says_images(eng):
    assert eng.get("/get_model_info").json()["has_image_understanding"] is True


def test_a_vlm_dir_without_its_image_processor_is_one_line(vlm_dir, tmp_path):
    import shutil

    from transformers import AutoConfig

    from miles.engine.vlm import VisionInputs

    d = tmp_path / "no_proc"
    shutil.copytree(vlm_dir, d)
    (d / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="preprocessor_config.json") as e:
        VisionInputs(str(d), AutoConfig.from_pretrained(d))
    assert "\n" not in str(e.value)
