"""The engines of one run: started by their leader ranks, reached by the driver through a router.

Every rank calls :func:`place_engines` (one bounded all-gather over the control group): each engine's
node-0 leader picks its HTTP port (and, for a multi-node SGLang engine, the port of its
``--dist-init-addr``), every rank learns every engine's URL, and each leader then starts its share of
the engine as a supervised child process (:class:`~miles.spmd.supervisor.EngineSupervisor`, argv from
:func:`~miles.fleet.engines.engine_argv_from_config`, log in ``<output-dir>/engine<i>.log``).

The driver then waits until every engine answers ``/health`` (``--engine-startup-timeout``), starts
(or connects to, ``--sglang-router-ip/--sglang-router-port``) the sglang-router and builds the generation
client: :func:`connect_fleet` returns a :class:`Fleet`. The engines are added to the router only once
they are current: :meth:`Fleet.register` after the initial weight sync (or, with
``--use-fault-tolerance``, the recovery controller, engine by engine, after verifying its version).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.sglang import LORA_ADAPTER_NAME, serves_lora_adapters
from miles.fleet.engines import (
    chat_template_server_flags,
    cpu_threads_server_flags,
    engine_argv_from_config,
    engine_host,
    engine_url,
    model_server_flags,
    replay_server_flags,
    weight_backup_server_flags,
)
from miles.run.control import all_gather_json
from miles.utils.logging import get_logger
from miles.utils.net import find_free_port

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.spmd import SPMDContext
    from miles.spmd.supervisor import EngineSupervisor

logger = get_logger(__name__)


@dataclass
class Placement:
    """Where every engine listens (known on every rank) and this rank's engine process, if it leads one."""

    urls: list[str]
    num_workers: list[int]
    supervisor: EngineSupervisor | None = None
    watch: Any = None  # miles.run.engine_watch.EngineWatch (node-0 leader, without --use-fault-tolerance)

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.supervisor is not None:
            self.supervisor.stop(timeout=10.0)
            self.supervisor = None


