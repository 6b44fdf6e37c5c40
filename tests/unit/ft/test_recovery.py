"""The engine-recovery controller end to end: real embedded engines, each under the real EngineSupervisor
of a leader process that heartbeats to a real torchft lighthouse, behind the real sglang-router, with
real weight syncs (BroadcastSender over gloo) from an HF model standing in for the trainer.

Faults: SIGKILL of an engine while requests are in flight, SIGKILL during a weight sync, SIGSTOP (a
hang), and an engine that keeps dying until it is given up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from miles.config import FTConfig
from miles.config import weights as weight_flags
from miles.config.base import section_from_namespace
from miles.config.weights import WeightSyncConfig
from miles.ft.lighthouse import Lighthouse, torchft_coordination
from miles.ft.recovery import EngineRecoveryController, NoEnginesLeftError, sync_weights_with_recovery
from miles.ft.timing import ft_timings
from miles.rollout.client import EngineClient, run_sync
from miles.rollout.engines import build_engine_argv
from miles.rollout.router import RouterClient, RouterProcess
from miles.utils.net import find_free_port
from miles.utils.optional import MissingDependencyError
from miles.weight_sync.base import EngineTarget, WeightSyncError, build_weight_sender
from miles.weight_sync.buckets import iter_buckets

try:
    torchft_coordination()
except MissingDependencyError as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
INTERVAL, TIMEOUT = 0.5, 5.0
PROMPT = [3, 4, 5, 6]
LONG = {"temperature": 1.0, "max_new_tokens": 120, "ignore_eos": True}


def ft_cfg(max_restarts: int = 3) -> FTConfig:
    return FTConfig(use_fault_tolerance=True, rollout_health_check_interval=INTERVAL,
                    rollout_health_check_timeout=TIMEOUT, rollout_health_check_first_wait=120.0,
                    max_engine_restarts=max_restarts)


def weights_cfg() -> WeightSyncConfig:
    p = argparse.ArgumentParser()
    weight_flags.add_arguments(p)
    return section_from_namespace(WeightSyncConfig, p.parse_args(["--update-weight-timeout", "60",
                                                                 "--pause-generation-mode", "abort"]))


class ModelSource:
    """The trainer's side of a weight sync: an HF model's parameters under their HF names."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def step(self, k: int) -> None:
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))

    def iter_weight_buckets(self, bucket_bytes, dtype):
        named = ((n, p.detach().to(dtype) if dtype is not None else p.detach()) for n, p in self.model.named_parameters())
        yield from iter_buckets(named, bucket_bytes)


