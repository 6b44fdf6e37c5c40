"""``--use-fault-tolerance`` for one run: the few calls the run plane makes, on the ranks that make them.

    ft = FaultTolerance.setup(cfg.ft, is_driver=..., host=..., share_address=bcast,          # every rank
                              engine_id=..., supervisor=placement.supervisor, engine_url=...)
    ft.start_recovery(targets=fleet.targets, router_url=fleet.router_url, api_key=key,    # driver, after
                      client=fleet.client)                                                #  the fleet is up
    manager = RolloutManager(..., ft.wrap_client(fleet.client), ...)                      # driver
    ft.sync_weights(sender)           # every trainer rank, instead of sender.sync()
    ft.check(); ft.metrics()          # driver, each rollout
    ft.close()                        # every rank, on every exit path

``setup`` returns None without ``--use-fault-tolerance``; then nothing here runs and an engine death
fails the run (the engine supervisor does not restart it). ``share_address`` is the run's broadcast
from the driver (its argument is ``{"address": ...}`` (or ``{"error": ...}``) on the driver, None
elsewhere; it returns the driver's dict on every rank), so that this module needs nothing from
``miles.run``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from miles.config.ft import FTConfig
from miles.fleet.client import EngineError, run_sync
from miles.ft.heartbeat import EngineHeartbeat, start_engine_heartbeat
from miles.ft.lighthouse import Lighthouse
from miles.ft.recovery import EngineRecoveryController, NoEnginesLeftError
from miles.ft.sync import sync_weights_with_recovery
from miles.ft.timing import FTTimings, ft_timings
from miles.utils.logging import get_logger

logger = get_logger(__name__)


class FaultTolerantClient:
    """The rollout client, plus one more rule: a request that failed every retry because no engine could
    take it (all of them down at once, or the router had none in rotation yet) waits until an engine is
    back in rotation and is issued again, so the sample is not lost. It stops waiting, and fails, when
    every engine was given up or after the longest an engine can take to come back.
    """

    def __init__(self, inner: Any, controller: EngineRecoveryController, timings: FTTimings) -> None:
        self.inner, self.controller = inner, controller
        self.wait_budget = timings.cold_start + timings.hang_detection_bound + 30.0
        self.reissued = 0
        self._current: dict[str, str] = {}  # rid -> the rid of its attempt in progress on ``inner``
        self._aborted: dict[str, asyncio.Event] = {}  # rid -> set once aborted, for every generate() in progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, input_ids: Sequence[int], sampling_params: dict, return_logprob: bool = True,
                       rid: str | None = None, **kwargs: Any) -> dict:
        t0 = time.monotonic()
        deadline = t0 + self.wait_budget
        aborted = asyncio.Event()
        if rid is not None:
            self._aborted[rid] = aborted
        k = 0
        try:
            while True:
                attempt_rid = rid if (rid is None or k == 0) else f"{rid}-ft{k}"
                if rid is not None:
                    self._current[rid] = attempt_rid
                try:
                    resp = await self.inner.generate(input_ids, sampling_params, return_logprob=return_logprob,
                                                     rid=attempt_rid, **kwargs)
                except EngineError as e:
                    if not e.retryable:
                        raise
                    self.controller.check()  # NoEnginesLeftError: the run stops, saying why
                    if time.monotonic() > deadline:
                        raise EngineError(e.url, e.endpoint, e.status, f"{e.message} -- and no engine came back "
                                          f"within {self.wait_budget:.0f}s") from e
                    if not aborted.is_set():
                        logger.warning("request %s failed on every retry (%s); re-issuing it once an engine is in "
                                       "rotation", rid, e.message[:200])
                        await self._wait_for_capacity(deadline, aborted)
                    if aborted.is_set():  # aborted while it failed or waited for an engine: not sent again
                        return self.inner._aborted_answer(rid, len(input_ids), k + 1, e.url, [str(e)], t0)
                    k += 1
                    self.reissued += 1
                    continue
                if k and isinstance(resp, dict) and isinstance(resp.get("miles"), dict):
                    resp["miles"]["attempts"] = int(resp["miles"].get("attempts", 1)) + k
                    resp["miles"]["rid"] = rid
                return resp
        finally:
            if rid is not None:
                self._aborted.pop(rid, None)
                self._current.pop(rid, None)

    async def abort(self, rid: str) -> bool:
        """Abort by the caller's rid: the attempt in progress (its rid may be ``<rid>-ft<k>``) and any re-issue."""
        event = self._aborted.get(rid)
        if event is not None:
            event.set()
        return bool(await self.inner.abort(self._current.get(rid, rid))) or event is not None

    async def abort_all(self) -> int:
        for event in self._aborted.values():
            event.set()
        return await self.inner.abort_all()

    async def _wait_for_capacity(self, deadline: float, aborted: asyncio.Event) -> None:
        while not self.controller.healthy_engine_urls() and time.monotonic() < deadline and not aborted.is_set():
            self.controller.check()
            try:
                await asyncio.wait_for(aborted.wait(), 0.2)
            except TimeoutError:
                pass


