"""Miles's ``Sample.routing_key`` (radixark/miles@v0.1.0:miles/utils/types.py; its verifiers example sets it): every
/generate of a sample with a key carries sglang-router's ``X-SMG-Routing-Key`` header (the router's ``manual`` policy
sends one key's requests to one engine; tests/multiprocess/test_router.py checks that with the real router); given
engine URLs directly, the client sends one key's requests to one engine itself. Under ``--sglang-router-policy
manual`` the rollout gives each sample a fresh key (Miles's generate_and_rm_group), one request per sample, and
Miles's ``sglang_rollout.generate`` refuses a sample without one; ``consistent_hashing``, which sglang-router 0.3.2
lacks, is refused by name. The key stays on the rollout side (the sample wire does not carry it).

The HTTP tests run real aiohttp servers in this process that record what arrives (headers, which server)."""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import pytest
from aiohttp import web

from miles.config import ConfigError, parse_args
from miles.config.router import validate_router
from miles.fleet.client import ROUTING_KEY_HEADER, EngineClient
from miles.rollout import generate as gen
from miles.rollout import sglang_rollout
from miles.rollout.data import DataSource, PromptDataset
from miles.rollout.manager import RolloutManager
from miles.run.wire import decode_samples, encode_samples
from miles.types import Sample, SampleError, SampleStatus
from miles.utils.model_dir import load_tokenizer


class Recorder:
    """``n`` real HTTP servers answering /generate in SGLang's shape (two tokens); ``seen`` holds (server, routing
    key header or None) per request. ``failing`` servers answer 503."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.failing, self.urls, self.flushes = n, [], set(), [], []
        self._runners: list[web.AppRunner] = []

    def _app(self, i: int) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.seen.append((i, request.headers.get(ROUTING_KEY_HEADER)))
            if i in self.failing:
                return web.json_response({"error": "down"}, status=503)
            if body["sampling_params"].get("max_new_tokens") == 0:   # a prefill: each input token's log-prob
                return web.json_response({"text": "", "meta_info": {"finish_reason": {"type": "length"},
                                          "input_token_logprobs": [[-0.125, t, None] for t in body["input_ids"]]}})
            return web.json_response({"text": "ab", "meta_info": {
                "id": body.get("rid"), "finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}})

        async def flush_cache(request: web.Request) -> web.Response:
            self.flushes.append(request.headers.get(ROUTING_KEY_HEADER))
            return web.Response(text="Cache flushed.\n")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/flush_cache", flush_cache)
        return app

    async def __aenter__(self) -> Recorder:
        for i in range(self.n):
            runner = web.AppRunner(self._app(i))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.urls.append(f"http://127.0.0.1:{port}")
            self._runners.append(runner)
        return self

    async def __aexit__(self, *exc) -> None:
        for runner in self._runners:
            await runner.cleanup()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_the_key_travels_as_the_header_of_every_request_and_attempt():
    async def go():
        async with Recorder(1) as rec, EngineClient(rec.urls[0], timeout=10, max_retries=0) as client:
            await client.generate([1, 2], {"max_new_tokens": 2}, routing_key="trace-1")
            await client.generate([1, 2], {"max_new_tokens": 2})
            await client.generate_group([1, 2], {"max_new_tokens": 2}, 1, routing_key="group-key")
            # the default generate, Miles's sglang_rollout.generate and MultiTurn: the sample's key
            await gen.generate(client, Sample(tokens=[1, 2], routing_key="s-1"), {"max_new_tokens": 2})
            await sglang_rollout.generate(SimpleNamespace(client=client), Sample(tokens=[1, 2], routing_key="s-2"),
                                          {"max_new_tokens": 2})
            turn = gen.MultiTurn(Sample(tokens=[1, 2], routing_key="s-3"), SimpleNamespace(decode=lambda ids, **kw: "t"),
                                 {"max_new_tokens": 8})
            await turn.generate_turn(client)
            await turn.generate_turn(client)
            await gen.generate(client, Sample(tokens=[1, 2]), {"max_new_tokens": 2})
            return rec.seen
    assert [key for _, key in run(go())] == ["trace-1", None, "group-key", "s-1", "s-2", "s-3", "s-3", None]


def test_prefill_rescoring_sends_each_samples_key_as_miles(monkeypatch):
    """Miles's recompute_samples_rollout_logprobs_via_prefill: the flush and the prefill of a sample go to its engine
    (its key's header); under a routing-key policy a sample without a key is refused."""
    from miles.rollout.generate_utils.prefill_logprobs import recompute_samples_rollout_logprobs_via_prefill

    def sample(key):
        return Sample(tokens=[1, 2, 7, 8], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.25],
                      status=SampleStatus.COMPLETED, routing_key=key)

    async def go(policy, samples):
        async with Recorder(1) as rec:
            args = SimpleNamespace(recompute_logprobs_via_prefill=True, sglang_router_policy=policy)
            await recompute_samples_rollout_logprobs_via_prefill(args, samples, url=rec.urls[0] + "/generate",
                                                                 sampling_params={})
            return rec.seen, rec.flushes
    samples = [sample("a"), sample(None)]
    seen, flushes = run(go(None, samples))
    assert [k for _, k in seen] == flushes == ["a", None]
    assert all(s.rollout_log_probs == [-0.125, -0.125] for s in samples)
    with pytest.raises(SampleError, match=r"router policy manual routes by X-SMG-Routing-Key, but sample"):
        run(go("manual", [sample(None)]))