@dataclass
class Fleet:
    """The driver's handle on the engines: URLs, weight-sync targets, router and generation client."""

    urls: list[str]
    targets: list[Any]
    client: Any
    router_url: str | None = None
    router: Any = None  # RouterProcess we started (None when connected to a running one)
    api_key: str | None = None
    register_timeout: float = 600.0  # --engine-startup-timeout: an engine joins the router within it
    prune_interval: float = 10.0  # prune_dead_if_due: seconds between /health sweeps while requests go well
    _controls: dict[str, Any] = field(default_factory=dict)
    _pruned: tuple[float, int] | None = field(default=None, repr=False)  # (when, the client's errors then)

    def control(self, url: str) -> Any:
        from miles.fleet.client import EngineControl

        if url not in self._controls:
            self._controls[url] = EngineControl(url, api_key=self.api_key)
        return self._controls[url]

    async def call_all(self, method: str, **kwargs: Any) -> list[Any]:
        """``EngineControl.<method>`` on every engine, concurrently."""
        return await asyncio.gather(*(getattr(self.control(u), method)(**kwargs) for u in self.urls))

    async def register(self) -> list[str]:
        """Add this run's engines to the router (after the initial weight sync: healthy and current).
        Engines the router lists already are left alone; returns the URLs added."""
        from miles.fleet.router import RouterClient

        if self.router_url is None:
            return []
        added: list[str] = []
        async with RouterClient(self.router_url, api_key=self.api_key) as rc:
            listed = await _listed_urls(rc)
            for url in self.urls:
                if url.rstrip("/") not in listed:
                    await rc.add_worker(url, timeout=self.register_timeout)
                    added.append(url)
        logger.info("router %s: %d engine(s) in rotation", self.router_url, len(self.urls))
        return added

    def _client_errors(self) -> int:
        stats = getattr(self.client, "stats", None)
        return int(stats.get("retries", 0)) + int(stats.get("failed", 0)) if isinstance(stats, dict) else -1

    async def prune_dead_if_due(self, probe_timeout: float = 5.0) -> list[str]:
        """:meth:`prune_dead` at the first call, then once ``prune_interval`` s have passed or as soon as the
        generation client saw a retry or a failed request since the last sweep (a dead engine shows there first:
        its requests are retried on the others). Saves the sweep's round trips on every other step."""
        errors = self._client_errors()
        if (self._pruned is not None and errors >= 0 and errors == self._pruned[1]
                and time.monotonic() - self._pruned[0] < self.prune_interval):
            return []
        removed = await self.prune_dead(probe_timeout)
        self._pruned = (time.monotonic(), self._client_errors())
        return removed

    async def prune_dead(self, probe_timeout: float = 5.0) -> list[str]:
        """Without ``--use-fault-tolerance``: delete this run's engines that fail two ``/health`` probes
        from the router (the router itself only marks them unhealthy). Their requests are retried on
        the others by the client; the next weight sync then fails naming the lost engine, since a dead
        member cannot be replaced without fault tolerance."""
        from miles.fleet.router import RouterClient

        if self.router_url is None:
            return []
        removed: list[str] = []
        async with RouterClient(self.router_url, api_key=self.api_key) as rc:
            listed = await _listed_urls(rc)
            for url in [u for u in self.urls if u.rstrip("/") in listed]:
                ctl = self.control(url)
                if await ctl.health(timeout=probe_timeout) or await ctl.health(timeout=probe_timeout):
                    continue
                logger.error("engine %s stopped answering /health: removed from the router (its requests go to "
                             "the other engines; pass --use-fault-tolerance to restart it in place)", url)
                if await rc.remove_worker(url):
                    removed.append(url)
        return removed

    async def close(self) -> None:
        if self.router is None and self.router_url is not None:
            # a router we did not start outlives the run: deregister our engines from it
            from miles.fleet.router import RouterClient

            try:
                async with RouterClient(self.router_url, api_key=self.api_key) as rc:
                    for url in self.urls:
                        await rc.remove_worker(url, timeout=10.0)
            except Exception as e:  # the router may be gone already; closing must go on
                logger.warning("could not deregister engines from router %s: %s", self.router_url, e)
        for ctl in self._controls.values():
            await ctl.close()
        await self.client.close()
        if self.router is not None:
            self.router.stop()
            self.router = None


def place_engines(cfg: MilesConfig, ctx: SPMDContext, *, kind: str, api_key: str | None, out_dir: Path,
                  timeout: float, threads: int | None = None) -> Placement:
    """Collective over the control group: agree on engine addresses, then leaders start their engines.
    ``threads``: the engine process's ``OMP_NUM_THREADS`` (``miles.spmd.threads``; None: inherited)."""
    plan, world = ctx.plan, ctx.world
    spec = ctx.engine
    host = engine_host(world.num_nodes)  # loopback when the job is on one node
    mine: dict[str, Any] | None = None
    if spec is not None and ctx.rank == spec.leader_rank:
        mine = {"engine_id": spec.engine_id, "host": host, "port": find_free_port(host),
                "dist_port": find_free_port(host) if spec.nnodes > 1 else None}
    entries = [e for e in all_gather_json(mine, ctx.groups.control_group, timeout) if e is not None]
    by_id = {e["engine_id"]: e for e in entries}
    if sorted(by_id) != [s.engine_id for s in plan.engines]:
        raise RuntimeError(f"engine placement: expected engines {[s.engine_id for s in plan.engines]}, "
                           f"leaders reported {sorted(by_id)}")
    urls = [engine_url(by_id[s.engine_id]["host"], by_id[s.engine_id]["port"]) for s in plan.engines]
    placement = Placement(urls=urls, num_workers=[s.num_gpus for s in plan.engines])
    if spec is not None and ctx.rank in spec.node_ranks:
        node0 = by_id[spec.engine_id]
        node_rank = spec.engine_node_rank(ctx.rank)
        dist_init = f"{node0['host']}:{node0['dist_port']}" if spec.nnodes > 1 else None
        argv = engine_argv_from_config(
            kind, cfg.rollout, hf_checkpoint=cfg.train.hf_checkpoint, host=host, port=node0["port"], api_key=api_key, num_gpus=spec.num_gpus, base_gpu_id=_visible_base_gpu(spec, world),
            device=world.device.type, colocate=plan.colocate, nnodes=spec.nnodes, node_rank=node_rank,
            dist_init_addr=dist_init, sglang=cfg.sglang,
            extra=replay_server_flags(kind, cfg.algo) + model_server_flags(kind, cfg.megatron)
            + weight_backup_server_flags(kind, cfg.weights)
            + chat_template_server_flags(kind, cfg.data, cfg.sglang.server_args)
            + cpu_threads_server_flags(kind, world.device.type, threads))
        name = f"engine{spec.engine_id}" + (f"-node{node_rank}" if node_rank else "")
        placement.supervisor = start_engine(argv, cfg, name=name, log_path=out_dir / f"{name}.log", threads=threads)
        if node_rank == 0 and not cfg.ft.use_fault_tolerance:  # with it, the FT heartbeat probes and restarts
            from miles.run.engine_watch import EngineWatch

            placement.watch = EngineWatch(placement.supervisor, engine_url(node0["host"], node0["port"]), name=name,
                                          interval=cfg.ft.rollout_health_check_interval,
                                          timeout=cfg.ft.rollout_health_check_timeout,
                                          log_path=out_dir / f"{name}.log").start()
    return placement


