"""The engine-recovery controller: real engine processes, each under the real EngineSupervisor of a leader
process that heartbeats to a real torchft lighthouse, behind the real sglang-router, with real weight
syncs (BroadcastSender over gloo) from an HF model standing in for the trainer.

Here: the weight gate without the driver's catch-up (a returned engine waits for the next sync), and an
engine that keeps dying until it is given up (then the run must stop when none is left). Kills mid-rollout,
during a weight sync and hangs run through ``train.py`` in tests/e2e/test_fault_tolerance.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from miles.config import FTConfig
from miles.config import weights as weight_flags
from miles.config.base import section_from_namespace
from miles.config.weights import WeightSyncConfig
from miles.fleet.client import EngineClient, run_sync
from miles.fleet.engines import build_engine_argv
from miles.fleet.router import RouterClient, RouterProcess
from miles.ft.lighthouse import Lighthouse, torchft_coordination
from miles.ft.recovery import EngineRecoveryController, NoEnginesLeftError
from miles.ft.sync import sync_weights_with_recovery
from miles.ft.timing import ft_timings
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


def _generate_many(client: EngineClient, n: int) -> list:
    async def go():
        try:
            return await asyncio.gather(*(client.generate(PROMPT, {**LONG, "sampling_seed": i}, rid=f"req-{i}")
                                          for i in range(n)), return_exceptions=True)
        finally:
            await client.close()
    return asyncio.run(go())


def test_returning_engine_is_routed_only_after_a_weight_sync_brings_it_current(tiny_model_dir, tmp_path):
    """Without a catch-up (the driver holds no weight cache) a returned engine waits for the next sync."""
    rig = Rig(tmp_path, tiny_model_dir, num_engines=1, max_restarts=2)
    try:
        rig.ctl.wait_routed(timeout=180)
        source = ModelSource(rig.model_dir)
        sender = rig.sender_for(source)
        source.step(1)
        rig.sync()
        assert sender.weight_version == 1 and sender.check() > 0
        out = _generate_many(rig.client, 4)
        assert not [r for r in out if isinstance(r, BaseException)]
        t_kill = time.monotonic()
        os.kill(rig.engine_pid(0), signal.SIGKILL)
        rig.wait_state(0, "awaiting_weights", timeout=120)
        outage = rig.ctl.outages()[-1]
        t = rig.timings
        assert outage.removed_at - t_kill < t.heartbeat_period + t.heartbeat_timeout + t.join_timeout + 3.0
        # back, serving its checkpoint's weights: not routed, but a target of the next sync
        assert rig.router_urls() == set() and rig.ctl.sync_targets() == [(0, rig.urls[0])]
        time.sleep(1.0)
        assert rig.ctl.states()[0] == "awaiting_weights"
        source.step(2)
        rig.sync()  # a new weight group with the returned engine; v2 pushed, verified, then routed
        assert rig.ctl.states()[0] == "routed" and rig.router_urls() == {rig.urls[0]}
        assert sender.weight_version == 2 and sender.check() > 0  # bitwise equal to the trainer's
        out = _generate_many(rig.client, 4)
        assert not [r for r in out if isinstance(r, BaseException)]
        assert all(r["meta_info"]["weight_version"] == "2" for r in out)
        m = rig.ctl.metrics()
        assert m["ft/engine_restarts"] == 1 and m["ft/engine_failures"] == 1 and m["ft/recovery_time_s"] > 0
    finally:
        rig.close()


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
