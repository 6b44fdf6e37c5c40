"""One ``/generate`` per group (``sampling_params.n``) through the real sglang-router to a real embedded engine.

The manager's ``group_requests`` path must give exactly the samples of the per-sample path (same seeds,
same ids, same log-probs), send one request per group, and still regenerate alone a sample the engine aborted.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from miles.config import parse_args
from miles.fleet.client import EngineClient, EngineControl, EngineError
from miles.fleet.engines import build_engine_argv, engine_url
from miles.fleet.router import RouterClient, RouterProcess
from miles.rollout.data import DataSource, PromptDataset
from miles.rollout.manager import RolloutManager
from miles.spmd.supervisor import EngineSupervisor
from miles.types import SampleStatus
from miles.utils.net import find_free_port

pytestmark = pytest.mark.multiprocess


def run(coro, timeout: float = 240.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


_SUPERVISORS: dict = {}


def routed_supervisor(url):
    return _SUPERVISORS[url]


@pytest.fixture(scope="module")
def routed(tiny_model_dir, tmp_path_factory):
    """(router URL, engine URL): one embedded engine (4 running requests, so a group's samples queue) behind
    the real sglang-router."""
    logs = tmp_path_factory.mktemp("group_requests")
    port = find_free_port()
    url = engine_url("127.0.0.1", port)
    argv = build_engine_argv("embedded", hf_checkpoint=str(tiny_model_dir), host="127.0.0.1", port=port, device="cpu",
                             max_running_requests=4, max_context_len=512)
    sup = EngineSupervisor(argv, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, name="engine0",
                           log_path=logs / "engine0.log", max_restarts=0).start()
    router = None
    try:
        router = RouterProcess.start("127.0.0.1", None, "round_robin", timeout=60, log_path=logs / "router.log")

        async def up():
            async with EngineControl(url) as ctl:
                await ctl.wait_healthy(180, alive=lambda: sup.alive)
            async with RouterClient(router.url, timeout=60) as rc:
                await rc.wait_ready(30)
                await rc.add_worker(url)
        run(up())
        _SUPERVISORS[url] = sup
        yield router.url, url
    finally:
        if router is not None:
            router.stop()
        sup.stop()


@pytest.fixture
def setup(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    rows = [{"input": f"{i}+{i + 1}=", "label": str(2 * i + 1)} for i in range(6)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_args(["--prompt-data", str(data), "--label-key", "label", "--num-rollout", "2", "--rm-type", "exact_match",
                      "--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "12",
                      "--rollout-temperature", "1.0", "--rollout-seed", "7"])
    return cfg, AutoTokenizer.from_pretrained(str(tiny_model_dir))


def manager(cfg, tok, client, group_requests, progress=None):
    source = DataSource(PromptDataset(cfg.data.prompt_data, tok, cfg.data, 1), shuffle=False, seed=1)
    return RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, tok, source, eval_cfg=cfg.eval,
                          group_requests=group_requests, progress=progress)


def test_group_requests_give_the_per_sample_samples_in_one_request_per_group(routed, setup):
    router_url, _ = routed
    cfg, tok = setup

    async def one(group_requests):
        async with EngineClient(router_url, timeout=60) as client:
            res = await manager(cfg, tok, client, group_requests).generate_rollout(3)
            return res, client.stats["requests"]

    (per_sample, n_per), (grouped, n_grouped) = run(one(False)), run(one(True))
    assert (n_per, n_grouped) == (12, 3), "one request per sample vs one per group"
    a = [s for g in per_sample.samples for s in g]
    b = [s for g in grouped.samples for s in g]
    assert [s.index for s in b] == [s.index for s in a] == list(range(12))
    assert [s.tokens for s in b] == [s.tokens for s in a], "the same seeds -> the same samples"
    assert len({tuple(s.tokens) for s in b[:4]}) > 1, "a group's samples are distinct"
    assert [s.status for s in b] == [s.status for s in a]
    assert [s.reward for s in b] == [s.reward for s in a]
    assert [s.loss_mask for s in b] == [s.loss_mask for s in a]
    for x, y in zip(a, b):
        assert y.rollout_log_probs == pytest.approx(x.rollout_log_probs, abs=1e-6)     # measured 4.8e-7
        assert y.weight_version == x.weight_version and y.response == x.response
    assert grouped.metrics["rollout/generate_failures"] == 0 and grouped.metrics["rollout/num_samples"] == 12


def test_group_request_samples_aborted_by_the_engine_are_generated_again_alone(routed, setup):
    router_url, engine = routed
    cfg, tok = setup
    fired = []

    async def main():
        async with EngineClient(router_url, timeout=60) as client, EngineControl(engine) as ctl:
            def progress(done, total):
                if not fired:  # 12 samples, 4 running: the other groups are still queued or running
                    fired.append(asyncio.ensure_future(ctl.abort_all()))
            res = await manager(cfg, tok, client, True, progress).generate_rollout(0)
            await fired[0]
            return res, client.stats["requests"]

    res, requests = run(main())
    flat = [s for g in res.samples for s in g]
    retried = res.metrics["rollout/engine_abort_retries"]
    assert retried >= 1 and requests == 3 + retried, "aborted samples come back one request each"
    assert sorted(s.index for s in flat) == list(range(12))
    assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in flat)


def test_generate_group_through_the_router_names_and_seeds_each_sample(routed):
    router_url, _ = routed
    sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}

    async def main():
        async with EngineClient(router_url, timeout=60) as client:
            group = await client.generate_group([3, 4, 5], {**sp, "sampling_seed": 40}, 3, rid="grp")
            alone = [await client.generate([3, 4, 5], {**sp, "sampling_seed": 40 + j}) for j in range(3)]
            with pytest.raises(ValueError, match="give the sample count as n="):
                await client.generate_group([3, 4, 5], {**sp, "n": 2}, 2)
            return group, alone

    group, alone = run(main())
    assert [r["meta_info"]["id"] for r in group] == ["grp_0", "grp_1", "grp_2"]
    assert [r["output_ids"] for r in group] == [r["output_ids"] for r in alone]
    assert all(r["miles"]["rid"] == "grp" and r["miles"]["attempts"] == 1 for r in group)


def test_fleet_sweeps_health_only_when_due_or_after_a_client_error(routed):
    """Runs last in this module (it stops the engine for a while). Without fault tolerance the loop calls
    ``prune_dead_if_due`` every step: the first call sweeps; a hung engine is not probed again while
    requests go well, but is removed at the first call after a failed request."""
    import signal

    from miles.run.fleet import Fleet

    router_url, engine = routed
    sup = routed_supervisor(engine)

    async def go():
        client = EngineClient(router_url, timeout=1.0, max_retries=0)
        fleet = Fleet(urls=[engine], targets=[], client=client, router_url=router_url)
        try:
            first = await fleet.prune_dead_if_due(probe_timeout=1.0)
            sup.kill(signal.SIGSTOP)
            try:
                quiet = await fleet.prune_dead_if_due(probe_timeout=1.0)  # no error since the sweep: not due
                with pytest.raises(EngineError, match="timed out"):
                    await client.generate([3, 4, 5], {"max_new_tokens": 2})
                after_error = await fleet.prune_dead_if_due(probe_timeout=1.0)
            finally:
                sup.kill(signal.SIGCONT)
            async with RouterClient(router_url, timeout=60) as rc:
                await rc.add_worker(engine)
            return first, quiet, after_error
        finally:
            await client.close()
            for ctl in fleet._controls.values():
                await ctl.close()

    assert run(go()) == ([], [], [engine])