async def _listed_urls(rc: Any) -> set[str]:
    """The engine URLs a router lists (without a trailing slash)."""
    return {w.get("url", "").rstrip("/") for w in await rc.list_workers()}


def _visible_base_gpu(spec: Any, world: Any) -> int:
    """The engine's first GPU as this process sees it. With one GPU per task (``srun --gpus-per-task=1``)
    the engine inherits that single device, so it is GPU 0 and the engine can use only one."""
    if world.device.type != "cuda":
        return spec.base_gpu_id
    import torch

    visible = torch.cuda.device_count()
    if visible == 1 and world.local_world_size > 1:
        if spec.num_gpus > 1:
            from miles.config import ConfigError

            raise ConfigError(f"engine {spec.engine_id} needs {spec.num_gpus} GPUs (--rollout-num-gpus-per-engine), "
                              "but the launcher gave each rank a single GPU (e.g. srun --gpus-per-task=1): give "
                              "every task all of the node's GPUs (--gpus-per-node, no --gpus-per-task).")
        return 0
    return spec.base_gpu_id


def _last_error(log_path: Path, fallback: bool = True) -> str:
    """``: <the last error line of the engine's log>`` (or, with ``fallback``, its last line), to say why in the rank's
    one line. aiohttp's ``Error handling request`` and the traceback under it are skipped: that is a request it could
    not parse (sglang-router's HTTP/2 probe of a new worker, in SGLang's log), never why an engine died."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 16384))
            lines = [ln.rstrip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    kept: list[str] = []
    noise = False
    for i, ln in enumerate(lines):
        if ln[:1].isspace():  # a traceback's frames, an exception's detail
            continue
        if "Error handling request" in ln:
            noise = i + 1 < len(lines) and lines[i + 1].startswith("Traceback")
            continue
        if noise:
            noise = ln.startswith(("Traceback", "During handling", "The above"))  # else: its exception line, skipped
            continue
        kept.append(ln)
    pick = next((ln for ln in reversed(kept) if "ERROR" in ln or "Error" in ln), kept[-1] if kept and fallback else "")
    return f": {pick[:300]}" if pick else ""


def _exit_cause(code: int) -> str:
    """``exited with code 2`` or ``was killed by SIGKILL (exit code -9)``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