class Rig:
    """Lighthouse + router + N engine leaders + the controller, as the driver would set them up."""

    def __init__(self, tmp: Path, model_dir: Path | None, num_engines: int, max_restarts: int) -> None:
        """``model_dir`` None: the engines are tests/unit/ft/health_server.py (health routes only)."""
        self.tmp, self.model_dir = tmp, model_dir
        self.cfg = ft_cfg(max_restarts)
        self.timings = ft_timings(self.cfg)
        self.lh = Lighthouse.start(self.timings, bind_host="127.0.0.1")
        self.router = RouterProcess.start("127.0.0.1", None, "round_robin", timeout=60, health_check_interval_secs=1,
                                          health_failure_threshold=1, retry_max_retries=1, log_path=tmp / "router.log")
        self.router_client = RouterClient(self.router.url, timeout=60)
        self.urls: dict[int, str] = {}
        self.leaders: dict[int, subprocess.Popen] = {}
        for eid in range(num_engines):
            self._leader(eid, max_restarts)
        self.client = EngineClient(self.router.url, timeout=60, max_retries=4, concurrency=16)
        self.ctl = EngineRecoveryController(self.cfg, engines=self.urls, router=self.router_client,
                                            lighthouse_addr=self.lh.address,
                                            requests_retried=lambda: self.client.stats["retries"]).start()
        self.sender = None

    def _leader(self, eid: int, max_restarts: int) -> None:
        port = find_free_port()
        self.urls[eid] = f"http://127.0.0.1:{port}"
        if self.model_dir is None:
            argv = [sys.executable, str(HERE / "health_server.py"), "--port", str(port)]
        else:
            argv = build_engine_argv("embedded", hf_checkpoint=str(self.model_dir), host="127.0.0.1", port=port,
                                     device="cpu", max_running_requests=8, max_context_len=256)
        self.leaders[eid] = subprocess.Popen(
            [sys.executable, str(HERE / "leader_agent.py"), "--lighthouse", self.lh.address, "--engine-id", str(eid),
             "--url", self.urls[eid], "--pid-file", str(self.tmp / f"engine{eid}.pid"),
             "--log", str(self.tmp / f"engine{eid}.log"), "--interval", str(INTERVAL), "--timeout", str(TIMEOUT),
             "--first-wait", "120", "--max-restarts", str(max_restarts), "--", *argv])

    def engine_pid(self, eid: int, min_incarnation: int = 0) -> int:
        path = self.tmp / f"engine{eid}.pid"
        deadline = time.monotonic() + 30
        while True:
            if path.exists():
                pid, inc = map(int, path.read_text().split())
                if inc >= min_incarnation:
                    return pid
            assert time.monotonic() < deadline, f"engine {eid}: no pid for incarnation {min_incarnation}"
            time.sleep(0.05)

    def router_urls(self) -> set[str]:
        async def go():
            async with RouterClient(self.router.url, timeout=30) as rc:
                return {w["url"].rstrip("/") for w in await rc.list_workers()}
        return asyncio.run(go())

    def wait_state(self, eid: int, state: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.ctl.states()[eid] != state:
            assert time.monotonic() < deadline, f"engine {eid} not {state} within {timeout}s: {self.ctl.states()}"
            time.sleep(0.1)

    def wait_recovered(self, eid: int, outages: int, timeout: float) -> None:
        """Until engine ``eid`` has ``outages`` outages, the last one over (back in rotation)."""
        deadline = time.monotonic() + timeout
        while True:
            mine = [o for o in self.ctl.outages() if o.engine_id == eid]
            if len(mine) >= outages and mine[-1].admitted_at is not None:
                return
            assert time.monotonic() < deadline, f"engine {eid}: outage {outages} not over in {timeout}s: {mine}"
            time.sleep(0.1)

    def sender_for(self, source: ModelSource):
        targets = [EngineTarget(url, engine_id=eid) for eid, url in self.ctl.sync_targets()]
        self.sender = build_weight_sender(weights_cfg(), source, is_source=True, engines=targets,
                                          master_addr="127.0.0.1", store_port=find_free_port())
        self.sender.connect()
        return self.sender

    def sync(self, max_attempts: int = 3):
        return sync_weights_with_recovery(self.sender, self.ctl, lambda eid, url: EngineTarget(url, engine_id=eid),
                                          retry_on=(WeightSyncError,), max_attempts=max_attempts)

    def close(self) -> None:
        self.ctl.stop()
        run_sync(self.router_client.close(), timeout=10)
        if self.sender is not None:
            self.sender.close()
        for p in self.leaders.values():
            if p.poll() is None:
                p.terminate()
        for eid, p in self.leaders.items():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            path = self.tmp / f"engine{eid}.pid"
            if path.exists():  # a SIGSTOPped or orphaned engine: ours to clean up
                pid = int(path.read_text().split()[0])
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
        self.router.stop()
        self.lh.shutdown()


@pytest.fixture(scope="module")
def rig(tiny_model_dir, tmp_path_factory):
    r = Rig(tmp_path_factory.mktemp("ft_recovery"), tiny_model_dir, num_engines=2, max_restarts=3)
    try:
        r.ctl.wait_routed(timeout=180)
        yield r
    finally:
        r.close()


def _generate_many(client: EngineClient, n: int) -> list:
    async def go():
        try:
            return await asyncio.gather(*(client.generate(PROMPT, {**LONG, "sampling_seed": i}, rid=f"req-{i}")
                                          for i in range(n)), return_exceptions=True)
        finally:
            await client.close()
    return asyncio.run(go())


async def _load(url: str) -> int:
    from miles.rollout.client import EngineControl

    async with EngineControl(url, timeout=5) as c:
        load = await c._get("/get_load")
    return int(load[0]["num_running_reqs"])


def test_sigkill_mid_rollout_every_request_completes_and_engine_returns(rig):
    assert rig.router_urls() == set(rig.urls.values())
    retried_before = rig.client.stats["retries"]
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(_generate_many(rig.client, 24)))
    worker.start()
    deadline = time.monotonic() + 60
    while asyncio.run(_load(rig.urls[0])) == 0:  # requests are running on engine 0
        assert time.monotonic() < deadline, "no request ever ran on engine 0"
        time.sleep(0.05)
    outages_before = len([o for o in rig.ctl.outages() if o.engine_id == 0])
    t_kill = time.monotonic()
    os.kill(rig.engine_pid(0), signal.SIGKILL)
    worker.join(180)
    assert not worker.is_alive()
    errors = [r for r in out if isinstance(r, BaseException)]
    assert not errors, errors
    assert len(out) == 24 and sorted(r["miles"]["rid"] for r in out) == sorted(f"req-{i}" for i in range(24))
    assert all(len(r["output_ids"]) == LONG["max_new_tokens"] for r in out)
    assert rig.client.stats["retries"] > retried_before, "the requests in flight on the killed engine were not retried"
    rig.wait_recovered(0, outages_before + 1, timeout=120)
    outage = [o for o in rig.ctl.outages() if o.engine_id == 0][-1]
    assert outage.engine_id == 0 and outage.removed_at is not None and outage.admitted_at is not None
    t = rig.timings
    assert outage.removed_at - t_kill < t.heartbeat_period + t.heartbeat_timeout + t.join_timeout + 3.0
    assert rig.router_urls() == set(rig.urls.values())
    m = rig.ctl.metrics()
    assert m["ft/engine_restarts"] >= 1 and m["ft/requests_retried"] >= 1 and m["ft/recovery_time_s"] > 0


