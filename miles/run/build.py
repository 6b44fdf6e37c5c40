"""Build one run's components on every rank, in an order every rank agrees on.

    run = await build_run(cfg, ctx, overlap=False)    # a Run: plan, worker, and on the driver the rest
    ...
    await run.close()                                   # on every exit path

Order: the driver resolves the plan (data size, output dir, engine kind, API key) and broadcasts it
(a driver-side error travels in the same message, so no rank waits for a plan that will not come);
every rank logs to ``<output-dir>/logs/rank<r>.log``; engine leaders start their engines; trainer
ranks build the trainer of --train-backend (``miles.trainer.build``) and resume from ``--load`` (default ``--save``) if a complete checkpoint
exists; the driver waits for the engines, starts the router and connects the weight sender; the
other ranks follow the driver's commands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.base import ConfigError
from miles.ft.launcher import LauncherHeartbeat
from miles.run.control import CommandChannel, all_gather_json, broadcast_json
from miles.run.fleet import Fleet, Placement, connect_fleet, place_engines
from miles.run.metrics import NullSink, build_sink, default_output_dir
from miles.run.progress import Progress
from miles.run.resolve import RunPlan, resolve_run
from miles.run.worker import Ranks, Worker
from miles.spmd.errors import MilesError
from miles.utils.logging import configure_logging, get_logger

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.spmd import SPMDContext
    from miles.spmd.threads import CpuThreads

logger = get_logger(__name__)


@dataclass
class Run:
    """Everything a loop needs. Driver-only fields are None elsewhere."""

    cfg: MilesConfig
    ctx: SPMDContext
    plan: RunPlan
    worker: Worker
    ranks: Ranks | None = None
    fleet: Fleet | None = None
    manager: Any = None
    sft: Any = None
    data_source: Any = None
    eval_datasets: dict[str, Any] = field(default_factory=dict)
    sink: Any = field(default_factory=NullSink)
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    resume_extra: dict[str, Any] | None = None
    teacher: Any = None  # EngineClient of the OPD teacher engines (--opd-type sglang), driver only
    eval_fn: Any = None  # --eval-function-path's runner (miles.rollout.eval_fn.EvalFunction), driver only

    @property
    def timeout(self) -> float:
        return self.cfg.cluster.distributed_timeout_minutes * 60.0

    async def close(self) -> None:
        """Release everything this rank holds (engines, router, sender, sinks); safe to call twice."""
        self.progress.close()
        if self.manager is not None:
            await self.manager.aclose()
            self.manager = None
        if self.teacher is not None:
            await self.teacher.close()
            self.teacher = None
        if self.fleet is not None:
            await self.fleet.close()
            self.fleet = None
        self.worker.close()
        self.sink.close()


def _driver_plan(cfg: MilesConfig, ctx: SPMDContext) -> tuple[RunPlan, dict[str, Any]]:
    """Driver: start-up checks, tokenizer, data, derived values. Returns the plan and driver-only objects."""
    from miles.fleet.engines import resolve_api_key, resolve_engine_kind
    from miles.rollout.data import DataSource, load_eval_datasets
    from miles.run.preflight import check_engine_kind, check_micro_batch_budget, preflight
    from miles.utils.model_dir import load_tokenizer

    if not cfg.train.hf_checkpoint:
        raise MilesError("--hf-checkpoint DIR is required (a local HF model directory: weights, config, tokenizer).")
    preflight(cfg, has_engines=bool(ctx.plan.engines))  # what --dry-run checks: paths, plugins, --save, backend
    # the one tokenizer of the driver's templating: data, eval data, SFT conversations, plugins (args.tokenizer)
    tokenizer = load_tokenizer(cfg.train.hf_checkpoint, "--hf-checkpoint",
                               chat_template_path=cfg.data.chat_template_path)
    seed = cfg.rollout.rollout_seed
    dataset = data_source = None
    if cfg.data.prompt_data:
        from miles.rollout.rollout_fn import build_prompt_dataset

        dataset = build_prompt_dataset(cfg.data, tokenizer, seed)
        check_micro_batch_budget(cfg, dataset)  # --use-dynamic-batch-size: every prompt fits a micro-batch
        data_source = DataSource(dataset, shuffle=cfg.data.rollout_shuffle, seed=seed)
    elif not cfg.cluster.debug_train_only:
        raise MilesError("--prompt-data FILE is required (JSONL or Parquet with prompts under --input-key).")
    from miles.config.eval_datasets import resolve_eval_datasets

    eval_specs = resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout)  # --eval-config or --eval-prompt-data
    eval_datasets = load_eval_datasets(eval_specs, cfg.eval, cfg.data, tokenizer, seed)
    has_engines = bool(ctx.plan.engines)
    kind = resolve_engine_kind(cfg.rollout, ctx.world.device.type == "cuda") if has_engines else "none"
    check_engine_kind(cfg, kind)  # what auto chose takes the flags (p2p, the --sglang-* flags it honours)
    api_key = resolve_api_key(cfg.rollout, ctx.world.num_nodes) if has_engines else None
    out_dir = str(default_output_dir(cfg.output))
    plan = resolve_run(cfg, num_prompts=len(dataset) if dataset is not None else None, output_dir=out_dir,
                       world_size=ctx.world.world_size, engine_kind=kind, engine_api_key=api_key)
    return plan, {"tokenizer": tokenizer, "data_source": data_source, "eval_datasets": eval_datasets}


def _share_plan(cfg: MilesConfig, ctx: SPMDContext, timeout: float) -> tuple[RunPlan, dict[str, Any]]:
    """Driver computes, everyone receives; an error on the driver fails every rank with its message."""
    group, src = ctx.groups.control_group, ctx.plan.driver_rank
    if ctx.is_driver:
        try:
            plan, local = _driver_plan(cfg, ctx)
        except Exception as e:
            broadcast_json({"error": f"{type(e).__name__}: {e}"}, group, src, timeout)
            raise
        broadcast_json({"plan": plan.to_dict()}, group, src, timeout)
        return plan, local
    msg = broadcast_json(None, group, src, timeout)
    if "error" in msg:
        raise MilesError(f"the driver (rank {src}) failed during setup: {msg['error']}")
    return RunPlan.from_dict(msg["plan"]), {}


def _share_cpu_threads(ctx: SPMDContext, *, overlap: bool, timeout: float,
                       train_env_vars: dict[str, str] | None = None) -> CpuThreads:
    """Every rank's usable CPUs (one all-gather over the control group), then this rank's thread counts
    (``miles.spmd.threads``; the driver logs the job's); a bad ``OMP_NUM_THREADS`` on any rank fails every rank
    with its line."""
    from miles.spmd.threads import (
        cpu_ranges,
        describe_threads,
        parse_cpu_ranges,
        plan_threads,
        usable_cpus,
        user_omp_threads,
    )

    try:
        fixed, err = user_omp_threads(train_env_vars=train_env_vars), None
    except ConfigError as e:
        fixed, err = None, str(e)
    rows = all_gather_json({"cpus": cpu_ranges(usable_cpus()), "error": err}, ctx.groups.control_group, timeout)
    bad = next(((r, row["error"]) for r, row in enumerate(rows) if row["error"]), None)
    if bad is not None:
        raise ConfigError(bad[1] if bad[0] == ctx.rank else f"rank {bad[0]}: {bad[1]}")
    cpus = [parse_cpu_ranges(row["cpus"]) for row in rows]
    if ctx.is_driver:
        every = [plan_threads(ctx.plan, r, cpus, overlap=overlap, fixed=fixed) for r in range(ctx.plan.world_size)]
        logger.info("%s", describe_threads(ctx.plan, every))
    return plan_threads(ctx.plan, ctx.rank, cpus, overlap=overlap, fixed=fixed)


def _write_config(cfg: MilesConfig, plan: RunPlan, out_dir: Path) -> None:
    resolved = cfg.to_dict()
    resolved["run_plan"] = {k: v for k, v in plan.to_dict().items() if k != "engine_api_key"}
    for section in resolved.values():  # never write secrets
        if isinstance(section, dict) and section.get("sglang_api_key"):
            section["sglang_api_key"] = "***"
    (out_dir / "config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True, default=str))


def _build_sender(cfg: MilesConfig, ctx: SPMDContext, trainer: Any, placement: Placement, version: int,
                  api_key: str | None) -> Any:
    from miles.config.sglang import serves_lora_adapters
    from miles.fleet.engines import engine_host
    from miles.trainer.hf_export import weight_sync_dtype
    from miles.weight_sync.base import EngineTarget, build_weight_sender, resolve_mode

    targets = [EngineTarget(url=u, num_workers=n, engine_id=i, api_key=api_key)
               for i, (u, n) in enumerate(zip(placement.urls, placement.num_workers))]
    mode = resolve_mode(cfg.weights, ctx.plan.colocate)
    kwargs: dict[str, Any] = {"device": ctx.world.device}
    if mode in ("broadcast", "p2p"):
        kwargs["master_addr"] = engine_host(ctx.world.num_nodes)
    elif mode == "disk-delta":
        kwargs = {"model_dir": cfg.train.hf_checkpoint}
    is_source = ctx.rank == ctx.plan.trainer_ranks[0]  # trainer rank 0 holds the full tensors and posts them
    return build_weight_sender(cfg.weights, trainer, colocate=ctx.plan.colocate,
                               is_source=is_source, engines=targets if is_source else [],
                               dtype=weight_sync_dtype(cfg.train.hf_checkpoint, cfg.sglang.server_args.get("dtype")),
                               initial_version=version, lora_adapter=serves_lora_adapters(cfg.train, cfg.sglang),
                               status_group=ctx.groups.trainer_group, **kwargs)


async def build_run(cfg: MilesConfig, ctx: SPMDContext, *, overlap: bool = False) -> Run:
    """``overlap``: the loop trains while it generates (``train_async.py``), which decides the CPU threads."""
    timeout = cfg.cluster.distributed_timeout_minutes * 60.0
    plan, local = _share_plan(cfg, ctx, timeout)
    out_dir = Path(plan.output_dir)
    from miles.spmd import role_label

    configure_logging(rank=ctx.rank, role=role_label(ctx.roles), log_dir=out_dir / "logs", level=cfg.output.log_level)
    if ctx.is_driver:
        _write_config(cfg, plan, out_dir)
        logger.info("output dir %s (config.json, metrics.jsonl, logs/)", out_dir)
    threads = _share_cpu_threads(ctx, overlap=overlap, timeout=timeout, train_env_vars=cfg.train.train_env_vars)
    if ctx.is_trainer:
        import torch

        torch.set_num_threads(threads.trainer)  # before the trainer's first op (and its threads' first parallel op)
    channel = CommandChannel(ctx.groups.control_group, ctx.plan.driver_rank, timeout)
    progress = Progress(enabled=ctx.is_driver and not cfg.output.no_progress)
    placement = (place_engines(cfg, ctx, kind=plan.engine_kind, api_key=plan.engine_api_key, out_dir=out_dir,
                               timeout=timeout, threads=threads.engine if threads.source == "phases" else None)
                 if ctx.plan.engines else None)
    trainer = extra = None
    worker = Worker(ctx, channel, timeout=timeout, placement=placement, progress=progress)
    worker.heartbeat = LauncherHeartbeat.from_env()  # under ft_launcher: a hung rank is restarted sooner
    run = Run(cfg=cfg, ctx=ctx, plan=plan, worker=worker, progress=progress)
    if cfg.ft.use_fault_tolerance:  # --use-fault-tolerance: lighthouse (driver), engine heartbeats (leaders)
        from miles.ft.integration import FaultTolerance

        group, src = ctx.groups.control_group, ctx.plan.driver_rank
        worker.ft = FaultTolerance.for_run(cfg.ft, ctx, placement, lambda v: broadcast_json(v, group, src, timeout),
                                           engine_startup_timeout=cfg.rollout.engine_startup_timeout)
    try:
        if ctx.is_trainer:
            from miles.trainer.build import build_run_trainer

            trainer = worker.trainer = build_run_trainer(cfg, ctx, plan)
            if progress.enabled:
                trainer.optimizer.register_step_post_hook(lambda *_: progress.step())
            try:
                extra = trainer.resume()
            except ValueError as e:  # a user mistake (--load): one line, not a traceback
                raise MilesError(str(e)) from e
        if ctx.is_driver:
            await _driver_setup(run, local, extra, channel, placement)
        if ctx.is_trainer and placement is not None:
            version = int((extra or {}).get("weight_version", 0))
            worker.sender = _build_sender(cfg, ctx, trainer, placement, version, plan.engine_api_key)
            if ctx.is_driver and run.fleet is not None:
                worker.sender.connect(run.fleet.targets)
    except BaseException as e:
        if ctx.is_driver:
            channel.abort(f"setup failed: {type(e).__name__}: {e}")
        await run.close()
        raise
    return run


def _restorable_record(extra: dict[str, Any] | None) -> dict[str, float] | None:
    """The metrics record a checkpoint of this project keeps for its rollout (``RLLoop.maybe_save``)."""
    rec = (extra or {}).get("metrics_record")
    if not isinstance(rec, dict) or "rollout_id" not in extra:
        return None
    return {**rec, "rollout_id": float(extra["rollout_id"])}


def plugin_extra(cfg: MilesConfig, eval_datasets: dict[str, Any] | None = None) -> dict[str, Any]:
    """What plugins read beyond the flag sections: Miles's ``args.sglang_<field>`` and ``args.router_<field>`` views
    of the SGLang and sglang-router flags, ``args.eval_datasets`` (each evaluation dataset's resolved spec, as
    Miles's list of ``EvalDatasetConfig``) and the ``--custom-config-path`` keys that name no flag."""
    from miles.config.router import miles_attrs

    specs = [getattr(d, "spec", d) for d in (eval_datasets or {}).values()]
    return {**cfg.sglang.miles_attrs(), **miles_attrs(cfg.rollout), "eval_datasets": specs, **cfg.custom_config}


async def _driver_setup(run: Run, local: dict[str, Any], extra: dict[str, Any] | None, channel: CommandChannel,
                        placement: Placement | None) -> None:
    cfg, plan = run.cfg, run.plan
    run.data_source, run.eval_datasets = local["data_source"], local["eval_datasets"]
    run.resume_extra = extra
    if extra:
        plan.start_rollout_id = int(extra.get("next_rollout_id", int(extra["rollout_id"]) + 1))
        if run.data_source is not None and extra.get("data_source"):
            run.data_source.load_state_dict(extra["data_source"])
        elif run.data_source is not None and extra.get("miles_data_state"):  # a Miles checkpoint's data position
            m = extra["miles_data_state"]
            run.data_source.load_state_dict({**run.data_source.state_dict(), "epoch": int(m["epoch_id"]),
                                             "offset": int(m["sample_offset"]), "buffer": []})
        logger.info("resuming at rollout %d (checkpoint of rollout %s)", plan.start_rollout_id, extra.get("rollout_id"))
    run.sink = build_sink(cfg.output, Path(plan.output_dir), enabled=True, config=cfg.to_dict(),
                          num_rollout=plan.num_rollout, start_rollout_id=plan.start_rollout_id,
                          restore=_restorable_record(extra))
    run.ranks = Ranks(run.worker)
    from miles.config.data import custom_rollout_path
    from miles.rollout.rollout_fn import build_rollout_function

    if cfg.algo.loss_type == "sft_loss" and custom_rollout_path(cfg.data) is None:
        from miles.run.sft import SFTSource

        run.sft = SFTSource(run.data_source, local["tokenizer"], cfg.data)
    if placement is not None:
        with channel.keepalive():
            run.fleet = await connect_fleet(cfg, placement, api_key=plan.engine_api_key, out_dir=Path(plan.output_dir),
                                            num_nodes=run.ctx.world.num_nodes)
        from miles.rollout.manager import RolloutManager

        client = run.fleet.client
        if run.worker.ft is not None:  # routing follows engine health; failed requests wait for an engine
            with channel.keepalive():
                run.worker.ft.start_recovery(targets=run.fleet.targets, router_url=run.fleet.router_url,
                                             api_key=plan.engine_api_key, client=client,
                                             events_path=str(Path(plan.output_dir) / "ft_events.jsonl"),
                                             await_first_sync=run.ctx.is_trainer)  # the driver syncs first
            client = run.worker.ft.wrap_client(client)
        run.manager = RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, local["tokenizer"],
                                     run.data_source, eval_cfg=cfg.eval,
                                     sections=(cfg.algo, cfg.train, cfg.cluster, cfg.weights, cfg.checkpoint),
                                     custom_config=plugin_extra(cfg, run.eval_datasets),
                                     # one n-sample request per group: the embedded engine seeds its samples
                                     # sampling_seed + j (the same samples); the FT client reissues per request
                                     group_requests=plan.engine_kind == "embedded" and run.worker.ft is None)
        from miles.rollout.on_policy_distillation import is_named_map

        if cfg.algo.use_opd and cfg.algo.opd_type == "sglang" and cfg.algo.opd_teacher_urls and not is_named_map(
                cfg.algo.opd_teacher_urls):  # plain URLs: teacher engines; else Miles's --custom-rm-path reward_func
            from miles.rollout.teacher import teacher_client

            r = cfg.rollout
            run.teacher = teacher_client(cfg.algo.opd_teacher_urls, api_key=r.sglang_api_key,
                                         timeout=r.rollout_request_timeout, max_retries=r.rollout_request_retries,
                                         concurrency=r.sglang_server_concurrency)
    if run.manager is not None:  # --eval-function-path: the user's function produces the evaluation results
        from miles.rollout.eval_fn import build_eval_function

        manager, datasets = run.manager, run.eval_datasets
        run.eval_fn = build_eval_function(cfg, run.data_source, local["tokenizer"], client=manager.client,
                                          router_url=run.fleet.router_url if run.fleet is not None else None,
                                          builtin=lambda rid: manager.evaluate_data(datasets, rid),
                                          extra=plugin_extra(cfg, run.eval_datasets))
    if custom_rollout_path(cfg.data) is not None:  # --rollout-function-path: the user's function makes the rollouts
        run.sft = build_rollout_function(cfg, run.data_source, local["tokenizer"],
                                         client=run.manager.client if run.manager is not None else None)