def start_engine(argv: list[str], cfg: MilesConfig, *, name: str, log_path: Path,
                 threads: int | None = None) -> EngineSupervisor:
    from miles.spmd.supervisor import EngineSupervisor, scrubbed_env

    restarts = cfg.ft.max_engine_restarts if cfg.ft.use_fault_tolerance else 0
    extra = {"MILES_LOG_LEVEL": os.environ.get("MILES_ENGINE_LOG_LEVEL", "WARNING")}
    if threads is not None:  # its share of the node's cores while it generates (miles.spmd.threads)
        extra["OMP_NUM_THREADS"] = str(threads)

    def on_exit(sup: EngineSupervisor, code: int, will_restart: bool) -> None:
        if code == 0:
            return
        logger.error("%s exited with code %d%s; its log: %s", name, code, " (restarting)" if will_restart else "",
                     log_path)
        if not will_restart and not cfg.ft.use_fault_tolerance:
            # no engine will take its place: end this rank now, so that the launcher ends the job (the driver would
            # otherwise wait --engine-startup-timeout for an engine that is gone, or retry requests against it)
            from miles.spmd.errors import exit_rank_now
            from miles.utils.errors import MilesError

            # a killed engine's log ends where it was killed: quote an error line only (not whatever came last)
            exit_rank_now(MilesError(f"{name} {_exit_cause(code)}{_last_error(log_path, fallback=code > 0)}; without "
                                     f"--use-fault-tolerance the run cannot go on without it (its log: {log_path})"))

    sup = EngineSupervisor(argv, env=scrubbed_env(extra=extra), name=name, log_path=log_path, max_restarts=restarts,
                           on_exit=on_exit)
    sup.start()
    logger.info("started %s (pid %s), log %s", name, sup.pid, log_path)
    return sup


async def connect_fleet(cfg: MilesConfig, placement: Placement, *, api_key: str | None, out_dir: Path,
                        num_nodes: int) -> Fleet:
    """Driver: wait for every engine, start or reach the router, build the client. The engines join the
    router later, once current (:meth:`Fleet.register` after the initial sync, or the FT controller)."""
    from miles.fleet.client import EngineClient, EngineControl
    from miles.fleet.router import RouterClient, connect_or_start_router
    from miles.weight_sync.base import EngineTarget

    r = cfg.rollout
    controls = [EngineControl(u, api_key=api_key) for u in placement.urls]
    try:
        await asyncio.gather(*(c.wait_healthy(timeout=r.engine_startup_timeout) for c in controls))
    finally:
        for c in controls:
            await c.close()
    logger.info("%d engine(s) healthy: %s", len(placement.urls), ", ".join(placement.urls))
    router_url, router = connect_or_start_router(r, host=engine_host(num_nodes), api_key=api_key,
                                                 log_path=out_dir / "router.log")
    rc = RouterClient(router_url, api_key=api_key)
    try:  # the engines join the router after the initial weight sync (Fleet.register, or the FT controller)
        await rc.wait_ready(timeout=60.0)
    except BaseException:
        if router is not None:
            router.stop()
        raise
    finally:
        await rc.close()
    # R3: sglang-router drops return_routed_experts from /generate bodies (docs/rollout.md), so with
    # --use-rollout-routing-replay the rollout sends its requests to the engines directly (round robin)
    # and so does a rollout naming the engines' LoRA adapter (the router drops lora_path too)
    lora_path = LORA_ADAPTER_NAME if serves_lora_adapters(cfg.train, cfg.sglang) else None
    gen_urls = list(placement.urls) if cfg.algo.use_rollout_routing_replay or lora_path else router_url
    client = EngineClient(gen_urls, api_key=api_key, timeout=r.rollout_request_timeout,
                          max_retries=r.rollout_request_retries,
                          concurrency=max(1, r.sglang_server_concurrency * len(placement.urls)), engine_urls=placement.urls,
                          lora_path=lora_path)
    targets = [EngineTarget(url=u, num_workers=n, engine_id=i, api_key=api_key)
               for i, (u, n) in enumerate(zip(placement.urls, placement.num_workers))]
    return Fleet(urls=list(placement.urls), targets=targets, client=client, router_url=router_url, router=router,
                 api_key=api_key, register_timeout=r.engine_startup_timeout)
