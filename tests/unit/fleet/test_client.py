"""The fleet's HTTP client against a real embedded engine process (`python -m miles.engine`)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from embedded_engines import start_engine, wait_engines

from miles.fleet.client import EngineClient, EngineControl, EngineError, SyncEngineControl
from miles.fleet.engines import engine_url
from miles.utils.net import find_free_port

pytestmark = pytest.mark.multiprocess

KEY = "client-test-key"
PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 1.0, "max_new_tokens": 480, "ignore_eos": True}  # runs for a while on the tiny model


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    sup, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log", KEY)
    try:
        asyncio.run(wait_engines([(url, sup)]))
        yield url
    finally:
        sup.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def dead_url() -> str:
    return engine_url("127.0.0.1", find_free_port())


# --- generation -------------------------------------------------------------------------------------
def test_generate_greedy_with_metadata(engine):
    async def go():
        async with EngineClient(engine, api_key=KEY, timeout=60, max_retries=1, concurrency=4) as client:
            a = await client.generate(PROMPT, GREEDY, rid="req-a")
            b = await client.generate(PROMPT, GREEDY)
            return a, b
    a, b = run(go())
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 8
    meta = a["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 8
    assert [t for _, t, _ in meta["output_token_logprobs"]] == a["output_ids"]
    assert all(lp <= 0.0 for lp, _, _ in meta["output_token_logprobs"])
    assert a["miles"]["rid"] == "req-a" and meta["id"] == "req-a"
    assert a["miles"]["url"] == engine and a["miles"]["attempts"] == 1 and a["miles"]["errors"] == []
    assert b["miles"]["rid"] != "req-a"


def test_concurrency_is_bounded(engine):
    class Counting(EngineClient):
        inflight = peak = 0

        async def _request(self, method, url, endpoint, payload=None, timeout=None):
            Counting.inflight += 1
            Counting.peak = max(Counting.peak, Counting.inflight)
            try:
                return await super()._request(method, url, endpoint, payload, timeout)
            finally:
                Counting.inflight -= 1

    async def go():
        async with Counting(engine, api_key=KEY, timeout=60, concurrency=2) as client:
            return await asyncio.gather(*(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 24}) for _ in range(6)))
    outs = run(go())
    assert len(outs) == 6 and Counting.peak == 2


def test_api_key_enforced(engine):
    async def go():
        async with EngineClient(engine, timeout=30, max_retries=3) as client:
            with pytest.raises(EngineError) as ei:
                await client.generate(PROMPT, GREEDY)
            retries = client.stats["retries"]
        async with EngineClient(engine, api_key="wrong", timeout=30, max_retries=3) as client:
            with pytest.raises(EngineError) as wrong:
                await client.generate(PROMPT, GREEDY)
        async with EngineControl(engine) as ctl:  # /health needs no key (as in SGLang)
            healthy = await ctl.health()
            with pytest.raises(EngineError) as info:
                await ctl.get_model_info()
        return ei.value, retries, wrong.value, healthy, info.value
    err, retries, wrong, healthy, info = run(go())
    assert err.status == 401 and not err.retryable and retries == 0
    assert "--sglang-api-key" in str(err) and "1 attempt" in str(err)
    assert wrong.status == 401 and info.status == 401 and healthy


def test_bad_request_is_a_400_and_not_retried(engine):
    async def go():
        async with EngineClient(engine, api_key=KEY, timeout=30, max_retries=3) as client:
            with pytest.raises(EngineError) as ei:
                await client.generate(PROMPT, {**GREEDY, "not_a_sampling_param": 1})
            return ei.value, client.stats
    err, stats = run(go())
    assert err.status == 400 and "not_a_sampling_param" in err.message and stats["retries"] == 0


def test_generate_argument_errors(engine):
    client = EngineClient(engine, api_key=KEY)
    with pytest.raises(ValueError, match="input_ids is empty"):
        run(client.generate([], GREEDY))
    with pytest.raises(ValueError, match="'n'"):
        run(client.generate(PROMPT, {**GREEDY, "n": 2}))
    with pytest.raises(ValueError, match="concurrency"):
        EngineClient(engine, concurrency=0)


def test_timeout_raises_a_clear_error_and_aborts(engine):
    async def go():
        async with EngineClient(engine, api_key=KEY, timeout=0.2, max_retries=1, backoff=0.05) as client:
            t0 = time.monotonic()
            with pytest.raises(EngineError) as ei:
                await client.generate(PROMPT, LONG, rid="slow")
            elapsed = time.monotonic() - t0
        async with EngineClient(engine, api_key=KEY, timeout=60) as client:  # the engine still serves
            after = await client.generate(PROMPT, GREEDY)
        return ei.value, elapsed, after
    err, elapsed, after = run(go())
    assert err.timed_out and "timed out after 0.2s" in str(err) and "after 2 attempt(s)" in str(err)
    assert elapsed < 10 and len(after["output_ids"]) == 8


def test_unreachable_engine_fails_within_bounds():
    async def go():
        async with EngineClient(dead_url(), timeout=5, max_retries=2, backoff=0.05) as client:
            t0 = time.monotonic()
            with pytest.raises(EngineError) as ei:
                await client.generate(PROMPT, GREEDY)
            return ei.value, time.monotonic() - t0, client.stats
    err, elapsed, stats = run(go())
    assert err.status is None and err.retryable and "after 3 attempt(s)" in str(err)
    assert elapsed < 5 and stats == {"requests": 1, "retries": 2, "failed": 1, "aborted": 0}


def test_retry_rotates_to_another_engine(engine):
    dead = dead_url()

    async def go():
        async with EngineClient([dead, engine], api_key=KEY, timeout=30, max_retries=2, backoff=0.05) as client:
            first = await client.generate(PROMPT, GREEDY)   # round robin starts on the dead engine
            later = [await client.generate(PROMPT, GREEDY) for _ in range(3)]  # the dead one is cooling down
            return first, later
    first, later = run(go())
    assert first["miles"]["attempts"] == 2 and first["miles"]["url"] == engine
    assert dead in first["miles"]["errors"][0]
    assert all(r["miles"]["attempts"] == 1 and r["miles"]["url"] == engine for r in later)


def test_abort_in_flight_request(engine):
    async def go():
        async with EngineClient(engine, api_key=KEY, timeout=60) as client:
            task = asyncio.create_task(client.generate(PROMPT, LONG, rid="to-abort"))
            async with EngineControl(engine, api_key=KEY, timeout=10) as ctl:  # abort once it is decoding
                for _ in range(10_000):
                    if (await ctl.get_load())["num_running_reqs"] or task.done():
                        break
                    await asyncio.sleep(0.002)
            accepted = await client.abort("to-abort")
            return accepted, await task
    accepted, resp = run(go())
    assert accepted and resp["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(resp["output_ids"]) < LONG["max_new_tokens"] and resp["miles"]["attempts"] == 1


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_abort_during_the_retry_backoff_returns_at_once_and_sends_nothing(engine):
    """A request whose first attempt failed sleeps before its retry (30 s here): an abort then wakes it; it
    answers as aborted (one answer, so the sample is neither lost nor generated twice) and never reaches
    the engine."""
    dead = dead_url()

    async def go():
        async with EngineClient([dead, engine], api_key=KEY, timeout=30, max_retries=2, backoff=30.0,
                                max_backoff=30.0) as client, EngineControl(engine, api_key=KEY) as ctl:
            tokens = (await ctl.get_load())["generated_tokens"]
            task = asyncio.create_task(client.generate(PROMPT, GREEDY, rid="in-backoff"))  # first try: the dead URL

            async def in_backoff():
                return client.stats["retries"] == 1
            await _until(in_backoff, "the first attempt to fail")
            t0 = time.monotonic()
            accepted = await client.abort("in-backoff")
            resp = await asyncio.wait_for(task, 5.0)
            woke = time.monotonic() - t0
            await asyncio.sleep(0.3)
            return accepted, resp, woke, (await ctl.get_load())["generated_tokens"] - tokens, dict(client.stats)
    accepted, resp, woke, generated, stats = run(go())
    assert accepted and woke < 1.0, woke
    assert resp["meta_info"]["finish_reason"]["type"] == "abort" and resp["output_ids"] == []
    assert resp["miles"]["attempts"] == 1 and resp["miles"]["aborted_by_client"] and dead in resp["miles"]["errors"][0]
    assert generated == 0  # no retry was sent after the abort
    assert stats == {"requests": 1, "retries": 1, "failed": 0, "aborted": 1}


def test_abort_of_a_request_waiting_for_a_slot_never_sends_it(engine):
    async def go():
        async with EngineClient(engine, api_key=KEY, timeout=60, concurrency=1) as client, \
                EngineControl(engine, api_key=KEY) as ctl:
            first = asyncio.create_task(client.generate(PROMPT, LONG, rid="holds-the-slot"))

            async def running():
                return (await ctl.get_load())["num_running_reqs"] >= 1
            await _until(running, "the first request to run")
            queued = asyncio.create_task(client.generate(PROMPT, GREEDY, rid="queued"))
            await asyncio.sleep(0.05)
            assert await client.abort("queued")
            await client.abort("holds-the-slot")
            return await asyncio.wait_for(first, 10.0), await asyncio.wait_for(queued, 10.0)
    first, queued = run(go())
    assert first["miles"]["attempts"] == 1  # (it may have finished before its own abort)
    assert queued["meta_info"]["finish_reason"]["type"] == "abort" and queued["output_ids"] == []
    assert queued["miles"]["attempt_rid"] is None  # it never went out


def test_abort_all_reaches_requests_in_flight_and_in_backoff(engine):
    """``abort_all`` (what a rollout's end or a weight update's pause does to every request): the one decoding
    on the engine and the one in its retry backoff both answer aborted, once each, without the backoff."""
    dead = dead_url()

    async def go():
        async with EngineClient([dead, engine], api_key=KEY, timeout=60, max_retries=2, backoff=30.0,
                                max_backoff=30.0, engine_urls=[engine]) as client, \
                EngineControl(engine, api_key=KEY) as ctl:
            backing_off = asyncio.create_task(client.generate(PROMPT, GREEDY, rid="backoff"))  # the dead URL first

            async def failed_once():
                return client.stats["retries"] == 1
            await _until(failed_once, "the first attempt to fail")
            decoding = asyncio.create_task(client.generate(PROMPT, LONG, rid="decoding"))  # the engine (rotation)

            async def running():
                return (await ctl.get_load())["num_running_reqs"] >= 1
            await _until(running, "the second request to run")
            t0 = time.monotonic()
            n = await client.abort_all()
            both = await asyncio.wait_for(asyncio.gather(backing_off, decoding), 5.0)
            return n, both, time.monotonic() - t0
    n, (backing_off, decoding), seconds = run(go())
    assert n == 2 and seconds < 2.0, seconds
    assert backing_off["meta_info"]["finish_reason"]["type"] == "abort" and backing_off["miles"]["aborted_by_client"]
    assert decoding["meta_info"]["finish_reason"]["type"] == "abort" and decoding["miles"]["url"] == engine
    assert 0 < len(decoding["output_ids"]) < LONG["max_new_tokens"] or decoding["output_ids"] == []


# --- control calls ------------------------------------------------------------------------------------
def test_control_calls(engine, tiny_model_dir):
    async def go():
        async with EngineControl(engine, api_key=KEY, timeout=60) as ctl, \
                EngineClient(engine, api_key=KEY, timeout=60) as client:
            assert await ctl.health() and await ctl.health_generate()
            info, server = await ctl.get_model_info(), await ctl.get_server_info()
            await ctl.update_weight_version(7)
            v7 = (await client.generate(PROMPT, GREEDY))["meta_info"]["weight_version"]
            await ctl.pause_generation("abort")
            await ctl.continue_generation()
            await ctl.flush_cache()
            w = await ctl.get_weights_by_name("model.embed_tokens.weight", truncate_size=4)
            await ctl.release_memory_occupation()
            await ctl.resume_memory_occupation()
            await ctl.update_weights_from_disk(str(tiny_model_dir), weight_version=8)
            v8 = (await client.generate(PROMPT, GREEDY))["meta_info"]["weight_version"]
            with pytest.raises(EngineError) as bad_disk:
                await ctl.update_weights_from_disk(str(tiny_model_dir / "missing"), weight_version=9)
            with pytest.raises(ValueError, match="mode"):
                await ctl.pause_generation("sideways")
            return info, server, v7, w, v8, bad_disk.value
    info, server, v7, w, v8, bad_disk = run(go())
    assert isinstance(info, dict) and isinstance(server, dict)
    assert v7 == "7" and v8 == "8" and w is not None
    assert bad_disk.status is not None and 400 <= bad_disk.status < 500 and "missing" in bad_disk.message


def test_sync_control_from_threads(engine):
    ctl = SyncEngineControl(engine, api_key=KEY, timeout=30)
    try:
        with ThreadPoolExecutor(4) as pool:
            healthy = list(pool.map(lambda _: ctl.health(), range(4)))
            infos = list(pool.map(lambda _: ctl.get_server_info(), range(2)))
        assert all(healthy) and all(isinstance(i, dict) for i in infos)
        assert threading.current_thread() is threading.main_thread()
    finally:
        ctl.close()


def test_wait_healthy_is_bounded():
    async def go():
        async with EngineControl(dead_url(), timeout=1) as ctl:
            t0 = time.monotonic()
            with pytest.raises(EngineError, match="timed out after 1s"):
                await ctl.wait_healthy(timeout=1.0, interval=0.1)
            with pytest.raises(EngineError, match="exited"):
                await ctl.wait_healthy(timeout=30.0, interval=0.1, alive=lambda: False)
            return time.monotonic() - t0
    assert run(go()) < 5



# --- weight sync round trips against the real engine ----------------------------------------------
class _RecordingControl(EngineControl):
    """The real control client, recording every endpoint it posts (with its query) in ``log``."""

    def __init__(self, url: str, log: list[str], **kw) -> None:
        super().__init__(url, **kw)
        self.log = log

    async def _request(self, method, url, endpoint, *args, **kwargs):
        params = kwargs.get("params") or (args[2] if len(args) > 2 else None)
        self.log.append(endpoint + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else ""))
        return await super()._request(method, url, endpoint, *args, **kwargs)


class _Weights:
    """A trainer stand-in: the tiny model's HF tensors (plus ``delta``), packed greedily into buckets."""

    def __init__(self, model_dir, delta: float) -> None:
        from safetensors.torch import load_file

        self.tensors = {k: (v + delta if v.is_floating_point() else v) for k, v in load_file(str(model_dir / "model.safetensors")).items()}

    def iter_weight_buckets(self, bucket_bytes, dtype=None):
        bucket, size = [], 0
        for name, t in self.tensors.items():
            if bucket and size + t.numel() * t.element_size() > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket


@pytest.mark.parametrize("mode", ["broadcast", "tensor"])
@pytest.mark.parametrize("buffer", ["64MiB", "16KiB"])
def test_weight_sync_round_trips(engine, tiny_model_dir, mode: str, buffer: str):
    """A one-bucket sync to the embedded engine is ONE request (pause + load + version + flush + continue);
    a many-bucket one is the full choreography without /update_weight_version (the loads carry the version).
    Either way the engine ends with the trainer's weights, the new version, and generating."""
    from miles.config import parse_args
    from miles.weight_sync.base import EngineTarget, build_weight_sender

    cfg = parse_args(["--hf-checkpoint", "x", "--update-weight-buffer-size", buffer, "--update-weight-timeout", "60",
                      "--check-weight-update-equal"], validate=False).weights
    log: list[str] = []
    sender = build_weight_sender(cfg, _Weights(tiny_model_dir, 0.0), colocate=mode == "tensor", is_source=True,
                                 engines=[EngineTarget(engine, api_key=KEY)],
                                 **({"master_addr": "127.0.0.1"} if mode == "broadcast" else {}),
                                 control_factory=lambda e, timeout: _RecordingControl(e.url, log, api_key=KEY, timeout=timeout))
    try:
        sender.connect()
        for delta in (0.25, 0.0):  # the second sync puts the checkpoint's weights back for the other tests
            sender.source = _Weights(tiny_model_dir, delta)
            log.clear()
            result = sender.sync()  # --check-weight-update-equal: the engine equals the trainer, bitwise
            update = "/update_weights_from_distributed" if mode == "broadcast" else "/update_weights_from_tensor"
            calls = [c for c in log if c not in ("/get_server_info", "/get_weights_by_name")]
            if buffer == "64MiB":
                assert result.num_buckets == 1 and calls == [f"{update}?miles_whole_sync=retract"], log
            else:
                assert result.num_buckets > 1
                # broadcast buckets carry their place in the sync: the engine takes them in that order
                loads = [update] * result.num_buckets if mode == "tensor" else sorted(
                    (c for c in calls if c.startswith(update)), key=lambda c: int(c.rsplit("=", 1)[1]))
                assert calls[:2] == ["/pause_generation", "/begin_weight_update"], log
                assert sorted(calls[2:-3]) == sorted(loads), log
                assert calls[-3:] == ["/end_weight_update", "/flush_cache", "/continue_generation"], log
                if mode == "broadcast":
                    assert [int(c.rsplit("=", 1)[1]) for c in loads] == list(range(result.num_buckets)), loads
                    assert len({c.split("miles_sync=")[1].split("&")[0] for c in loads}) == 1, loads

        async def after():
            async with EngineClient(engine, api_key=KEY, timeout=60) as client, \
                    EngineControl(engine, api_key=KEY, timeout=60) as ctl:
                return (await client.generate(PROMPT, GREEDY))["meta_info"]["weight_version"], await ctl.health_generate()
        version, healthy = run(after())
        assert version == str(sender.weight_version) == "2" and healthy
    finally:
        sender.close()


