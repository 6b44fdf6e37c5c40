"""The engine as a real server process on a tiny model: SGLang's /generate semantics and control routes."""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from miles.engine.testing import EngineProc, serialized_ipc

KEY = "test-key-123"


@pytest.fixture(scope="module")
def eng(engine_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine_log") / "engine.log"
    e = EngineProc(engine_model, "--max-running-requests", "4", "--max-context-len", "512", "--random-seed", "0",
                   api_key=KEY, log=log)
    yield e
    e.stop()


@torch.no_grad()
def greedy_ref(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def greedy(eng, prompt, n, **sp):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sp}}
    return eng.generate(body)


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [60], [70, 71, 72],
           [20, 30, 40, 50], [33] * 9, [80, 81, 82, 83, 84, 85], [15, 25], [90, 91, 92, 93, 94, 95, 96]]


def test_greedy_matches_hf_and_is_deterministic(eng, hf_reference):
    out = greedy(eng, PROMPTS[0], 24)
    assert out["output_ids"] == greedy_ref(hf_reference, PROMPTS[0], 24)
    assert len(set(out["output_ids"])) > 5  # the test model is not degenerate
    assert greedy(eng, PROMPTS[0], 24)["output_ids"] == out["output_ids"]
    m = out["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 24}
    assert m["prompt_tokens"] == 5 and m["completion_tokens"] == 24 and m["weight_version"] == "default"
    assert isinstance(m["id"], str) and isinstance(out["text"], str) and len(out["text"]) > 0


@torch.no_grad()
def test_logprobs_equal_a_reference_forward(eng, hf_reference):
    prompt, T = PROMPTS[2], 0.7
    out = eng.generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
                        "sampling_params": {"max_new_tokens": 16, "temperature": T, "top_k": 20, "sampling_seed": 11,
                                            "ignore_eos": True}})
    ids = out["output_ids"]
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == ids and len(ids) == 16
    logits = hf_reference(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits / T, -1)  # SGLang: log-prob under the temperature-scaled full distribution
    # fp32 against the HF forward: measured 7.9e-6 (output, temperature 0.7) / 1.4e-6 (prompt) (CPU, 2026-12-07)
    for i, (lp, t, _) in enumerate(lps):
        assert abs(lp - ref[len(prompt) - 1 + i, t].item()) < 1.6e-5
    raw = torch.log_softmax(logits, -1)
    inp = out["meta_info"]["input_token_logprobs"]
    assert inp[0][0] is None and [t for _, t, _ in inp] == prompt
    for i in range(1, len(prompt)):
        assert abs(inp[i][0] - raw[i - 1, prompt[i]].item()) < 3e-6
    top = out["meta_info"]["output_top_logprobs"][0]
    want = ref[len(prompt) - 1].topk(3)
    assert [t for _, t, _ in top] == want.indices.tolist()