def test_a_key_that_cannot_be_a_header_is_refused_before_sending():
    async def go():
        async with Recorder(1) as rec, EngineClient(rec.urls[0], timeout=10, max_retries=0) as client:
            for bad in ("a\nb", "", "ключ"):
                with pytest.raises(ValueError, match="routing_key .* must be a non-empty printable ASCII string"):
                    await client.generate([1, 2], {"max_new_tokens": 2}, routing_key=bad)
            return rec.seen
    assert run(go()) == []


def test_engine_urls_given_directly_serve_one_key_on_one_engine():
    """Without a router (several engine URLs, as the R3 path uses) the client keeps a key on one engine; different
    keys spread over the engines; while a key's engine fails its requests go to another."""
    keys = [f"key-{i}" for i in range(11)]   # not a multiple of 3: round robin would spread each key

    async def go():
        async with Recorder(3) as rec, EngineClient(rec.urls, timeout=10, max_retries=2, backoff=0.01,
                                                    cooldown=60) as client:
            for _ in range(3):
                for key in keys:
                    await client.generate([1, 2], {"max_new_tokens": 2}, routing_key=key)
            by_key: dict[str, set[int]] = {}
            for server, key in rec.seen:
                by_key.setdefault(key, set()).add(server)
            down = next(iter(by_key[keys[0]]))
            rec.failing.add(down)
            rec.seen.clear()
            resp = await client.generate([1, 2], {"max_new_tokens": 2}, routing_key=keys[0])
            return by_key, down, list(rec.seen), resp
    by_key, down, after, resp = run(go())
    assert all(len(servers) == 1 for servers in by_key.values())       # 3 requests of a key: one engine
    assert len(set().union(*by_key.values())) == 3                      # 11 keys use all 3 engines
    assert after[0] == (down, keys[0]) and after[1][0] != down and resp["miles"]["attempts"] == 2


def test_the_wire_does_not_carry_the_key():
    s = Sample(tokens=[1, 2, 3], response_length=1, response="c", loss_mask=[1], rollout_log_probs=[-0.1],
               status=SampleStatus.COMPLETED, routing_key="trace-1")
    (back,) = decode_samples(encode_samples([s]))
    assert back.tokens == [1, 2, 3] and back.routing_key is None


def test_a_routing_key_policy_needs_the_samples_key_in_sglang_rollout_generate():
    class Client:
        asked: list = []

        async def generate(self, input_ids, sampling_params, return_logprob=True, extra=None, **kw):
            self.asked.append(kw)
            return {"text": "a", "meta_info": {"finish_reason": {"type": "stop"},
                                               "output_token_logprobs": [[-0.5, 7, None]]}}

    args = SimpleNamespace(client=Client(), sglang_router_policy="manual")
    with pytest.raises(SampleError, match=r"router policy manual routes by X-SMG-Routing-Key, but sample \(index=4\) "
                                          r"has no routing_key set") as e:
        asyncio.run(sglang_rollout.generate(args, Sample(index=4, tokens=[1, 2]), {"max_new_tokens": 2}))
    assert "\n" not in str(e.value) and Client.asked == []
    asyncio.run(sglang_rollout.generate(args, Sample(tokens=[1, 2], routing_key="k"), {"max_new_tokens": 2}))
    assert Client.asked == [{"routing_key": "k"}]
    assert gen.routing_headers(SimpleNamespace(sglang_router_policy=None), Sample(routing_key="k")) == {
        ROUTING_KEY_HEADER: "k"}
    assert gen.routing_headers(SimpleNamespace(sglang_router_policy="cache_aware"), Sample()) is None


