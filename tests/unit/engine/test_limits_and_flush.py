"""The embedded engine under hostile load (a huge ``n``, a client that goes away, SIGTERM while busy) and
the pause/flush race that used to fail weight syncs, on real server processes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from miles.engine.testing import EngineProc


@pytest.fixture(scope="module")
def big(engine_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine_log") / "engine.log"
    e = EngineProc(engine_model, "--max-running-requests", "4", "--max-context-len", "4096",
                   "--max-samples-per-request", "100000", "--max-queued-requests", "100010", log=log)
    yield e
    e.stop()


def _load(eng) -> dict:
    return eng.get("/get_load").json()[0]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_too_large_n_is_a_400_naming_the_limit(engine_model):
    eng = EngineProc(engine_model, "--max-running-requests", "4", "--max-context-len", "256")
    try:
        r = eng.post("/generate", {"input_ids": [5, 6], "sampling_params": {"n": 100000, "max_new_tokens": 4}}, timeout=30)
        assert r.status_code == 400, r.text
        msg = r.json()["message"]
        assert "100000" in msg and "4096" in msg and "--max-samples-per-request" in msg, msg
        assert eng.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})["output_ids"]
    finally:
        eng.stop()


def test_big_n_whose_client_disconnects_is_aborted_within_seconds(big):
    """100000 queued samples whose client goes away: every abort is O(1), so the engine generates again at
    once (it used to take ~40 s for 20000 and about an hour for 100000: each abort scanned the queue)."""
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(big.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"n": 100000, "max_new_tokens": 8}},
                      timeout=3)
    t0 = time.monotonic()
    out = big.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}, timeout=5)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert time.monotonic() - t0 < 5
    load = _load(big)
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0, load
    assert big.get("/health", timeout=5).status_code == 200


def test_flush_succeeds_after_a_retract_pause_with_a_request_in_flight(big):
    """The weight-sync race: a generation still running when the sync pauses (retract, the default) is put
    back in the queue, holding no KV; flush_cache must succeed (it answered 400 "Cache not flushed") and the
    request must finish seamlessly after continue."""
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(big.generate, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}, 120)
        _wait(lambda: _load(big)["num_running_reqs"] == 1, 30, "the generation never started")
        assert big.post("/pause_generation", {"mode": "retract"}).status_code == 200
        load = _load(big)
        assert load["num_waiting_reqs"] == 1 and load["num_running_reqs"] == 0, load  # it was in flight at the pause
        r = big.post("/flush_cache", {"timeout_s": 0})
        assert r.status_code == 200, r.text
        assert big.post("/continue_generation", {"torch_empty_cache": True, "rid": None}).status_code == 200
        out = fut.result(120)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3000}


def test_flush_succeeds_with_a_request_that_arrived_after_an_abort_pause(big):
    assert big.post("/pause_generation", {"mode": "abort"}).status_code == 200
    try:
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(big.generate, {"input_ids": [7], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
                            60)
            _wait(lambda: _load(big)["num_waiting_reqs"] == 1, 30, "the request never queued")
            assert big.post("/flush_cache").status_code == 200
            assert big.get("/health", timeout=5).status_code == 200       # paused on purpose: alive
            assert big.post("/continue_generation", {}).status_code == 200
            assert len(fut.result(60)["output_ids"]) == 4
    finally:
        big.post("/continue_generation", {})


def test_flush_waits_for_running_requests_within_timeout_s(big):
    """Unpaused with a request running, flush_cache is refused at once, and with timeout_s it waits for it."""
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(big.generate, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}, 60)
        _wait(lambda: _load(big)["num_running_reqs"] == 1, 30, "the generation never started")
        assert big.post("/flush_cache").status_code == 400
        assert big.post("/flush_cache", {"timeout_s": 60}).status_code == 200
        assert _load(big)["num_running_reqs"] == 0
        assert len(fut.result(60)["output_ids"]) == 2000


def test_queue_bound_is_a_503_and_sigterm_exits_within_seconds_when_busy(engine_model):
    eng = EngineProc(engine_model, "--max-running-requests", "4", "--max-context-len", "256",
                     "--max-samples-per-request", "20000", "--max-queued-requests", "20000")
    try:
        def hold() -> None:
            try:
                requests.post(eng.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"n": 20000,
                              "max_new_tokens": 16}}, timeout=120)
            except requests.RequestException:
                pass  # the engine goes away under it: expected
        threading.Thread(target=hold, daemon=True).start()
        _wait(lambda: _load(eng)["num_waiting_reqs"] > 1000, 30, "the big request never queued")
        r = eng.post("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 503 and "--max-queued-requests" in r.json()["message"], r.text
        t0 = time.monotonic()
        eng.proc.terminate()
        eng.proc.wait(5)   # the engine promises exit within 3 s of SIGTERM
        assert time.monotonic() - t0 < 5
    finally:
        eng.stop()
