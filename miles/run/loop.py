"""The synchronous RL loop (``train.py``), run by the driver; the other ranks follow its commands.

Per rollout: health (drop dead engines) -> generate (or, for ``--loss-type sft_loss``, read the
demonstrations) -> score (keep trainable samples, reward statistics) -> train_step (scatter groups to the
trainer ranks, one ``FSDPTrainer.train``) -> maybe_save -> sync_weights -> maybe_eval, each phase timed
(``perf/<phase>_time``, ``miles.run.metrics.STEP_PHASES``; what none covers is ``perf/other_time``, so the
phases add up to ``perf/step_time``), then one metrics record. Colocated runs release engine memory while the
trainer works and offload the trainer while engines generate (``--offload-train``/``--offload-rollout``).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles.dashboard import hooks as dashboard
from miles.run.metrics import add_residuals
from miles.spmd.errors import MilesError
from miles.types import Sample, SampleStatus
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.run.build import Run

logger = get_logger(__name__)

TRAINABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


class PhaseTimer:
    """``with timer("rollout"): ...`` records ``perf/rollout_time`` (seconds) for the current rollout."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            with dashboard.phase(phase):  # --use-miles-dashboard: the rollout / eval phase events
                yield
        finally:
            self.times[f"perf/{phase}_time"] = self.times.get(f"perf/{phase}_time", 0.0) + time.monotonic() - t0

    def pop(self) -> dict[str, float]:
        out = {k: 0.0 for k in ("perf/rollout_time", "perf/train_time", "perf/update_weights_time")}
        out.update(self.times)
        self.times = {}
        return out


def trainable_groups(groups: list[list[Sample]], policy: bool) -> tuple[list[list[Sample]], dict[str, float]]:
    """Drop samples that cannot be trained on (failed, aborted, empty, no reward); drop emptied groups."""
    kept: list[list[Sample]] = []
    dropped = 0
    for g in groups:
        ok = [s for s in g if s.status in TRAINABLE and s.response_length > 0 and (s.reward is not None or not policy)]
        dropped += len(g) - len(ok)
        if ok:
            kept.append(ok)
    rewards = [float(s.reward) for g in kept for s in g if s.reward is not None]
    metrics = {"rollout/dropped_samples": float(dropped), "rollout/num_groups": float(len(kept))}
    if rewards:
        mean = sum(rewards) / len(rewards)
        metrics["rollout/reward_std"] = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        metrics["rollout/zero_std_groups"] = float(sum(1 for g in kept if len({s.reward for s in g}) == 1))
    return kept, metrics


def dump_samples(path: str, groups: list[list[Sample]]) -> None:
    """``--save-debug-rollout-data``: one JSON object per sample (text, ids, reward, status, version)."""
    import json
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for g in groups:
            for s in g:
                f.write(json.dumps({"rollout_id": s.rollout_id, "group_index": s.group_index, "index": s.index,
                                    "prompt": s.prompt, "response": s.response, "label": s.label, "reward": s.reward,
                                    "status": s.status.value, "weight_version": s.weight_version,
                                    "response_length": s.response_length, "tokens": s.tokens}, default=str) + "\n")


