"""What ``train.py`` and ``train_async.py`` share: the SPMD dispatch and ``--dry-run``.

    await run_job(cfg, RLLoop)    # every rank: bootstrap, build, driver loops / others follow, close

The driver (global rank 0) runs the loop and finally sends ``stop``; every other rank follows the
driver's commands. On any failure the driver tells ranks that wait for a command why the run stops,
and every rank releases what it holds (engines, router, sinks: the plot is written even then).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.config import MilesConfig

logger = get_logger(__name__)


def apply_train_env_vars(env: dict[str, str]) -> None:
    """--train-env-vars: set in this rank's environment (engine processes it starts inherit them)."""
    if env:
        import os

        os.environ.update(env)
        logger.info("--train-env-vars set %s", ", ".join(sorted(env)))


async def run_job(cfg: MilesConfig, loop_cls: Any) -> None:
    from miles.spmd.threads import default_openmp_env

    apply_train_env_vars(cfg.train.train_env_vars)  # before torch.distributed and the first CUDA allocation
    default_openmp_env()  # before torch loads libgomp (the imports below): OpenMP threads spin ~0.1 ms, not ~3.5
    from miles.dashboard import hooks as dashboard
    from miles.run.build import build_run
    from miles.run.liveness import Liveness, name_silent_ranks
    from miles.spmd import bootstrap

    ctx = bootstrap(cfg)
    dashboard.start(cfg, ctx)  # --use-miles-dashboard: this rank's telemetry collector (a no-op without it)
    beat = Liveness.start(ctx.world.rank, ctx.world.world_size)  # after a timeout: which rank went silent
    try:
        job = await build_run(cfg, ctx, overlap=getattr(loop_cls, "overlaps_phases", False))
    except BaseException:
        dashboard.close()  # its last flush: what it has recorded of the start-up
        raise
    dashboard.attach(job)
    try:
        if ctx.is_driver:
            await loop_cls(job).run()
            job.worker.close_sender()  # while the engines are still up
            if job.worker.ft is not None:  # stop following engine health before the engines stop
                job.worker.ft.close()
                job.worker.ft = None
            job.ranks.stop()
        else:
            job.worker.follow()
    except BaseException as e:
        from miles.spmd import signals
        from miles.spmd.errors import format_error, is_known_error

        interrupted = isinstance(e, KeyboardInterrupt | asyncio.CancelledError)  # Ctrl-C: every rank got it
        if is_known_error(e):  # the launcher may SIGTERM us while we clean up: this is still our one line
            signals.note_failure(format_error(e))
        if interrupted:
            logger.info("interrupted (SIGINT) on rank %d; stopping", ctx.rank)  # run_main prints the one error line
        else:
            logger.error("run failed on rank %d: %s: %s", ctx.rank, type(e).__name__, e,  # a traceback only for bugs
                         exc_info=not is_known_error(e))
        if ctx.is_driver:
            job.sink.close()  # finished rollouts' metrics and the plot first: the launcher may end us soon
        named = name_silent_ranks(e, beat)  # a timed-out collective: which rank went silent (a few seconds)
        if named is not e:
            logger.error("%s", named)
            signals.note_failure(format_error(named))
        if ctx.is_driver and not interrupted:  # an interrupted follower is not waiting for a command
            job.worker.channel.abort(f"{type(e).__name__}: {named}")
        if named is not e:
            raise named from e
        raise
    finally:
        if beat is not None:
            beat.close()
        dashboard.close()
        await job.close()
    ctx.close()
    logger.info("done")


def expected_world_size(cfg: MilesConfig) -> int:
    """The world size the flags ask for (what to pass to torchrun / mpirun / srun)."""
    c = cfg.cluster
    actor = c.actor_num_nodes * c.actor_num_gpus_per_node
    if c.debug_train_only or c.colocate:
        return actor
    if c.debug_rollout_only:
        return c.rollout_num_gpus or 1
    if c.rollout_num_gpus is None:
        from miles.config.base import ConfigError

        raise ConfigError("--dry-run of a disaggregated plan needs --rollout-num-gpus R (or a launcher's WORLD_SIZE).")
    return actor + c.rollout_num_gpus


def dry_run(cfg: MilesConfig) -> str:
    """Parse, validate, build the role plan, run the start-up checks (``miles.run.preflight``: paths, plugins,
    outputs, backend checks) and derive the run's values; the text to print. Starts nothing."""
    from miles.run.metrics import default_output_dir
    from miles.run.preflight import check_engine_kind, check_micro_batch_budget, preflight
    from miles.run.resolve import resolve_run
    from miles.spmd.roles import build_role_plan
    from miles.spmd.world import read_launch_env

    launch = read_launch_env()
    world_size = launch.world_size if launch.launcher != "single" else expected_world_size(cfg)
    plan = build_role_plan(cfg.cluster, world_size)
    preflight(cfg, has_engines=bool(plan.engines))  # the checks the real start makes before loading anything
    kind = cfg.rollout.rollout_engine
    if plan.engines:  # the engine the start would pick here (auto: SGLang with a GPU and SGLang importable)
        import torch

        from miles.fleet.engines import resolve_engine_kind

        kind = resolve_engine_kind(cfg.rollout, torch.cuda.is_available())
        check_engine_kind(cfg, kind)
    num_prompts = None
    if cfg.data.prompt_data and cfg.train.hf_checkpoint:
        from miles.rollout.rollout_fn import build_prompt_dataset
        from miles.utils.model_dir import load_tokenizer

        tokenizer = load_tokenizer(cfg.train.hf_checkpoint, "--hf-checkpoint",
                                   chat_template_path=cfg.data.chat_template_path)
        dataset = build_prompt_dataset(cfg.data, tokenizer, seed=cfg.rollout.rollout_seed)
        check_micro_batch_budget(cfg, dataset)  # as the start does, once the prompts are tokenized
        num_prompts = len(dataset)
    run_plan = None
    if cfg.data.num_rollout is not None or cfg.data.num_epoch is not None:
        run_plan = resolve_run(cfg, num_prompts=num_prompts, output_dir=str(default_output_dir(cfg.output)),
                               world_size=world_size, engine_kind=kind)
    lines = [plan.describe(), "", "resolved config:", cfg.to_json()]
    if run_plan is not None:
        import json

        lines += ["", "run plan:", json.dumps(run_plan.to_dict(), indent=2)]
    return "\n".join(lines)
