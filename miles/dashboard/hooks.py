"""What the run calls. Every function is a no-op without ``--use-miles-dashboard`` and never raises.

    start(cfg, ctx)                       # run_job, after bootstrap: this rank's collector (the driver's writes)
    attach(job)                           # after build_run: output dir, engines (topology, scraper), metrics
    with phase("rollout"): ...            # the driver's loop phases (PhaseTimer): rollout, eval -> eval_rollout
    with command("train"): ...            # every trainer rank's share of a driver command: actor_train,
                                          # update_weights, save_model, sleep / wake_up; and train_wait between
    close()                               # run_job's finally: last flush

Phase events carry Miles's fields (``records.phase_event``): wall-clock ``t0``/``t1``, the node (``node<i>``, the
plan's node index), the rank's physical GPU (none on CPU), the global rank and the role (``train`` for command
phases on trainer ranks, ``rollout_manager`` for the driver's rollout/eval). An open event (``t1`` = -1) is written
when a phase starts, so a long phase shows while it runs; its closing event supersedes it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles.dashboard import records
from miles.dashboard.collector import Collector
from miles.dashboard.sources import EngineScraper, GpuSampler
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.spmd import SPMDContext

logger = get_logger(__name__)

# radixark/miles@v0.1.0:miles/dashboard/args.py _SNAPSHOT_KEYS: the args kept in meta.json for the dashboard header
SNAPSHOT_KEYS = ("wandb_group", "wandb_team", "wandb_project", "wandb_run_id", "wandb_host", "colocate",
                 "num_gpus_per_node", "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus",
                 "rollout_num_gpus_per_engine", "rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len",
                 "hf_checkpoint", "sglang_max_running_requests", "sglang_mem_fraction_static",
                 "sglang_load_balance_method", "use_miles_router", "router_dp_aware", "router_policy",
                 "sglang_router_policy", "router_assignment_mode")
LOOP_PHASES = ("rollout", "eval")  # the driver's own phases; train/save/sync are recorded per rank by command()
SCRAPE_TIMEOUT_S = 5.0

_active: Dashboard | None = None


def physical_gpu(index: int) -> int:
    """NVML's index of CUDA device ``index`` (through CUDA_VISIBLE_DEVICES when it lists numbers)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def args_snapshot(cfg: MilesConfig) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section in cfg.to_dict().values():
        if isinstance(section, dict):
            flat.update(section)
    return {k: flat[k] for k in SNAPSHOT_KEYS if k in flat}