class RLLoop:
    """Components are injected through ``run``; the loop holds no other state than counters."""

    overlaps_phases = False  # generation and training take turns: each gets the node's cores (miles.spmd.threads)

    def __init__(self, job: Run) -> None:
        self.job, self.cfg, self.plan = job, job.cfg, job.plan
        self.ranks = job.ranks
        self.timer = PhaseTimer()
        self.policy = self.cfg.algo.loss_type != "sft_loss"
        self.has_trainer = bool(job.ctx.plan.trainer_ranks)

    async def begin(self) -> bool:
        """Before the first rollout (both loops): False when the checkpoint is already at --num-rollout (nothing to
        do, said in the log); else the first weight sync (``initial_sync``) and, from rollout 0, the evaluation
        before training (unless --skip-eval-before-train)."""
        start, end = self.plan.start_rollout_id, self.plan.num_rollout
        if start >= end:
            logger.info("nothing to do: the checkpoint is at rollout %d of %d", start - 1, end)
            return False
        await self.initial_sync()
        self.timer.pop()
        if start == 0 and not self.cfg.eval.skip_eval_before_train and self.job.eval_datasets:
            self.job.sink.log_eval(start, await self.evaluate(start))
        return True

    async def run(self) -> None:
        if not await self.begin():
            return
        start, end = self.plan.start_rollout_id, self.plan.num_rollout
        ft = self.job.worker.ft
        for rollout_id in range(start, end):
            t_step = time.monotonic()
            with self.timer("health"):
                if ft is not None:
                    ft.check()  # every engine given up: stop, saying why
                elif self.job.fleet is not None:
                    await self.job.fleet.prune_dead_if_due()  # a dead engine leaves the router even without FT
            groups, metrics = await self.generate(rollout_id)
            with self.timer("score"):
                groups, score_metrics = self.score(groups)
            metrics.update(score_metrics)
            metrics.update(self.train_step(rollout_id, groups))
            self.maybe_save(rollout_id, metrics)
            metrics.update(await self.sync_weights())
            metrics.update(await self.maybe_eval(rollout_id))
            metrics.update(self.timer.pop())
            if ft is not None:
                metrics.update(ft.metrics())  # ft/engine_restarts, ft/requests_retried, ft/recovery_time_s
            metrics["perf/step_time"] = time.monotonic() - t_step
            self.job.sink.log(rollout_id, add_residuals(metrics))  # perf/other_time: the step minus its phases

    # ------------------------------------------------------------------ steps
    async def generate(self, rollout_id: int, keepalive: bool = True) -> tuple[list[list[Sample]], dict[str, float]]:
        job = self.job
        with self.timer("rollout"):
            if job.sft is not None:  # SFT data, or a --rollout-function-path function (async)
                with job.worker.channel.keepalive() if keepalive else contextlib.nullcontext():
                    out = job.sft.next_rollout(rollout_id)
                    groups, metrics = (await out) if inspect.isawaitable(out) else out
            else:
                if job.manager is None:
                    raise MilesError("RL training needs rollout engines, but this run has none (--debug-train-only): "
                                     "use --loss-type sft_loss, or drop --debug-train-only.")
                total = job.cfg.data.rollout_batch_size * job.cfg.data.n_samples_per_prompt
                job.manager.progress = job.progress.generation(rollout_id, total)
                try:
                    with job.worker.channel.keepalive() if keepalive else contextlib.nullcontext():
                        result = await job.manager.generate_rollout(rollout_id)
                finally:
                    job.progress.end_generation()
                groups, metrics = result.samples, dict(result.metrics)
                if job.teacher is not None:  # --opd-type sglang: the teacher scores the exact tokens
                    from miles.rollout.teacher import fill_teacher_log_probs

                    t0 = time.monotonic()
                    await fill_teacher_log_probs(job.teacher, [s for g in groups for s in g],
                                                 self.cfg.rollout.rollout_temperature)
                    metrics["perf/teacher_time"] = time.monotonic() - t0
        if self.has_trainer and self.plan.offload_rollout and job.fleet is not None:
            await job.fleet.call_all("release_memory_occupation")
        if self.cfg.output.rollout_dump_path:  # --save-debug-rollout-data, or under --dump-details
            dump_samples(self.cfg.output.rollout_dump_path.format(rollout_id=rollout_id), groups)
        return groups, metrics

    def score(self, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, float]]:
        return trainable_groups(groups, self.policy)

    def train_step(self, rollout_id: int, groups: list[list[Sample]]) -> dict[str, float]:
        if not self.has_trainer:
            return {}
        if len(groups) < self.ranks.dp_size:
            raise MilesError(f"rollout {rollout_id}: only {len(groups)} trainable group(s) for {self.ranks.dp_size} "
                             "trainer ranks (generation or reward failures dropped the rest; see the log).")
        with self.timer("train"):
            if self.plan.offload_train:
                self.ranks.onload_train()
            self.job.progress.training(rollout_id, self.plan.num_steps_per_rollout)
            try:
                metrics = self.ranks.train(rollout_id, groups)
            finally:
                self.job.progress.end_training()
            if self.plan.offload_train:
                self.ranks.offload_train()
        return metrics

    async def initial_sync(self) -> None:
        """Engines get the trainer's weights (a resumed checkpoint's too), and only then join the router:
        an engine is routed to once healthy and current (with --use-fault-tolerance the recovery controller
        admits each engine after this sync instead)."""
        await self.sync_weights()
        if self.job.fleet is not None and self.job.worker.ft is None:
            await self.job.fleet.register()

    async def sync_weights(self, detach: bool = False, rollout_id: int | None = None) -> dict[str, float]:
        """``detach``: see ``WeightSender.sync`` (``train_async.py`` lands the sync before it generates again);
        ``rollout_id``: the rollout whose training made these weights."""
        if self.job.fleet is None or not self.has_trainer:
            return {}
        with self.timer("update_weights"):
            if self.plan.offload_rollout:
                await self.job.fleet.call_all("resume_memory_occupation")
            return self.ranks.sync_weights(detach, rollout_id)

    def maybe_save(self, rollout_id: int, metrics: dict[str, Any] | None = None) -> None:
        """Checkpoint after training. ``metrics``: the rollout's record so far (generation, score, train and
        their timings), kept in the checkpoint: the full record is written after the weight sync and eval, and
        a run killed before that restores this one on resume (``metrics.restore_record``), so no checkpointed
        rollout is missing from metrics.jsonl."""
        from miles.trainer.checkpoint.cadence import should_save

        if not self.has_trainer or not should_save(self.cfg.checkpoint, rollout_id, self.plan.num_rollout):
            return
        record = None if metrics is None else {**self.timer.times, **metrics}
        with self.timer("save"):
            self.ranks.save(rollout_id, self.checkpoint_extra(rollout_id, record))

    def checkpoint_extra(self, rollout_id: int, record: dict[str, Any] | None = None) -> dict[str, Any]:
        ds = self.job.data_source
        sender = self.job.worker.sender
        extra = {"rollout_id": rollout_id, "next_rollout_id": rollout_id + 1,
                 "data_source": ds.state_dict() if ds is not None else None,
                 "weight_version": sender.weight_version if sender is not None else 0}
        if record is not None:
            extra["metrics_record"] = {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}
        return extra

    async def maybe_eval(self, rollout_id: int) -> dict[str, float]:
        ev = self.cfg.eval
        last = rollout_id + 1 >= self.plan.num_rollout
        if not ev.eval_interval or not ((rollout_id + 1) % ev.eval_interval == 0 or last):
            return {}
        return await self.evaluate(rollout_id)

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        job = self.job
        if not job.eval_datasets or job.manager is None:
            return {}
        with self.timer("eval"), job.worker.channel.keepalive():
            if job.eval_fn is not None:  # --eval-function-path
                return await job.eval_fn.evaluate(rollout_id)
            return await job.manager.evaluate(job.eval_datasets, rollout_id)