def test_whole_sync_request_refuses_a_bad_mode_and_a_failed_load_leaves_the_engine_paused(engine):
    """A failed one-request sync leaves the engine paused (as a failed choreography does) for the caller to
    resync or replace; a mode that is not a pause mode is a 400 naming the parameter, before anything pauses."""
    from miles.fleet.client import whole_sync_params

    async def go():
        async with EngineControl(engine, api_key=KEY, timeout=60) as ctl:
            with pytest.raises(EngineError, match=r"miles_whole_sync must be a pause mode.*'sideways'") as bad_mode:
                await ctl._post("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]},
                                params=whole_sync_params("sideways"))
            still_generating = await ctl.health_generate()
            with pytest.raises(EngineError, match="update_weights_from_tensor failed") as bad_load:
                await ctl.update_weights_from_tensor(["bm90IGEgcGF5bG9hZA=="], load_format="flattened_bucket",
                                                     weight_version="99", whole_sync="retract")
            paused = not await ctl.health_generate()
            await ctl.continue_generation()
            return bad_mode.value, still_generating, bad_load.value, paused, await ctl.health_generate()
    bad_mode, still_generating, bad_load, paused, healthy = run(go())
    assert bad_mode.status == 400 and still_generating
    assert bad_load.status == 400 and paused and healthy
