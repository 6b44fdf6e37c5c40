"""Fully asynchronous rollout (``train_async.py --fully-async``; Miles's ``FullyAsyncRolloutFn``).

A persistent producer keeps ``--rollout-batch-size`` prompt groups generating, across rollout
boundaries and weight updates, and at most one more rollout's worth finished and waiting (so memory and
staleness stay bounded when training is the slower side); each training rollout drains
``--rollout-batch-size`` finished groups (in finishing order, then sorted by launch order). Generation and training
then run side by side, so a step takes about max(generation, training) instead of their sum.

    fa = FullyAsyncRollout(manager, data_source)
    groups, metrics = await fa.next_rollout(rollout_id)   # the first call starts the producer
    state = fa.data_state()                               # data position, unfinished prompts given back
    await fa.close()                                      # aborts what is still generating

A weight update pauses the engines with ``--pause-generation-mode`` (``retract`` or ``in_place``:
``abort`` would throw away every update's in-flight work and is refused, as in Miles) and generation
continues under the new weights, so a sample may span weight versions; its ``weight_version`` is the
oldest one it saw, which ``--max-weight-staleness`` compares. Groups the
``--dynamic-sampling-filter-path`` drops are counted (``rollout/dynamic_filter/drop_<reason>``) and
not trained on; ``--custom-reward-post-process-path`` runs on each drained rollout. While the loop
evaluates, the producer starts no new groups. Resuming from a checkpoint generates again the prompts
that were still generating or waiting when it was saved.

``--rollout-function-path miles.rollout.fully_async_rollout.FullyAsyncRolloutFn`` selects the same.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from miles.rollout.filters import call_filter
from miles.rollout.generate import build_sampling_params
from miles.types import Sample, SampleStatus
from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

NO_PROGRESS_WARN_SECS = 60.0


class FullyAsyncRolloutFn:
    """Miles's class name for the fully async rollout; naming it selects :class:`FullyAsyncRollout`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise MilesError("FullyAsyncRolloutFn names the fully async rollout of train_async.py (--fully-async); it is "
                         "selected by --rollout-function-path, not constructed.")