def test_returning_engine_is_routed_only_after_it_has_the_current_weights(rig):
    source = ModelSource(rig.model_dir)
    sender = rig.sender_for(source)
    source.step(1)
    rig.sync()
    assert sender.weight_version == 1 and sender.check() > 0
    os.kill(rig.engine_pid(1), signal.SIGKILL)
    rig.wait_state(1, "awaiting_weights", timeout=120)
    # back, serving its checkpoint's weights: not routed until a sync reaches it
    assert rig.urls[1] not in rig.router_urls()
    assert (1, rig.urls[1]) in rig.ctl.sync_targets()
    source.step(2)
    rig.sync()
    assert rig.ctl.states()[1] == "routed" and rig.urls[1] in rig.router_urls()
    assert sender.weight_version == 2 and sender.check() > 0  # bitwise equal on both engines


def test_sigkill_during_weight_sync_completes_for_the_others(rig):
    sender = rig.sender
    assert sender is not None, "runs after the weight test"
    source = sender.source
    victims = [rig.engine_pid(0)]
    real_iter = source.iter_weight_buckets

    def killing_iter(bucket_bytes, dtype):  # SIGKILL engine 0 once the transfer has begun (first attempt only)
        for i, bucket in enumerate(real_iter(bucket_bytes, dtype)):
            if i == 1 and victims:
                os.kill(victims.pop(), signal.SIGKILL)
            yield bucket

    source.iter_weight_buckets = killing_iter
    sender.cfg.update_weight_buffer_size = 64 << 10  # several buckets
    try:
        source.step(3)
        rig.sync()
    finally:
        source.iter_weight_buckets = real_iter
    assert not victims
    assert sender.weight_version == 3
    assert [e.url for e in sender.engines] == [rig.urls[1]], "the sync finished on the surviving engine only"
    assert rig.ctl.states()[0] in ("down", "awaiting_weights")
    rig.wait_state(0, "awaiting_weights", timeout=120)
    assert rig.urls[0] not in rig.router_urls()
    rig.sync()  # the next sync catches it up (same weights, version 4)
    assert rig.ctl.states()[0] == "routed" and sender.check() > 0


def test_sigstop_hang_is_detected_by_health_probes(rig):
    pid = rig.engine_pid(1)
    t_stop = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    rig.wait_state(1, "down", timeout=rig.timings.hang_detection_bound + 5)
    assert time.monotonic() - t_stop < rig.timings.hang_detection_bound + 3
    assert rig.urls[1] not in rig.router_urls()
    # the router keeps serving with engine 0 meanwhile
    out = _generate_many(rig.client, 4)
    assert not [r for r in out if isinstance(r, BaseException)]
    rig.wait_state(1, "awaiting_weights", timeout=120)  # the leader killed the hung process and restarted it
    rig.sync()
    assert rig.ctl.states()[1] == "routed"


def test_engine_that_keeps_dying_is_given_up_and_the_run_stops_when_none_is_left(tmp_path):
    r = Rig(tmp_path, None, num_engines=2, max_restarts=1)
    try:
        r.ctl.wait_routed(timeout=60)
        for eid in (0, 1):
            os.kill(r.engine_pid(eid), signal.SIGKILL)
        for eid in (0, 1):
            r.wait_recovered(eid, 1, timeout=60)
        os.kill(r.engine_pid(0, min_incarnation=1), signal.SIGKILL)
        r.wait_state(0, "given_up", timeout=60)
        r.ctl.check()  # engine 1 is left: the run goes on
        assert r.router_urls() == {r.urls[1]} and r.ctl.healthy_engine_urls() == [r.urls[1]]
        os.kill(r.engine_pid(1, min_incarnation=1), signal.SIGKILL)
        r.wait_state(1, "given_up", timeout=60)
        with pytest.raises(NoEnginesLeftError, match="--max-engine-restarts 1") as e:
            r.ctl.check()
        assert "engine 0" in str(e.value) and "engine 1" in str(e.value)
        assert r.router_urls() == set()
        assert r.ctl.metrics()["ft/engines_given_up"] == 2
    finally:
        r.close()
