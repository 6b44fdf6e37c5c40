"""The scheduler's control commands (run on its thread): abort, pause (SGLang's abort / retract / in_place modes) and
resume, retraction of running requests, riders and a chunked prompt back to the head of the queue (their KV is
recomputed), cache flushes and memory release. A mixin of ``scheduler.Scheduler``, whose state these methods
change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.engine.req import Req, post_final

if TYPE_CHECKING:
    from collections import deque

    from miles.engine.model_runner import ModelRunner


class Retraction:
    """Abort / pause / retract / flush / release of ``Scheduler`` (a mixin: the state lives on the scheduler)."""

    runner: ModelRunner
    running: list[Req]
    waiting: deque[Req]
    riders: list[Req]
    chunking: Req | None

    def abort(self, rid: str | None, abort_all: bool, message: str = "Aborted by /abort_request") -> int:
        """Finish ``rid`` (and its ``rid_j`` samples), or every request; returns how many. O(matches)."""
        if abort_all:
            targets = list(self._live)
        else:
            targets = list(self._index.get(rid, ())) if rid else []
        return self.abort_reqs(targets, message)

    def abort_reqs(self, reqs: list[Req], message: str) -> int:
        """Finish these requests as aborted (those still live); O(len(reqs)) plus one slot move per running one."""
        self._sync()
        slots: list[int] = []
        posts: list[Req] = []
        n = 0
        for r in reqs:
            if r.finish is not None or r not in self._live:
                continue
            if r.state == "running":
                slots.append(r.slot)
            elif r is self.chunking:
                self._drop_chunking()
            elif r.state == "prefilling":
                self._drop_rider(r)
            self._finish(r, {"type": "abort", "message": message}, posts)
            n += 1
        post_final(posts)
        self._remove(slots)
        return n

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None, True, "Aborted by /pause_generation (mode abort)")
        elif mode == "retract":
            self._retract_all()
        self.abort_reqs([r for r in self._live if r.health], "generation is paused")
        self.paused, self.pause_mode = True, mode

    def resume(self) -> None:
        self.paused, self.pause_mode = False, None

    def _retract_all(self) -> None:
        self._sync()
        self._requeue_chunking()
        self._requeue_riders()
        while self.running:
            self._retract_last()

    def _drop_chunking(self) -> None:
        """Free the pages of the prompt being prefilled in chunks; it is no longer chunking."""
        if self.chunking is not None:
            self.runner.release_slot(self.runner.chunk_row)
            self.chunking = None

    def _drop_rider(self, r: Req) -> int:
        """Free the pages of a rider (a prompt prefilled inside decode steps); it no longer rides. Returns its row."""
        row = r.ride_row
        self.runner.release_slot(row)
        self.riders.remove(r)
        self._free_ride_rows.append(row)
        r.ride_row = -1
        return row

    def _requeue_riders(self) -> None:
        """Send every rider back to the head of the queue, in their order (their prompt KV is recomputed)."""
        for r in reversed(list(self.riders)):
            self._drop_rider(r)
            r.kv_len, r.chunk_lp, r.chunk_top, r.chunk_ids_lp = 0, [], [], []
            r.state = "waiting"
            self.waiting.appendleft(r)
            self.num_waiting += 1

    def _requeue_chunking(self) -> None:
        """Send the prompt being prefilled in chunks back to the head of the queue (its chunks are recomputed)."""
        r = self.chunking
        if r is None:
            return
        self._drop_chunking()
        r.kv_len, r.chunk_lp, r.chunk_top, r.chunk_ids_lp = 0, [], [], []
        r.state = "waiting"
        self.waiting.appendleft(r)
        self.num_waiting += 1

    def _retract_last(self) -> None:
        """Send the last running request back to the head of the queue; its KV is freed and recomputed later."""
        r = self.running.pop()
        self._drop_holder(r)
        self.runner.release_slot(len(self.running))
        r.retracted = True
        r.kv_len = 0
        r.state, r.slot, r.launched = "waiting", -1, -1
        self.waiting.appendleft(r)
        self.num_waiting += 1
        self._epoch += 1

    def cache_in_use(self) -> bool:
        """Whether some request holds KV (or, unpaused, is about to): flushing now would corrupt it.

        Only running requests hold KV. While paused, queued requests (new ones, or retracted ones whose
        KV is recomputed on continue) do not, so the cache can be flushed (SGLang's retract/abort modes)."""
        self._sync()
        return (bool(self.running) or self.chunking is not None or bool(self.riders)
                or (not self.paused and self.num_waiting > 0))

    def flush_cache(self) -> bool:
        if self.cache_in_use():
            return False
        self.runner.clear_cache()
        return True

    def release_memory(self, tags: set[str]) -> None:
        self._sync()
        if self.running:
            self._retract_all()
        self.runner.release(tags)