class FullyAsyncRollout:
    """The producer (a task on the driver's event loop) and the per-rollout drain; see the module docstring.

    It runs groups with the rollout manager's own machinery (its group, sample and abort steps), so
    generation, rewards, retries and accounting are the manager's.
    """

    def __init__(self, manager: Any, data_source: Any, max_in_flight: int | None = None) -> None:
        self.m, self.data_source = manager, data_source
        self.n = manager.data.n_samples_per_prompt
        self.max_in_flight = max_in_flight or manager.batch
        self.base = build_sampling_params(manager.rollout)
        self.ready: asyncio.Queue = asyncio.Queue()
        self.active: dict[asyncio.Task, Any] = {}
        self.waiting: list[Any] = []  # finished and kept, not yet drained (mirrors the queue, for data_state)
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.worker: asyncio.Task | None = None
        self.launched = 0
        self.drops: dict[str, int] = {}

    # ------------------------------------------------------------------ producer
    def _launch(self) -> None:
        from miles.rollout.manager import _Counts

        (item,) = self.data_source.next_batch(1)
        g = self.m._new_group(self.launched, item, 0, self.n)
        counts = _Counts(launched=self.n)
        task = asyncio.ensure_future(self.m._run_group(g, "fully_async", 0, self.base, counts))
        self.active[task] = (g, counts)
        self.launched += 1

    async def _produce(self) -> None:
        while True:
            # at most max_in_flight generating, and one rollout's worth finished and waiting (bounded staleness);
            # while paused, groups already generating are still collected
            while (self.resumed.is_set() and len(self.active) < self.max_in_flight
                   and len(self.active) + len(self.waiting) < self.max_in_flight + self.m.batch):
                self._launch()
            if not self.active:  # paused, or enough is waiting: look again shortly
                await asyncio.sleep(0.05)
                continue
            done, _ = await asyncio.wait(list(self.active), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                g, counts = self.active.pop(task)
                task.result()  # a bug (not a sample failure) stops the producer, and the next drain says so
                verdict = call_filter(self.m.filter, self.m.args, g.samples)
                if verdict.keep:
                    entry = (g, counts)  # one object in both: the drain removes it from waiting by identity
                    self.waiting.append(entry)
                    self.ready.put_nowait(entry)
                else:
                    reason = verdict.reason or "filtered"
                    self.drops[reason] = self.drops.get(reason, 0) + 1
                    self._check_starving()

    def _check_starving(self) -> None:
        """More than an epoch of prompts dropped since the last drain: the filter starves training."""
        from miles.rollout.manager import RolloutError

        dropped = sum(self.drops.values())
        if dropped > len(self.data_source.dataset) + self.m.batch:
            raise RolloutError(
                f"the dynamic sampling filter {self.m.data.dynamic_sampling_filter_path} dropped {dropped} groups in a "
                f"row (drops: {self.drops}) without --rollout-batch-size {self.m.batch} passing. Rewards may be all "
                f"equal (e.g. all 0): check the reward, or drop --dynamic-sampling-filter-path.")

    def _start(self) -> None:
        if self.worker is None:
            self.worker = asyncio.ensure_future(self._produce())
            logger.info("fully async rollout: producer started (%d groups in flight)", self.max_in_flight)

    async def _next_group(self) -> tuple[Any, Any]:
        get = asyncio.ensure_future(self.ready.get())
        try:
            while True:
                done, _ = await asyncio.wait({get, self.worker}, timeout=NO_PROGRESS_WARN_SECS,  # type: ignore[arg-type]
                                             return_when=asyncio.FIRST_COMPLETED)
                if self.worker in done:  # checked first: a dead producer fails the step now
                    self.worker.result()  # type: ignore[union-attr]
                    raise MilesError("the fully async rollout producer stopped without an error")
                if get in done:
                    return get.result()
                logger.warning("fully async rollout: no finished group in %.0fs (%d generating)",
                               NO_PROGRESS_WARN_SECS, len(self.active))
        finally:
            if not get.done():
                get.cancel()

    # ------------------------------------------------------------------ consumer
    async def next_rollout(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float]]:
        from miles.rollout.manager import RolloutError, _Counts

        self._start()
        t0 = time.monotonic()
        taken = []
        while len(taken) < self.m.batch:
            got = await self._next_group()
            taken.append(got)
            self.waiting = [w for w in self.waiting if w is not got]
        taken.sort(key=lambda gc: gc[0].index)
        groups = [g.samples for g, _ in taken]
        for grp in groups:
            for s in grp:
                s.rollout_id = rollout_id
        post = await self.m.post_process.apply(groups) if self.m.post_process is not None else {}
        total = _Counts()
        for _, c in taken:
            for name in ("reward_failures", "generate_failures", "finished", "launched", "response_tokens",
                         "engine_abort_retries"):
                setattr(total, name, getattr(total, name) + getattr(c, name))
            total.first_error = total.first_error or c.first_error
        metrics = self.m._metrics(groups, total, t0)
        metrics.update(post)
        metrics.update({"rollout/epoch": float(self.data_source.epoch), "rollout/groups_in_flight": float(len(self.active)),
                        "rollout/groups_waiting": float(len(self.waiting)),
                        **{f"rollout/dynamic_filter/drop_{r}": float(c) for r, c in self.drops.items()}})
        self.drops = {}
        flat = [s for grp in groups for s in grp]
        if flat and all(s.status is SampleStatus.FAILED for s in flat):
            raise RolloutError(f"rollout {rollout_id}: every one of {len(flat)} samples failed; first error: "
                               f"{total.first_error}")
        return groups, metrics

    # ------------------------------------------------------------------ control
    def pause(self) -> None:
        """Start no new groups (e.g. while the engines evaluate); generating ones go on."""
        self.resumed.clear()

    def resume(self) -> None:
        self.resumed.set()

    def data_state(self) -> dict[str, Any]:
        """The data source's state with every drawn but not yet trained prompt given back (served first)."""
        state = self.data_source.state_dict()
        pending = [g.item.index for g, _ in self.waiting] + [g.item.index for g, _ in self.active.values()]
        state["buffer"] = pending + list(state.get("buffer", []))
        return state

    async def close(self) -> None:
        if self.worker is not None:
            self.worker.cancel()
            await asyncio.gather(self.worker, return_exceptions=True)
            self.worker = None
        if self.active:
            await self.m._abort([g for g, _ in self.active.values()])
            self.active.clear()
