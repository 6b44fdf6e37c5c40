"""Two real embedded engines behind the real sglang-router (PyPI sglang-router 0.3.2).

Covers: adding/removing workers through the router's /workers API, /generate served by both engines,
an API key enforced from client to router to engine, and a SIGKILLed engine whose in-flight requests
finish on the other engine while the controller removes it from the router.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

import pytest

from miles.config import rollout as rollout_flags
from miles.config.base import ConfigError, section_from_namespace
from miles.config.rollout import RolloutConfig
from miles.fleet.client import EngineClient, EngineControl, EngineError
from miles.fleet.engines import build_engine_argv, engine_url
from miles.fleet.router import (
    RouterClient,
    RouterError,
    RouterProcess,
    connect_or_start_router,
    remove_dead_workers,
)
from miles.rollout import generate as gen
from miles.spmd.supervisor import EngineSupervisor
from miles.types import Sample
from miles.utils.net import find_free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

KEY = "router-test-key"
PROMPT = [3, 4, 5, 6]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
TOKENS_32 = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
LONG = {"temperature": 1.0, "max_new_tokens": 500, "ignore_eos": True}  # prompt + 500 fits max_context_len 512


def run(coro, timeout: float = 150.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def rollout_cfg(*argv: str) -> RolloutConfig:
    p = argparse.ArgumentParser()
    rollout_flags.add_arguments(p)
    return section_from_namespace(RolloutConfig, p.parse_args(list(argv)))


class Engine:
    def __init__(self, model_dir, log_path, name):
        port = find_free_port()
        self.url = engine_url("127.0.0.1", port)
        argv = build_engine_argv("embedded", hf_checkpoint=str(model_dir), host="127.0.0.1", port=port, api_key=KEY,
                                 device="cpu", max_running_requests=8, max_context_len=512)
        self.sup = EngineSupervisor(argv, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, name=name,
                                    log_path=log_path, max_restarts=0).start()

    async def wait(self, timeout=180.0):
        async with EngineControl(self.url) as ctl:
            try:
                await ctl.wait_healthy(timeout, alive=lambda: self.sup.alive)
            except EngineError as e:
                raise AssertionError(f"{e}\n{self.sup.log_path.read_text(errors='replace')[-3000:]}") from e


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    engines = [Engine(tiny_model_dir, logs / f"engine{i}.log", f"engine{i}") for i in range(2)]
    router = None
    try:
        router = RouterProcess.start("127.0.0.1", None, "round_robin", timeout=60, api_key=KEY,
                                     health_check_interval_secs=1, health_failure_threshold=1, retry_max_retries=1,
                                     log_path=logs / "router.log")

        async def up():
            await asyncio.gather(*(e.wait() for e in engines))
            async with RouterClient(router.url, api_key=KEY, timeout=60) as rc:
                await rc.wait_ready(30)
                for e in engines:
                    await rc.add_worker(e.url)
        run(up())
        yield router, engines
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.sup.stop()


def test_both_engines_serve_generate_through_the_router(cluster):
    router, (a, b) = cluster

    async def go():
        async with RouterClient(router.url, api_key=KEY) as rc, \
                EngineClient(router.url, api_key=KEY, timeout=60, max_retries=2, concurrency=8) as client:
            workers = await rc.list_workers()
            both = await asyncio.gather(*(client.generate(PROMPT, GREEDY) for _ in range(8)))
            # each engine alone serves the same greedy tokens (same weights): take one out, then the other
            await rc.remove_worker(a.url)
            only_b = await client.generate(PROMPT, GREEDY)
            assert await rc.add_worker(a.url) and await rc.remove_worker(b.url)
            only_a = await client.generate(PROMPT, GREEDY)
            await rc.add_worker(b.url)
            await rc.wait_healthy(b.url, timeout=30)
            return workers, both, only_a, only_b, await rc.list_workers()
    workers, both, only_a, only_b, after = run(go())
    assert sorted(w["url"] for w in workers) == sorted([a.url, b.url]) and all(w["is_healthy"] for w in workers)
    assert {tuple(r["output_ids"]) for r in both} == {tuple(only_a["output_ids"])} == {tuple(only_b["output_ids"])}
    assert all(r["miles"]["url"] == router.url and r["miles"]["attempts"] == 1 for r in both)
    assert sorted(w["url"] for w in after) == sorted([a.url, b.url])


def test_api_key_enforced_end_to_end(cluster):
    router, (a, _) = cluster

    async def go():
        async with EngineClient(router.url, timeout=30, max_retries=2) as anon:
            with pytest.raises(EngineError) as no_key:
                await anon.generate(PROMPT, GREEDY)
        async with RouterClient(router.url) as anon_rc:
            with pytest.raises(RouterError) as no_key_workers:
                await anon_rc.list_workers()
        async with EngineClient(a.url, timeout=30, max_retries=0) as direct:
            with pytest.raises(EngineError) as engine_no_key:
                await direct.generate(PROMPT, GREEDY)
        async with EngineClient(router.url, api_key=KEY, timeout=30) as client:
            ok = await client.generate(PROMPT, GREEDY)
        return no_key.value, no_key_workers.value, engine_no_key.value, ok
    no_key, no_key_workers, engine_no_key, ok = run(go())
    assert no_key.status == 401 and "--sglang-api-key" in str(no_key)
    assert no_key_workers.status == 401 and engine_no_key.status == 401
    assert len(ok["output_ids"]) == 8


def test_manual_policy_serves_each_routing_key_on_one_engine(cluster, tmp_path):
    """``--sglang-router-policy manual`` (with ``--router-assignment-mode min_group``): a sample's ``routing_key``,
    sent by the default generate as ``X-SMG-Routing-Key``, keeps its requests on one engine. Which engine served is read from each engine's own ``/get_load`` token counter (the routers' health probes
    add a token each: each request makes 32, so an engine that served none of a key's requests has fewer than 32)."""
    _, (a, b) = cluster
    router = RouterProcess.start("127.0.0.1", None, "manual", timeout=60, api_key=KEY, log_path=tmp_path / "router.log",
                                 router_args={"assignment_mode": "min_group"})

    async def generated(ctls):
        return [(await c.get_load())["generated_tokens"] for c in ctls]

    async def go():
        per_key = {}
        async with RouterClient(router.url, api_key=KEY, timeout=60) as rc, \
                EngineClient(router.url, api_key=KEY, timeout=60, max_retries=0) as client, \
                EngineControl(a.url, KEY) as ca, EngineControl(b.url, KEY) as cb:
            await rc.wait_ready(30)
            for e in (a, b):
                await rc.add_worker(e.url)
                await rc.wait_healthy(e.url, timeout=30)
            for key in ("trace-1", "trace-2", "trace-3", "trace-4"):
                before = await generated((ca, cb))
                for _ in range(3):
                    s = await gen.generate(client, Sample(tokens=list(PROMPT), routing_key=key), TOKENS_32)
                    assert s.response_length == 32
                after = await generated((ca, cb))
                per_key[key] = [x - y for x, y in zip(after, before)]
        return per_key
    try:
        per_key = run(go())
    finally:
        router.stop()
    # each key: one engine only. Which engine a new key goes to is the router's choice: min_group spread the keys
    # over both engines in one run and put all four on one engine in another (the CI pre-check of 2026-12-07), so
    # the spread is not asserted
    assert all(min(d) < 32 and max(d) >= 3 * 32 for d in per_key.values()), per_key