class FaultTolerance:
    """One rank's fault-tolerance state (see the module docstring)."""

    def __init__(self, ft: FTConfig, timings: FTTimings, lighthouse: Lighthouse | None, address: str,
                 heartbeat: EngineHeartbeat | None) -> None:
        self.ft, self.timings = ft, timings
        self.lighthouse, self.address, self.heartbeat = lighthouse, address, heartbeat
        self.controller: EngineRecoveryController | None = None
        self.client: FaultTolerantClient | None = None
        self._router_client: Any = None
        self._targets: dict[int, Any] = {}
        self._cache: Any = None

    @classmethod
    def setup(cls, ft: FTConfig, *, is_driver: bool, host: str, share_address: Callable[[dict | None], dict],
              engine_startup_timeout: float = 0.0,
              engine_id: int | None = None, supervisor: Any = None, engine_url: str | None = None) -> FaultTolerance | None:
        """Every rank, once the engines are placed: the driver starts the lighthouse, every rank learns its
        address, each engine's leader (the rank holding ``supervisor``) starts heartbeating for its engine."""
        if not ft.use_fault_tolerance:
            return None
        timings = ft_timings(ft, engine_startup_timeout)
        lighthouse = None
        if is_driver:
            try:
                lighthouse = Lighthouse.start(timings, bind_host=host)
            except Exception as e:  # tell every rank (they wait in share_address), then fail here too
                share_address({"error": f"{type(e).__name__}: {e}"})
                raise
        try:
            shared = share_address({"address": lighthouse.address} if lighthouse is not None else None)
            if "error" in shared:
                raise RuntimeError(f"--use-fault-tolerance: the driver could not start the torchft lighthouse: "
                                   f"{shared['error']}")
            address = shared["address"]
            heartbeat = None
            if supervisor is not None:
                if engine_id is None or not engine_url:
                    raise ValueError("FaultTolerance.setup: an engine leader must pass engine_id and engine_url")
                heartbeat = start_engine_heartbeat(engine_id, supervisor, engine_url, address, timings)
        except BaseException:
            if lighthouse is not None:
                lighthouse.shutdown()
            raise
        return cls(ft, timings, lighthouse, address, heartbeat)

    @classmethod
    def for_run(cls, ft: FTConfig, ctx: Any, placement: Any, broadcast: Callable[[Any], Any],
                engine_startup_timeout: float = 0.0) -> FaultTolerance | None:
        """:meth:`setup` from the run's SPMD context (``ctx.is_driver``, ``ctx.rank``, ``ctx.engine``,
        ``ctx.world.num_nodes``) and engine placement (``urls``, ``supervisor``); ``broadcast(value)`` is the
        driver's broadcast over the control group (collective: every rank calls this)."""
        if not ft.use_fault_tolerance:
            return None
        spec = getattr(ctx, "engine", None)
        leads = placement is not None and spec is not None and ctx.rank == spec.leader_rank
        if placement is None and ctx.is_driver:
            logger.warning("--use-fault-tolerance without rollout engines: nothing to recover")
        host = "127.0.0.1" if ctx.world.num_nodes == 1 else "0.0.0.0"
        return cls.setup(ft, is_driver=ctx.is_driver, host=host, share_address=broadcast,
                         engine_startup_timeout=engine_startup_timeout, engine_id=spec.engine_id if leads else None,
                         supervisor=placement.supervisor if leads else None,
                         engine_url=placement.urls[spec.engine_id] if leads else None)

    # -- driver -------------------------------------------------------------------------------------
    def start_recovery(self, *, targets: Sequence[Any], router_url: str, api_key: str | None, client: Any,
                       initial_version: int | None = None, wait_timeout: float | None = None,
                       events_path: str | None = None, await_first_sync: bool = False) -> EngineRecoveryController:
        """Driver: follow the quorum and keep the router in line with it. ``targets`` are the weight
        sender's engine targets (with ``engine_id`` and ``url``); waits until every engine joined (and, unless
        ``await_first_sync``, is routed: with it, engines are routed once the initial weight sync reached
        them). Each finished outage is appended to ``events_path`` (JSON lines) when given."""
        from miles.fleet.router import RouterClient

        self._targets = {int(t.engine_id): t for t in targets}
        self._router_client = RouterClient(router_url, api_key=api_key)
        stats = getattr(client, "stats", None)
        self.controller = EngineRecoveryController(
            self.ft, engines={eid: t.url for eid, t in self._targets.items()}, router=self._router_client,
            lighthouse_addr=self.address, api_key=api_key, initial_version=initial_version, timings=self.timings,
            events_path=events_path, await_first_sync=await_first_sync,
            requests_retried=(lambda: int(stats.get("retries", 0)) + (self.client.reissued if self.client else 0))
            if isinstance(stats, dict) else None).start()
        wait = wait_timeout or self.timings.cold_start + 60.0
        if await_first_sync:
            self.controller.wait_joined(timeout=wait)
        else:
            self.controller.wait_routed(timeout=wait)
        return self.controller

    def wrap_client(self, client: Any) -> Any:
        if self.controller is None:
            return client
        self.client = FaultTolerantClient(client, self.controller, self.timings)
        return self.client

    def check(self) -> None:
        if self.controller is not None:
            self.controller.check()

    def metrics(self) -> dict[str, float]:
        if self.controller is None:
            return {}
        m = self.controller.metrics()
        if self.client is not None:
            m["ft/requests_reissued"] = float(self.client.reissued)
        return m

    # -- trainer ranks ------------------------------------------------------------------------------
    def sync_weights(self, sender: Any, max_attempts: int = 3) -> Any:
        """Every trainer rank, in place of ``sender.sync()``; the source rank (the driver) re-forms the weight
        group with the live engines, drops engines that die during the sync, re-admits returned ones, and
        keeps a host copy of the synced weights so that an engine returning mid-rollout is caught up at once
        (:mod:`miles.ft.catchup`)."""
        from miles.weight_sync.base import WeightSyncError

        ctl = self.controller if getattr(sender, "is_source", False) else None
        on_synced = None
        if ctl is not None:
            if self._cache is None:
                from miles.ft.catchup import CatchUp, WeightCache

                self._cache = WeightCache(sender.source)
                sender.source = self._cache
                ctl.catch_up = CatchUp(self._cache, sender.cfg, self._to_target,
                                       master_addr=getattr(sender, "master_addr", None))
            on_synced = self._cache.commit
        return sync_weights_with_recovery(sender, ctl, self._to_target, retry_on=(WeightSyncError,),
                                          max_attempts=max_attempts, on_synced=on_synced)

    def _to_target(self, eid: int, url: str) -> Any:
        base = self._targets.get(eid)
        if base is None:
            raise KeyError(f"engine {eid} ({url}) is not one of this run's engines {sorted(self._targets)}")
        return dataclasses.replace(base, url=url)

    # -- every rank ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
        if self._router_client is not None:
            try:
                run_sync(self._router_client.close(), timeout=10)
            except (TimeoutError, RuntimeError, OSError) as e:
                logger.debug("closing the recovery controller's router client: %s", e)
            self._router_client = None
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None


__all__ = ["FaultTolerance", "FaultTolerantClient", "NoEnginesLeftError"]