def test_router_policies_sglang_router_lacks_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"--sglang-router-policy consistent_hashing: sglang-router 0\.3\.2, which "
                                          r"miles starts, has no such policy \(Miles's hashing routing-key policy") as e:
        parse_args(["--sglang-router-policy", "consistent_hashing"])
    assert "\n" not in str(e.value) and "manual" in str(e.value)
    with pytest.raises(ConfigError, match=r"--sglang-router-policy roundrobin: .* pass one of random, round_robin, "
                                          r"cache_aware, power_of_two, manual"):
        parse_args(["--sglang-router-policy", "roundrobin"])
    for policy in ("manual", "round_robin"):
        validate_router(parse_args(["--sglang-router-policy", policy], validate=False).rollout)
    running = parse_args(["--sglang-router-policy", "consistent_hashing", "--sglang-router-ip", "10.0.0.1",
                          "--sglang-router-port", "30000"], validate=False)
    validate_router(running.rollout)   # a router miles does not start may have it


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("rk") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(4)))
    return path, load_tokenizer(str(tiny_model_dir), "--hf-checkpoint")


class Engine:
    """/generate stand-in for the manager: records each request's routing key (per-sample and group requests)."""

    def __init__(self) -> None:
        self.keys, self.groups = [], 0

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, extra=None, routing_key=None,
                       **kw):
        self.keys.append(routing_key)
        return {"text": "1", "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None]]}}

    async def generate_group(self, input_ids, sampling_params, n, **kw):
        self.groups += 1
        return [await self.generate(input_ids, sampling_params) for _ in range(n)]

    async def abort(self, rid):
        return None


PLUGIN = """
async def generate(args, sample, sampling_params):   # a plugin calling the run's client itself
    from miles.rollout.generate import append_output
    append_output(sample, await args.client.generate(list(sample.tokens), sampling_params))
    return sample
"""


@pytest.mark.parametrize("policy, generate", [
    (None, None), (["--sglang-router-policy", "manual"], None), (["--router-policy", "manual"], None),
    (["--sglang-router-policy", "manual"], "miles.rollout.sglang_rollout.generate"),
    (["--sglang-router-policy", "manual"], "rk_plugin.generate")])
def test_a_routing_key_policy_gives_each_sample_its_own_key_and_request(prompts, policy, generate, tmp_path,
                                                                        monkeypatch):
    path, tok = prompts
    (tmp_path / "rk_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse_args(["--prompt-data", str(path), "--label-key", "label", "--rm-type", "exact_match",
                      "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--rollout-max-response-len", "4",
                      "--num-rollout", "1", *(policy or []),
                      *(["--custom-generate-function-path", generate] if generate else [])])
    engine = Engine()
    manager = RolloutManager(cfg.rollout, cfg.data, cfg.reward, engine, tok,
                             DataSource(PromptDataset(path, tok, cfg.data), shuffle=False), group_requests=True)
    try:
        result = asyncio.run(manager.generate_rollout(0))
    finally:
        asyncio.run(manager.aclose())
    samples = [s for group in result.samples for s in group]
    assert len(samples) == 6 and all(s.status is SampleStatus.COMPLETED for s in samples)
    if generate:         # a custom generate function: one request per sample anyway
        assert engine.groups == 0
    if policy is None:   # no key, and each group in one request
        assert engine.groups == 2 and all(s.routing_key is None for s in samples) and set(engine.keys) == {None}
    else:                # a fresh uuid per sample, each sample its own request carrying it
        keys = [s.routing_key for s in samples]
        assert engine.groups == 0 and len(set(keys)) == 6 and all(uuid.UUID(k) for k in keys)
        assert sorted(engine.keys) == sorted(keys)