def test_add_worker_that_never_gets_healthy_fails_clearly(cluster):
    router, _ = cluster
    ghost = engine_url("127.0.0.1", find_free_port())

    async def go():
        async with RouterClient(router.url, api_key=KEY) as rc:
            t0 = time.monotonic()
            with pytest.raises(RouterError, match="not added within 3s") as ei:
                await rc.add_worker(ghost, timeout=3)
            return ei.value, time.monotonic() - t0, await rc.find_worker(ghost), await rc.remove_worker(ghost)
    err, elapsed, listed, removed = run(go())
    assert elapsed < 15 and listed is None and removed is False and ghost in str(err)


def test_router_process_and_connect_errors(cluster):
    router, _ = cluster
    with pytest.raises(ConfigError, match="--sglang-router-policy 'fastest'"):
        RouterProcess.start("127.0.0.1", None, "fastest")
    with pytest.raises(ConfigError, match="go together"):
        connect_or_start_router(rollout_cfg("--sglang-router-ip", "127.0.0.1"), host="127.0.0.1")
    with pytest.raises(ConfigError, match="no router answers"):
        connect_or_start_router(rollout_cfg("--sglang-router-ip", "127.0.0.1", "--sglang-router-port",
                                            str(find_free_port())), host="127.0.0.1", startup_timeout=2)
    port = router.url.rsplit(":", 1)[1]
    url, proc = connect_or_start_router(rollout_cfg("--sglang-router-ip", "127.0.0.1", "--sglang-router-port", port),
                                        host="127.0.0.1")
    assert url == router.url and proc is None
    with pytest.raises(RouterError, match="exited with code"):
        RouterProcess.start("127.0.0.1", None, "round_robin", ["--no-such-router-flag"], timeout=30)


def test_started_router_stops_cleanly(tmp_path):
    url, proc = connect_or_start_router(rollout_cfg("--sglang-router-policy", "cache_aware"), host="127.0.0.1",
                                        log_path=tmp_path / "r.log")
    assert proc is not None and proc.alive() and url == proc.url
    assert "--policy cache_aware" in " ".join(proc.argv) and "--request-timeout-secs 14400" in " ".join(proc.argv)
    t0 = time.monotonic()
    proc.stop()
    assert not proc.alive() and time.monotonic() - t0 < 15