class Dashboard:
    """One rank's telemetry: its collector and what it knows of itself (see the module docstring)."""

    def __init__(self, collector: Collector, *, rank: int, node: str, gpus: list[int], is_trainer: bool,
                 is_driver: bool, world_size: int) -> None:
        self.collector, self.rank, self.node, self.gpus = collector, rank, node, gpus
        self.is_trainer, self.is_driver, self.world_size = is_trainer, is_driver, world_size
        self._wait_since: float | None = None

    def _emit(self, name: str, t0: float, t1: float, role: str, gpus: list[int]) -> None:
        self.collector.push(records.PHASES, records.phase_event(name, t0, t1, node=self.node, gpus=gpus,
                                                                rank=self.rank, role=role))

    @contextlib.contextmanager
    def span(self, name: str, role: str) -> Iterator[None]:
        gpus = self.gpus if role == records.ROLE_TRAIN else []
        t0 = time.time()
        _safe(self._emit, name, t0, records.OPEN_T1, role, gpus)
        try:
            yield
        finally:
            _safe(self._emit, name, t0, time.time(), role, gpus)

    @contextlib.contextmanager
    def command(self, cmd: str | None) -> Iterator[None]:
        name = records.PHASE_NAMES.get(cmd or "")
        if not self.is_trainer or name is None:
            yield
            return
        if cmd == "train" and self._wait_since is not None:
            _safe(self._emit, "train_wait", self._wait_since, time.time(), records.ROLE_TRAIN, self.gpus)
        try:
            with self.span(name, records.ROLE_TRAIN):
                yield
        finally:
            if cmd == "train":
                self._wait_since = time.time()

    def attach(self, job: Any) -> None:
        self._wait_since = time.time()
        if not self.is_driver:
            return
        cfg, plan = job.cfg, job.plan
        meta = records.meta(cfg.output.wandb_group or "miles-run", self.collector._meta["start_ts"],
                            {**args_snapshot(cfg), "output_dir": plan.output_dir})
        self.collector.write_meta(meta)
        job.sink = MetricsTee(job.sink, self.collector)
        fleet = job.fleet
        if fleet is None:
            return
        engines = []
        per_node = job.ctx.plan.num_gpus_per_node
        for i, (spec, url) in enumerate(zip(job.ctx.plan.engines, fleet.urls)):
            gpus = [(f"node{job.ctx.plan.node_of(r)}", physical_gpu(r % per_node)) for r in spec.ranks]
            engines.append(records.engine_info(url.rstrip("/"), i, gpus))
        self.collector.push(records.TOPOLOGY, records.topology(time.time(), engines))
        d = self.collector.cfg
        scraper = EngineScraper(d.scrape_mode, lambda: list(fleet.urls), lambda: fleet.router_url, metrics=d.metrics,
                                timeout=min(SCRAPE_TIMEOUT_S, max(1.0, d.scrape_interval)), api_key=plan.engine_api_key)
        self.collector.scraper = scraper
        self.collector._spawn("scrape", d.scrape_interval,
                              lambda: self.collector.push_many(records.ENGINE_SERIES, scraper.scrape(time.time())))

    def close(self) -> None:
        self.collector.close(grace_s=1.0 if self.is_driver and self.world_size > 1 else 0.0)


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            try:
                v = float(v.item()) if hasattr(v, "item") else None  # 0-d tensors / numpy scalars
            except (TypeError, ValueError):
                v = None
        if v is not None and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class MetricsTee:
    """The driver's metrics sink, also recording each rollout's record in the dashboard's ``metrics`` stream
    (``step_key`` ``rollout/step``, evaluations ``eval/step``, as Miles logs them)."""

    def __init__(self, sink: Any, collector: Collector) -> None:
        self._sink, self._collector = sink, collector

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self._sink.log(rollout_id, metrics)
        _safe(self._collector.push, records.METRICS,
              records.metrics_record(time.time(), rollout_id, {**_scalars(metrics), "rollout/step": rollout_id}))

    def log_eval(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self._sink.log_eval(rollout_id, metrics)
        _safe(self._collector.push, records.METRICS, records.metrics_record(
            time.time(), rollout_id, {**_scalars(metrics), "eval/step": rollout_id}, step_key="eval/step"))

    def close(self) -> None:
        self._sink.close()


def _safe(fn: Any, *args: Any) -> None:
    global _active
    try:
        fn(*args)
    except Exception as e:  # one warning, then the dashboard is off; the run goes on
        logger.warning("dashboard telemetry turned off for the rest of the run (%s: %s); training goes on",
                       type(e).__name__, e)
        if _active is not None:
            _active.collector.enabled = False
            _active.collector._stop.set()
        _active = None


# ---------------------------------------------------------------------- what the run calls
def start(cfg: MilesConfig, ctx: SPMDContext) -> None:
    global _active
    d = cfg.output.dashboard
    if d is None or _active is not None:
        return
    try:
        w = ctx.world
        node = f"node{ctx.plan.node_of(w.rank)}"
        gpus = [physical_gpu(w.device.index or 0)] if w.device.type == "cuda" else []
        meta = records.meta(cfg.output.wandb_group or "miles-run", time.time(), args_snapshot(cfg))
        gpu = GpuSampler(node) if w.local_rank == 0 else None
        collector = Collector(d, rank=w.rank, primary=ctx.is_driver, meta=meta, gpu=gpu)
        collector.start()
        _active = Dashboard(collector, rank=w.rank, node=node, gpus=gpus, is_trainer=ctx.rank in ctx.plan.trainer_ranks,
                            is_driver=ctx.is_driver, world_size=w.world_size)
        if ctx.is_driver:
            logger.info("miles dashboard: telemetry -> %s | view: python -m miles.dashboard.serve --dump-details %s",
                        d.dashboard_dir, cfg.output.dump_details)
    except Exception as e:
        logger.warning("dashboard telemetry is off (%s: %s); training goes on", type(e).__name__, e)
        _active = None


def attach(job: Any) -> None:
    if _active is not None:
        _safe(_active.attach, job)


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """The driver's loop phase ``name`` (rollout, eval); other names are recorded per rank by ``command``."""
    if _active is None or not _active.is_driver or name not in LOOP_PHASES:
        return contextlib.nullcontext()
    return _active.span(records.PHASE_NAMES[name], records.ROLE_ROLLOUT_MANAGER)


def command(cmd: str | None) -> contextlib.AbstractContextManager[None]:
    """This rank's share of the driver's command ``cmd`` (trainer ranks)."""
    if _active is None:
        return contextlib.nullcontext()
    return _active.command(cmd)


def close() -> None:
    global _active
    if _active is not None:
        dash, _active = _active, None
        try:
            dash.close()
        except Exception as e:
            logger.warning("dashboard: last flush failed (%s: %s)", type(e).__name__, e)