def test_sampling_params_are_obeyed(eng):
    base = greedy(eng, PROMPTS[1], 30)["output_ids"]
    # stop_token_ids: stops at the first occurrence, the stop token is returned
    stop = base[6]
    first = base.index(stop)
    o = greedy(eng, PROMPTS[1], 30, stop_token_ids=[stop], ignore_eos=False)
    assert o["output_ids"] == base[: first + 1] and o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # ignore_eos disables stop ids (as in SGLang)
    assert greedy(eng, PROMPTS[1], 30, stop_token_ids=[stop])["output_ids"] == base
    # min_new_tokens: the stop token cannot come before it
    o = greedy(eng, PROMPTS[1], 30, stop_token_ids=[stop], ignore_eos=False, min_new_tokens=first + 3)
    assert len(o["output_ids"]) >= first + 3 and stop not in o["output_ids"][: first + 2]
    # top_k=1 at temperature 1 is greedy
    o = eng.generate({"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 30, "top_k": 1, "ignore_eos": True}})
    assert o["output_ids"] == base
    # sampling_seed reproducible; different seeds differ; n samples distinct and reproducible
    sp = {"max_new_tokens": 20, "temperature": 1.5, "ignore_eos": True}
    a = eng.generate({"input_ids": PROMPTS[1], "sampling_params": {**sp, "sampling_seed": 1}})["output_ids"]
    assert eng.generate({"input_ids": PROMPTS[1], "sampling_params": {**sp, "sampling_seed": 1}})["output_ids"] == a
    assert eng.generate({"input_ids": PROMPTS[1], "sampling_params": {**sp, "sampling_seed": 2}})["output_ids"] != a
    many = eng.generate({"input_ids": PROMPTS[1], "sampling_params": {**sp, "sampling_seed": 5, "n": 3}})
    assert isinstance(many, list) and len(many) == 3 and len({tuple(x["output_ids"]) for x in many}) == 3
    again = eng.generate({"input_ids": PROMPTS[1], "sampling_params": {**sp, "sampling_seed": 5, "n": 3}})
    assert [x["output_ids"] for x in again] == [x["output_ids"] for x in many]
    # stop strings: generation ends at the first occurrence, which is cut from the text (as in SGLang)
    t = greedy(eng, PROMPTS[1], 30)["text"]
    s = t[8:10]
    o = greedy(eng, PROMPTS[1], 30, stop=[s])
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": s}, (t, s, o)
    assert o["text"] == t[: t.index(s)] and o["output_ids"] == base[: len(o["output_ids"])]
    assert len(o["output_ids"]) < 30
    # text in works too
    o = eng.generate({"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert o["meta_info"]["prompt_tokens"] >= 1 and len(o["output_ids"]) == 4
    # max_new_tokens 0
    o = greedy(eng, PROMPTS[1], 0)
    assert o["output_ids"] == [] and o["meta_info"]["finish_reason"]["type"] == "length"


def test_continuous_batching_equals_one_at_a_time(eng, hf_reference):
    lens = [30, 7, 22, 40, 3, 16, 28, 11, 35, 9]
    refs = [greedy(eng, p, n)["output_ids"] for p, n in zip(PROMPTS, lens)]
    assert refs[0] == greedy_ref(hf_reference, PROMPTS[0], lens[0])

    def staggered(i):
        time.sleep(0.01 * i)  # requests arrive while others decode; 10 > 4 slots, so some queue
        return greedy(eng, PROMPTS[i], lens[i])["output_ids"]

    with ThreadPoolExecutor(10) as ex:
        got = list(ex.map(staggered, range(10)))
    assert got == refs
    batch = eng.generate({"input_ids": PROMPTS, "sampling_params": [
        {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lens]})
    assert [b["output_ids"] for b in batch] == refs


def _wait_load(eng, pred, timeout: float = 20.0) -> bool:
    """Poll /get_load until ``pred(load)`` holds (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred(eng.get("/get_load").json()[0]):
            return True
        time.sleep(0.002)
    return False


def _stream(eng, body, on_chunk=None):
    chunks = []
    with requests.post(eng.url + "/generate", json={**body, "stream": True}, headers=eng.headers, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith(b"data: ")
            if line == b"data: [DONE]":
                chunks.append("[DONE]")
                break
            chunks.append(json.loads(line[6:]))
            if on_chunk:
                on_chunk(len(chunks), chunks[-1])
    return chunks


def test_streaming(eng):
    ref = greedy(eng, PROMPTS[3], 12)
    chunks = _stream(eng, {"input_ids": PROMPTS[3], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert chunks[-1] == "[DONE]" and len(chunks) == 13
    assert [len(c["output_ids"]) for c in chunks[:-1]] == list(range(1, 13))
    assert chunks[-2]["output_ids"] == ref["output_ids"] and chunks[-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-2])


LONG = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_requests_and_continue_is_seamless(eng, mode):
    ref = greedy(eng, PROMPTS[4], 480)["output_ids"]
    paused_at = {}
    arrivals = []

    def on_chunk(i, c):
        arrivals.append(time.monotonic())
        if i == 2:
            assert eng.post("/pause_generation", {"mode": mode}).status_code == 200
            paused_at["n"] = len(c["output_ids"])
            paused_at["t"] = time.monotonic()

            def later():
                time.sleep(0.6)
                paused_at["load"] = eng.get("/get_load").json()[0]
                eng.post("/continue_generation", {})
            threading.Thread(target=later, daemon=True).start()

    t0 = time.monotonic()
    chunks = _stream(eng, {"input_ids": PROMPTS[4], "sampling_params": LONG}, on_chunk)
    final = chunks[-2]
    assert final["output_ids"] == ref and final["meta_info"]["finish_reason"]["type"] == "length"
    assert time.monotonic() - t0 >= 0.6
    # the stream really stalled while paused (the pause hit mid-generation), then went on seamlessly
    assert max(b - a for a, b in zip(arrivals, arrivals[1:])) >= 0.5
    assert paused_at["load"]["paused"] and paused_at["load"]["pause_mode"] == mode
    if mode == "retract":
        assert paused_at["load"]["num_running_reqs"] == 0 and paused_at["load"]["num_waiting_reqs"] == 1


def test_pause_abort_and_abort_request(eng):
    def on_chunk(i, c):
        if i == 5:
            eng.post("/pause_generation", {"mode": "abort"})
    chunks = _stream(eng, {"input_ids": PROMPTS[5], "sampling_params": LONG}, on_chunk)
    assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "abort" and len(chunks[-2]["output_ids"]) < 480
    # while paused a new request waits; continue lets it finish
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(greedy, eng, PROMPTS[5], 5)
        time.sleep(0.5)
        assert not fut.done()
        assert eng.get("/health").status_code == 200 and eng.get("/health_generate").status_code == 503
        eng.post("/continue_generation", {})
        assert fut.result(30)["meta_info"]["finish_reason"]["type"] == "length"
    # abort one rid
    def abort_rid(i, c):
        if i == 5:
            assert eng.post("/abort_request", {"rid": "victim"}).status_code == 200
    chunks = _stream(eng, {"input_ids": PROMPTS[6], "rid": "victim", "sampling_params": LONG}, abort_rid)
    assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "abort" and chunks[-2]["meta_info"]["id"] == "victim"
    # abort_all
    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(eng.generate, {"input_ids": p, "sampling_params": LONG}) for p in PROMPTS[:3]]
        assert _wait_load(eng, lambda load: load["num_running_reqs"] == 3), "the 3 requests never ran together"
        eng.post("/abort_request", {"abort_all": True})  # (a fixed sleep raced 480 fast tiny-model steps)
        outs = [f.result(30) for f in futs]
    # every one of the 3 running requests was aborted, mid-generation (not one of them, not after finishing)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3, [o["meta_info"] for o in outs]
    assert all(len(o["output_ids"]) < LONG["max_new_tokens"] for o in outs)
    assert eng.get("/health_generate").status_code == 200


@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"input_ids": [1, 2], "samplingparams": {}}, "samplingparams"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 600}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 2}}, "top_p"),
    ("/generate", {"input_ids": [[1], 2]}, "input_ids"),
    ("/pause_generation", {"mode": "later"}, "mode"),
    ("/update_weights_from_distributed", {"names": ["x"], "shapes": [[1]], "dtypes": ["float32"], "extra": 1}, "extra"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, "master_port"),
    ("/update_weight_version", {"version": "3"}, "version"),
    ("/abort_request", {"rids": ["a"]}, "rids"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ("/generate", {"input_ids": [1, 2], "image_data": ["data:image/png;base64,iVBORw0KGgo="]}, "takes no images"),
    ("/generate", {"input_ids": [1, 2], "video_data": ["v.mp4"]}, "video_data is not supported"),
    ("/generate", {"input_ids": [1, 2], "audio_data": ["a.wav"]}, "audio_data is not supported"),
])
def test_bad_bodies_are_400_and_the_server_keeps_serving(eng, path, body, field):
    r = eng.post(path, body)
    assert r.status_code == 400, r.text
    assert field in r.json()["message"] and "\n" not in r.json()["message"]
    assert greedy(eng, PROMPTS[0], 2)["meta_info"]["completion_tokens"] == 2


def test_api_key_is_enforced(eng):
    assert requests.post(eng.url + "/generate", json={"input_ids": [1]}, timeout=10).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert requests.get(eng.url + "/get_model_info", headers=bad, timeout=10).status_code == 401
    assert requests.get(eng.url + "/health", timeout=30).status_code == 200  # exempt, as in SGLang
    info = eng.get("/get_model_info").json()
    assert info["weight_version"] and info["is_generation"] is True
    srv = eng.get("/get_server_info").json()
    assert srv["max_running_requests"] == 4 and srv["context_length"] == 512 and srv["dp_size"] == 1


def test_control_routes(eng):
    assert eng.post("/flush_cache").status_code == 200
    r = eng.post("/update_weight_version", {"new_version": "v7"})
    assert r.status_code == 200 and r.json()["new_version"] == "v7"
    assert greedy(eng, PROMPTS[0], 2)["meta_info"]["weight_version"] == "v7"
    before = greedy(eng, PROMPTS[0], 10)["output_ids"]
    assert eng.post("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}).status_code == 200
    assert eng.get("/health_generate").status_code == 503
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(greedy, eng, PROMPTS[0], 10)
        time.sleep(0.4)
        assert not fut.done()  # queued while memory is released
        assert eng.post("/resume_memory_occupation", {"tags": None}).status_code == 200
        assert fut.result(30)["output_ids"] == before
    eng.post("/update_weight_version", {"new_version": "default"})


def test_weights_by_name_from_tensor_and_from_disk(eng, engine_model, hf_reference, tmp_path):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from miles.weight_sync.buckets import pack_bucket

    mp.set_sharing_strategy("file_system")
    name = "model.layers.0.mlp.down_proj.weight"
    orig = hf_reference.get_parameter(name).detach().clone()
    got = torch.tensor(eng.post("/get_weights_by_name", {"name": name, "truncate_size": 5}).json())
    assert torch.equal(got, orig[:5])     # the weights read back exactly (JSON floats hold fp32 values)
    assert eng.post("/get_weights_by_name", {"name": "nope"}).status_code == 400
    before = greedy(eng, PROMPTS[0], 12)["output_ids"]

    # per-tensor hand-off through shared memory (CPU)
    new = (orig * -1.0).contiguous().share_memory_()
    r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized_ipc([(name, new)])], "weight_version": "t1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert torch.equal(torch.tensor(eng.post("/get_weights_by_name", {"name": name, "truncate_size": 5}).json()), new[:5])
    assert greedy(eng, PROMPTS[0], 12)["meta_info"]["weight_version"] == "t1"

    # flattened bucket of two tensors with different dtypes
    n2 = "model.norm.weight"
    flat, meta = pack_bucket([(name, orig.clone()), (n2, torch.full((64,), 2.0, dtype=torch.float64))])
    flat.share_memory_()
    r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized_ipc({"flattened_tensor": flat, "metadata": meta})],
                                                 "load_format": "flattened_bucket"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert torch.equal(torch.tensor(eng.post("/get_weights_by_name", {"name": name, "truncate_size": 5}).json()), orig[:5])
    assert eng.post("/get_weights_by_name", {"name": n2, "truncate_size": 3}).json() == [2.0, 2.0, 2.0]

    # unknown names / bad shapes are refused and change nothing
    r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized_ipc([("bogus.weight", torch.zeros(2).share_memory_())])]})
    assert r.status_code == 400 and "bogus.weight" in r.json()["message"]
    r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode()]})
    assert r.status_code == 400 and "refusing" in r.json()["message"]

    # from disk: a modified full checkpoint, then a broken path (rolled back), then the original again
    m2 = AutoModelForCausalLM.from_pretrained(engine_model)
    with torch.no_grad():
        for p in m2.parameters():
            p.mul_(0.9)
    d2 = tmp_path / "m2"
    m2.save_pretrained(str(d2))
    r = eng.post("/update_weights_from_disk", {"model_path": str(d2), "weight_version": "d2"})
    assert r.status_code == 200 and r.json()["success"], r.text
    out = greedy(eng, PROMPTS[0], 12)
    assert out["output_ids"] == greedy_ref(m2.eval(), PROMPTS[0], 12) and out["meta_info"]["weight_version"] == "d2"
    (tmp_path / "empty").mkdir()
    r = eng.post("/update_weights_from_disk", {"model_path": str(tmp_path / "empty")})
    assert r.status_code == 400 and not r.json()["success"]
    assert greedy(eng, PROMPTS[0], 12)["output_ids"] == out["output_ids"]
    r = eng.post("/update_weights_from_disk", {"model_path": str(engine_model), "weight_version": "default"})
    assert r.status_code == 200
    assert greedy(eng, PROMPTS[0], 12)["output_ids"] == before


def test_an_http2_preface_is_answered_400_without_a_traceback(eng):
    """sglang-router detects a new worker's connection mode by probing it over HTTP and gRPC at once; the gRPC probe's
    HTTP/2 preface used to leave 'Error handling request' and a traceback in the engine's log (twice per worker),
    which the run later quoted as a dead engine's last error. It is answered 400 and logged as one debug line."""
    import socket

    before = eng.log.read_text(errors="replace")
    with socket.create_connection(("127.0.0.1", eng.port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # preface + SETTINGS
        reply = s.recv(64)
    assert reply.split(b"\r\n")[0] in (b"HTTP/1.0 400 Bad Request", b"HTTP/1.1 400 Bad Request"), reply
    assert requests.get(eng.url + "/health", timeout=10).status_code == 200  # still serving
    time.sleep(0.5)  # the engine's output reaches its log file
    new = eng.log.read_text(errors="replace")[len(before):]
    assert "Traceback" not in new and "Error handling request" not in new, new