def test_started_router_takes_the_users_router_flags(tmp_path):
    """Miles's --router-* flags (scripts/run_glm45_355b_a32b.py: --router-health-success-threshold) reach the real
    router, over miles's own settings, and it comes up."""
    from miles.config import parse_args

    cfg = parse_args(["--num-rollout", "1", "--rollout-batch-size", "1", "--router-health-success-threshold", "2",
                      "--router-health-check-interval-secs", "7", "--router-policy", "round_robin",
                      "--router-queue-size", "17", "--router-disable-circuit-breaker"])
    url, proc = connect_or_start_router(cfg.rollout, host="127.0.0.1", log_path=tmp_path / "r.log")
    try:
        text = " ".join(proc.argv)
        assert proc.alive() and url == proc.url
        for tokens in ("--health-success-threshold 2", "--health-check-interval-secs 7", "--policy round_robin",
                       "--queue-size 17", "--disable-circuit-breaker"):
            assert tokens in text
        assert "--health-check-interval-secs 5" not in text

        async def workers():
            async with RouterClient(url) as rc:
                await rc.wait_ready(30)
                return await rc.list_workers()
        assert run(workers()) == []
    finally:
        proc.stop()
    assert not proc.alive()


async def _wait_running(url: str, deadline: float) -> int:
    """Poll an engine's /get_load until it is decoding at least one request; returns that count (0 on timeout)."""
    async with EngineControl(url, api_key=KEY, timeout=5) as ctl:
        while time.monotonic() < deadline:
            n = (await ctl.get_load())["num_running_reqs"]
            if n > 0:
                return n
            await asyncio.sleep(0.005)
    return 0


def test_killed_engine_is_removed_and_its_requests_finish_elsewhere(cluster):
    """Must run last in this module: it kills engine A."""
    router, (a, b) = cluster

    async def controller(rc: RouterClient, stop: asyncio.Event, removed: list[str]):
        while not stop.is_set():
            removed += await remove_dead_workers(rc, probe_timeout=1.0, attempts=2, interval=0.2)
            await asyncio.sleep(0.3)

    async def go():
        removed: list[str] = []
        stop = asyncio.Event()
        async with RouterClient(router.url, api_key=KEY) as rc, \
                EngineClient(router.url, api_key=KEY, timeout=60, max_retries=4, concurrency=16) as client:
            ctl = asyncio.create_task(controller(rc, stop, removed))
            reqs = [asyncio.create_task(client.generate(PROMPT, LONG)) for _ in range(8)]
            # round robin sends about half of them to A: kill A as soon as it is decoding some of them
            # (a fixed sleep raced the engine on a fast machine: 500 tiny-model steps can take < 0.5 s)
            running_on_a = await _wait_running(a.url, deadline=time.monotonic() + 20)
            a.sup.kill(signal.SIGKILL)
            assert running_on_a > 0, "engine A never ran a request"
            results = await asyncio.gather(*reqs)
            deadline = time.monotonic() + 30
            while a.url not in removed and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            stop.set()
            await ctl
            after = [await client.generate(PROMPT, GREEDY) for _ in range(4)]
            return results, removed, await rc.list_workers(), after
    results, removed, workers, after = run(go())
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    assert all(len(r["output_ids"]) == LONG["max_new_tokens"] for r in results)
    assert removed == [a.url] and [w["url"] for w in workers] == [b.url]
    assert all(r["miles"]["attempts"] == 1 for r in after)
    assert sum(r["miles"]["attempts"] - 1 for r in results) >= 1  # A's requests were retried by the client


def test_fleet_prunes_a_hung_engine_and_deregisters_from_an_external_router(cluster):
    """Runs after the kill test (engine A is gone): the run's Fleet on a router it did not start."""
    from miles.run.fleet import Fleet

    router, (_a, b) = cluster

    async def go():
        client = EngineClient(router.url, api_key=KEY, timeout=30, max_retries=0, concurrency=4)
        fleet = Fleet(urls=[b.url], targets=[], client=client, router_url=router.url, router=None, api_key=KEY)
        async with RouterClient(router.url, api_key=KEY) as rc:
            for w in await rc.list_workers():  # start from B alone, whatever the kill test left behind
                if w["url"] != b.url:
                    await rc.remove_worker(w["url"])
            assert await fleet.prune_dead(probe_timeout=1.0) == []  # healthy: kept
            b.sup.kill(signal.SIGSTOP)
            try:
                assert await fleet.prune_dead(probe_timeout=1.0) == [b.url]  # hung: removed
                assert [w["url"] for w in await rc.list_workers()] == []
            finally:
                b.sup.kill(signal.SIGCONT)
            await rc.add_worker(b.url)
            await fleet.close()  # the router outlives the run: our engines are deregistered
            return await rc.list_workers()

    assert run(go()) == []
