"""The asynchronous RL loop (``train_async.py``): generation of rollout k+1 overlaps training on rollout k.

As in Miles's ``train_async.py``: rollout k+1 is generated (on the event loop) while the trainer ranks
train on rollout k (in a worker thread on the driver). Every ``--update-weights-interval`` rollouts the
loop first waits for the generation in flight, so weights never change in the middle of a rollout,
then syncs; that prefetched rollout is trained on next. The sync returns once the weights are packed for
sending: the engines receive and load them while the trainer trains on (``WeightSender.sync(detach=True)``,
one-request syncs to embedded engines), and the next generation first waits for their answer
(``perf/wait_weights_time``; the landed sync's transfer, load and total seconds go into that rollout's record as
``weight_sync/landed_*`` with ``weight_sync/landed_rollout_id``, the rollout the sync followed; a sync landed by an eval,
by the next sync or at the end of the run goes in as ``weight_sync/{eval,sync,final}_landed_*``: see
:func:`landed_metrics`). Only the driver
lands, so a sync detaches only where the driver is the weight sender's source rank. Samples are therefore up to
``--update-weights-interval`` weight versions old. Each sample carries the ``weight_version`` the
engine generated it with; with ``--max-weight-staleness N`` groups older than N versions (relative to
the trainer's current version) are dropped (``rollout/stale_dropped_groups``). Off-policy correction
is the trainer's: ``--use-tis`` (truncated importance sampling against the engine's log-probs) or
``--use-rollout-logprobs``. ``--colocate`` is refused (engines and trainer would need the same GPUs at
the same time); see ``miles.config.validate``.

With ``--fully-async`` (Miles's ``FullyAsyncRolloutFn``) rollouts come from a persistent producer that
keeps ``--rollout-batch-size`` groups generating across rollouts and weight updates
(:mod:`miles.rollout.fully_async_rollout`); each rollout drains finished groups. The producer starts no
new groups while the loop evaluates, and is stopped (its requests aborted) when the loop ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from miles.config.data import FULLY_ASYNC_PATH
from miles.rollout.fully_async_rollout import FullyAsyncRollout
from miles.run.loop import RLLoop, dump_samples
from miles.types import Sample
from miles.utils.logging import get_logger

logger = get_logger(__name__)


def detaches(worker: Any, fully_async: bool) -> bool:
    """Whether ``train_async.py``'s weight syncs detach (``WeightSender.sync(detach=True)``): the sync returns once
    the weights are packed, the engines load them while the trainer trains on, and the next generation lands it
    first. Not with the fully async producer (it generates across syncs), nor under fault tolerance (it handles a
    sync's failure at once), nor where the driver, which lands, does not hold the sender's thread: the driver must
    be the weight sender's source rank (trainer rank 0 in every layout ``build_role_plan`` makes; a plain sync
    elsewhere, said once)."""
    if fully_async or worker.ft is not None:
        return False
    sender = worker.sender
    if sender is None:
        return False  # the driver syncs nothing (Ranks.sync_weights)
    if not sender.is_source:
        logger.info("weight syncs do not detach: the driver is not the weight sender's source rank, so it could not "
                    "land them; each sync waits for the engines instead")
        return False
    return True


def landed_metrics(landed: Any, by: str = "") -> dict[str, float]:
    """A landed detached sync's record keys (``WeightSender.take_landed``; None: none), named by who landed it, so that
    two landed syncs in one record never overwrite each other: ``weight_sync/landed_*`` (the generation that followed
    it), ``weight_sync/eval_landed_*`` (an eval), ``weight_sync/sync_landed_*`` (the next sync: no generation came
    between, as before the last sync), ``weight_sync/final_landed_*`` (the last sync, landed before the last record
    is written). Each: ``transfer_s``, ``load_s``, ``total_s``, ``gbps`` and ``rollout_id`` (the rollout it followed)."""
    if landed is None:
        return {}
    m = landed.as_metrics()
    return {f"weight_sync/{by}landed_{k}": m[f"weight_sync/{k}"]
            for k in ("transfer_s", "load_s", "total_s", "gbps", "rollout_id") if f"weight_sync/{k}" in m}


class AsyncRLLoop(RLLoop):
    overlaps_phases = True  # trainer ranks and engines compute at once: they share the cores (miles.spmd.threads)

    def __init__(self, job: Any) -> None:
        super().__init__(job)
        self.interval = max(1, self.cfg.weights.update_weights_interval)
        self.max_staleness = self.cfg.weights.max_weight_staleness
        self._data_state: dict[str, Any] | None = None
        self._tasks: list[asyncio.Future] = []
        self.fully = None
        d = self.cfg.data
        if job.manager is not None and (d.fully_async or d.rollout_function_path == FULLY_ASYNC_PATH):
            self.fully = FullyAsyncRollout(job.manager, job.data_source)
        self.detach = detaches(job.worker, self.fully is not None)
        a = self.cfg.algo
        if self.policy and self.interval > 1 and not (a.use_tis or a.use_rollout_logprobs):
            logger.info("--update-weights-interval %d trains on samples up to %d versions old; consider --use-tis "
                        "(truncated importance sampling against the engine's log-probs)", self.interval, self.interval)

    async def run(self) -> None:
        if not await self.begin():
            return
        start, end = self.plan.start_rollout_id, self.plan.num_rollout
        pending = asyncio.ensure_future(self.generate_overlapped(start))
        try:
            await self._overlapped(start, end, pending)
            await self.land_weights()  # the last sync's failure is the run's
        finally:
            for task in self._tasks:
                task.cancel()  # a failure leaves no generation running into the closing client
            if self.fully is not None:
                await self.fully.close()

    async def _overlapped(self, start: int, end: int, pending: asyncio.Future) -> None:
        ft = self.job.worker.ft
        self._tasks.append(pending)
        for rollout_id in range(start, end):
            if ft is not None:
                ft.check()  # every engine given up: stop, saying why
            t_step = time.monotonic()
            t_wait = time.monotonic()
            with self.job.worker.channel.keepalive():  # the other ranks are idle until the next command
                groups, metrics = await pending
            metrics["perf/wait_rollout_time"] = time.monotonic() - t_wait
            if self.fully is not None:  # prompts still generating or waiting are generated again on resume
                self._data_state = self.fully.data_state()
            else:
                self._data_state = self.job.data_source.state_dict() if self.job.data_source is not None else None
            if rollout_id + 1 < end:
                pending = asyncio.ensure_future(self.generate_overlapped(rollout_id + 1))
                self._tasks.append(pending)
            groups, score_metrics = self.score_async(groups)
            metrics.update(score_metrics)
            metrics.update(await asyncio.to_thread(self.train_step, rollout_id, groups))
            self.maybe_save(rollout_id, metrics)
            if (rollout_id + 1) % self.interval == 0 or rollout_id + 1 == end:
                if rollout_id + 1 < end:
                    with self.job.worker.channel.keepalive():
                        await asyncio.wait([pending])  # no weight change in the middle of a rollout
                metrics.update(await self.sync_weights(detach=self.detach, rollout_id=rollout_id))
                sender = self.job.worker.sender
                if sender is not None:  # the sync landed its predecessor when no generation came between (the last)
                    metrics.update(landed_metrics(sender.take_landed(), "sync_"))
            metrics.update(await self.maybe_eval(rollout_id))
            if rollout_id + 1 == end:  # the last sync lands before the last record is written, which carries it
                metrics.update({k: v for k, v in (await self.land_weights("final_")).items()
                                if k.startswith("weight_sync/final_landed_")})
            metrics.update({k: v for k, v in self.timer.pop().items() if k not in metrics})
            if ft is not None:
                metrics.update(ft.metrics())
            metrics["perf/step_time"] = time.monotonic() - t_step
            self.job.sink.log(rollout_id, metrics)

    async def land_weights(self, by: str = "") -> dict[str, float]:
        """Wait for the engines to answer a detached weight sync; raises its failure. Returns the seconds waited
        (``perf/wait_weights_time``, 0.0 when none was in flight) and what the landed sync measured on its thread
        (``weight_sync/{by}landed_*``: :func:`landed_metrics`)."""
        sender = self.job.worker.sender
        if sender is None or not sender.detached_in_flight:
            return {"perf/wait_weights_time": 0.0}
        metrics = {"perf/wait_weights_time": await asyncio.to_thread(sender.land)}
        metrics.update(landed_metrics(sender.take_landed(), by))
        return metrics

    async def generate_overlapped(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """One rollout, timed on its own (phases overlap, so the shared timer would double count), with the
        weights of the last sync landed first."""
        t0 = time.monotonic()
        landed = await self.land_weights()
        groups, metrics = await self.generate(rollout_id, keepalive=False)
        self.timer.times.pop("perf/rollout_time", None)
        metrics["perf/rollout_time"] = time.monotonic() - t0
        metrics.update(landed)
        return groups, metrics

    async def generate(self, rollout_id: int, keepalive: bool = True) -> tuple[list[list[Sample]], dict[str, float]]:
        if self.fully is None:
            return await super().generate(rollout_id, keepalive)
        with self.timer("rollout"), self.job.worker.channel.keepalive() if keepalive else contextlib.nullcontext():
            groups, metrics = await self.fully.next_rollout(rollout_id)
            if self.job.teacher is not None:  # --opd-type sglang with teacher engines
                from miles.rollout.teacher import fill_teacher_log_probs

                await fill_teacher_log_probs(self.job.teacher, [s for g in groups for s in g],
                                             self.cfg.rollout.rollout_temperature)
        if self.cfg.output.rollout_dump_path:  # --save-debug-rollout-data, or under --dump-details (as loop.py)
            dump_samples(self.cfg.output.rollout_dump_path.format(rollout_id=rollout_id), groups)
        return groups, metrics

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        landed = {k: v for k, v in (await self.land_weights("eval_")).items() if k.startswith("weight_sync/eval_landed_")}
        if self.fully is None:
            return {**await super().evaluate(rollout_id), **landed}
        self.fully.pause()  # no new training groups while the engines evaluate
        try:
            return {**await super().evaluate(rollout_id), **landed}
        finally:
            self.fully.resume()

    def score_async(self, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, float]]:
        groups, metrics = self.score(groups)
        sender = self.job.worker.sender
        current = sender.weight_version if sender is not None else None
        versions = [s.weight_version for g in groups for s in g if s.weight_version is not None]
        if current is not None and versions:
            metrics["rollout/weight_staleness_max"] = float(current - min(versions))
            metrics["rollout/weight_staleness_mean"] = float(current - sum(versions) / len(versions))
        if self.max_staleness is not None and current is not None:
            fresh = [g for g in groups if all(s.weight_version is None or current - s.weight_version <= self.max_staleness
                                              for s in g)]
            metrics["rollout/stale_dropped_groups"] = float(len(groups) - len(fresh))
            groups = fresh
        return groups, metrics

    def checkpoint_extra(self, rollout_id: int, record: dict[str, Any] | None = None) -> dict[str, Any]:
        extra = super().checkpoint_extra(rollout_id, record)
        extra["data_source"] = self._data_state  # the position after rollout k, before k+1 drew its prompts
        return extra
