"""Continuous batching: one scheduler thread owns the model; the HTTP side talks to it through commands.

Each loop iteration: run queued commands (new requests, aborts, pause/continue, weight loads), admit
waiting requests into free KV slots (one padded prefill), run one decode step for every running request,
then hand finished/streamed tokens back to the event loop. A freed slot is refilled at the next iteration;
with the paged cache, refills (fewer than ``mix_below`` admissible) are prefilled inside the decode steps'
forward instead (mixed prefill + decode, ``ModelRunner.decode_mixed_many``): each such "rider" has its own
block-table row, every decode step carries the riders' next prompt tokens in queue order up to a budget of
``ModelRunner.mix_step_tokens`` (a prompt longer than what is left of it continues in the next steps), and a rider
whose prompt is complete joins the running rows and samples its first token with them. Requests join and leave the running batch
between decode steps; beyond ``max_running_requests`` they wait in FIFO order. Running requests always
occupy slots ``0..n-1``: when one leaves, the last one moves into its slot (one KV copy), so the decode
step sees contiguous, static-shaped cache views. The decode step itself is ``decode_step.py``: with the overlap
scheduler (CUDA default) step k+1 runs on the device while the host processes step k's tokens; whatever changes the
batch other than that processing first collects the step in flight (``_sync``; commands do by default).

Pause modes (SGLang's): ``abort`` finishes every request with ``finish_reason.type == "abort"``;
``retract`` returns running requests to the head of the queue (their KV is recomputed on continue, the
client sees one seamless output); ``in_place`` just stops stepping and keeps the KV. New requests queue
while paused. Queued requests hold no KV, so the cache can be flushed while paused with nothing running.

Bookkeeping is O(1) per request: every live request is indexed by its rid and by each ``_``-prefix of it
(so ``abort(rid)`` finds ``rid_j`` samples without a scan), a running request knows its slot, and an
aborted waiting request is only marked finished; admission skips it (lazy deletion from the queue).

Modules: ``req`` (the request record, its events, ``QueueFull``), ``admission`` (admission, prefills, chunks, riders,
shared prompt KV), ``retraction`` (abort, pause, retract, flush, release), ``decode_step`` (the decode step); this
module: the thread, submission, finishing and slot bookkeeping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from miles.engine.admission import Admission
from miles.engine.decode_step import DecodeSteps, Launched
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import BadRequest, GenSpec
from miles.engine.req import QueueFull, Req, gc_paused, post_final
from miles.engine.retraction import Retraction
from miles.engine.routed_experts import RECORDED_MODEL_TYPES
from miles.engine.sampling import SamplingBatch
from miles.utils.logging import get_logger

logger = get_logger("miles.engine.scheduler")


class Scheduler(DecodeSteps, Admission, Retraction):
    def __init__(self, runner: ModelRunner, tokenizer, *, max_prefill_tokens: int = 16384,
                 weight_version: str = "default", random_seed: int | None = None,
                 max_queued_requests: int | None = None, overlap: bool | None = None,
                 pick_cpu_threads: bool = False):
        self.runner = runner
        # the overlap scheduler (decode_step.py): step k+1 is launched before step k's tokens are processed; by
        # default on CUDA only (on CPU the forward runs on the scheduler thread itself: nothing to overlap)
        self.overlap = runner.device.type == "cuda" if overlap is None else overlap
        self._inflight: Launched | None = None   # the launched, not yet collected decode step (overlap)
        self._serial = 0                         # decode steps launched
        self.overlap_steps = 0      # decode steps launched while the step before was still in flight
        self.dropped_tokens = 0     # tokens computed (overlap) for requests that had finished the step before
        self.tokenizer = tokenizer
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_requests = max_queued_requests
        self.weight_version = weight_version
        self.rng = random.Random(random_seed)
        self.waiting: deque[Req] = deque()   # may hold finished (aborted) requests; admission skips them
        self.num_waiting = 0                 # live requests in ``waiting``
        self.running: list[Req] = []
        self._index: dict[str, set[Req]] = {}  # abort key -> live requests (see Req.keys)
        self._live: dict[Req, None] = {}       # every live request, in submission order
        self._accepted = 0                     # submitted and not yet finished (the queue bound's count)
        self._accepted_lock = threading.Lock()
        self.paused = False
        self.pause_mode: str | None = None
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-engine-scheduler", daemon=True)
        # the running batch's composition changes -> epoch bumps; device-side inputs and the sampling batch
        # are rebuilt only then, otherwise the sampled tokens feed the next step without leaving the device
        self._epoch = 0
        self._sb_epoch = -1
        self._sb: SamplingBatch | None = None
        self._dev_epoch = -1
        self._dev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._admitting: list[Req] = []
        # prompt -> running requests whose prompt KV and post-prompt logits can seed a new request (see Req)
        self._prompt_holders: dict[tuple[int, ...], dict[Req, None]] = {}
        self.shared_prompts = 0     # requests admitted on another running request's prompt KV (no prefill)
        # a prompt longer than max_prefill_tokens (paged cache): prefilled one chunk per loop iteration, between
        # decode steps of the running requests, in the cache's spare row; nothing else is admitted meanwhile
        self.chunking: Req | None = None
        # refills prefilled inside the decode steps (mixed), in queue order, each in a row of ``_free_ride_rows``
        self.riders: list[Req] = []
        self._free_ride_rows: list[int] = runner.ride_rows[::-1]
        self.chunked_prefills = 0
        self.mixed_prefills = 0     # prompts prefilled inside decode steps (mixed prefill + decode)
        self.mixed_steps = 0        # decode steps that carried a prompt chunk
        self.stop_ids = set(runner.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.stop_ids.add(int(tokenizer.eos_token_id))
        self.steps = 0
        self.generated_tokens = 0
        self.retractions = 0        # running requests sent back to the queue because the page pool ran out
        # a freed slot is refilled at the next step: when fewer than ``mix_below`` requests could be admitted and the
        # runner can mix, the head of the queue is prefilled inside the decode steps (mixed prefill + decode, no
        # separate forward); otherwise (start, bursts, the slot cache) one batched prefill admits them all
        self.mix_below = max(2, runner.max_slots // 32)
        self.last_step_time = time.time()
        self.error: BaseException | None = None
        # where a decode step's wall time goes (/get_load): all of it, and the part spent waiting for the device
        # at the step's one synchronisation (the sampled tokens coming back); the rest is host work
        self.decode_seconds = 0.0
        self.decode_wait_seconds = 0.0
        self.prefill_seconds = 0.0    # admissions (batched prefills, first tokens) and chunks prefilled between steps
        self.prefills = 0             # batched admission prefills
        self.decode_phases = dict.fromkeys(("grow", "inputs", "forward", "sample", "append", "remove"), 0.0)
        self.cpu_threads = torch.get_num_threads()  # the scheduler thread's torch intra-op threads (set in _loop)
        self.pick_cpu_threads = pick_cpu_threads   # CPU: _loop keeps the faster of those threads and one

    # ------------------------------------------------------------------ thread plumbing
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    def call(self, fn: Callable[[], Any], sync: bool = True) -> concurrent.futures.Future:
        """Run ``fn`` on the scheduler thread between two steps; the future carries its result. ``sync``: first
        collect the decode step in flight (overlap scheduler), so that ``fn`` sees every request's tokens so far and
        may change the running batch, the weights or the cache; only queueing new requests skips it."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut, sync))
        return fut

    async def acall(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(self.call(fn)), timeout)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                fn, fut, sync = item
                if sync and self._inflight is not None:
                    try:
                        self._sync()
                    except Exception as e:  # noqa: BLE001 - as a failed step: its requests are aborted
                        self._fail(e)
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed back to the caller
                        fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)
        elif self.pick_cpu_threads:     # the launcher's share of the cores is an upper bound
            self.runner.pick_cpu_threads()
        self.cpu_threads = torch.get_num_threads()  # what the forward passes run with (OMP_NUM_THREADS of the process)
        logger.info("scheduler thread: %d CPU thread(s) for the forward passes", self.cpu_threads)
        try:
            self.runner.warm_up()
        except Exception:  # noqa: BLE001 - graphs are then captured on first use
            logger.exception("capturing the decode CUDA graphs at start failed; they are captured on first use")
        while not self._stop.is_set():
            can_work = self._inflight is not None or (
                not self.paused and self.runner.ready and (self.running or self.waiting or self.chunking or self.riders))
            self._drain(block=not can_work)
            try:
                if self.paused or not self.runner.ready:
                    self._sync()
                    continue
                if self.chunking is not None:
                    self._sync()
                    t0 = time.perf_counter()
                    self._prefill_chunk()
                    self.prefill_seconds += time.perf_counter() - t0
                elif self.waiting and len(self.running) + len(self.riders) < self.runner.max_slots:
                    if self._inflight is not None and self._admission_prefills():
                        self._sync()
                    t0 = time.perf_counter()
                    self._admit()
                    self.prefill_seconds += time.perf_counter() - t0
                if self.running or self.riders:   # riders' prompt chunks ride in the decode step's forward
                    self._decode_step()
                else:
                    self._sync()
            except Exception as e:  # noqa: BLE001 - a failed step aborts its requests, the server keeps serving
                self._fail(e)

    def _fail(self, e: Exception) -> None:
        """A step failed: abort the running requests (and the one being prefilled); the server keeps serving."""
        logger.exception("scheduler step failed; aborting the running requests")
        self.error = e
        self._inflight, self._dev = None, None
        chunking = [self.chunking] if self.chunking is not None else []
        if chunking:
            self._drop_chunking()
        riders = list(self.riders)
        for r in riders:
            self._drop_rider(r)
        for r in list(self.running) + self._admitting + chunking + riders:
            if r.finish is None:
                self._finish(r, {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}"})
            if r.state == "running":
                r.post(final=True)
            r.state, r.slot = "done", -1
        for slot in range(len(self.running) + len(self._admitting)):
            self.runner.release_slot(slot)
        self.running.clear()
        self._admitting = []
        self._prompt_holders.clear()
        self._epoch += 1

    # ------------------------------------------------------------------ submission
    def validate(self, spec: GenSpec) -> None:
        P, mx = len(spec.input_ids), self.runner.max_ctx
        if P >= mx:
            raise BadRequest(f"the prompt has {P} tokens but the engine's context is {mx} "
                             f"(--max-context-len); shorten the prompt or raise --max-context-len")
        if spec.max_new_tokens is not None and P + spec.max_new_tokens > mx:
            raise BadRequest(f"prompt ({P} tokens) + sampling_params.max_new_tokens ({spec.max_new_tokens}) exceeds the "
                             f"engine's context of {mx} tokens (--max-context-len); lower max_new_tokens or raise --max-context-len")
        if spec.stop_strs and self.tokenizer is None:
            raise BadRequest("sampling_params.stop needs a tokenizer, and this model directory has none; use stop_token_ids")
        if spec.return_routed_experts and not self.runner.has_routed_experts:
            raise BadRequest(f"GenerateReqInput.return_routed_experts: the embedded engine records routed experts for "
                             f"{', '.join(dict.fromkeys(RECORDED_MODEL_TYPES.values()))} models, not this "
                             f"{self.runner.config.model_type!r} model; drop it (and "
                             f"--use-rollout-routing-replay), or serve the model with --rollout-engine sglang")

    def submit(self, specs: list[GenSpec], loop: asyncio.AbstractEventLoop, stream: bool, *,
               health: bool = False) -> list[Req]:
        """Queue ``specs``; raises BadRequest (never queued) or QueueFull (the engine is at --max-queued-requests)."""
        for s in specs:
            self.validate(s)
        limit = self.max_queued_requests
        if limit is not None and not health:
            with self._accepted_lock:
                if self._accepted + len(specs) > limit:
                    raise QueueFull(f"the engine already holds {self._accepted} requests and this one adds {len(specs)}, "
                                    f"over its limit of {limit} queued requests (--max-queued-requests); retry later, "
                                    f"or raise --max-queued-requests")
                self._accepted += len(specs)
        else:
            with self._accepted_lock:
                self._accepted += len(specs)
        with gc_paused():
            reqs = [Req(s, s.sampling_seed if s.sampling_seed is not None else self.rng.getrandbits(63), loop, stream)
                    for s in specs]
        for r in reqs:
            r.health = health

        def add():
            with gc_paused():
                self._add(reqs)
        self.call(add, sync=False)  # queueing leaves the running batch alone: the step in flight stays in flight
        return reqs

    def _add(self, reqs: list[Req]) -> None:
        for r in reqs:
            self._track(r)
            if r.health and self.paused:
                self._finish(r, {"type": "abort", "message": "generation is paused"})
                continue
            r.state = "waiting"
            self.waiting.append(r)
            self.num_waiting += 1

    def _track(self, r: Req) -> None:
        self._live[r] = None
        for k in r.keys():
            self._index.setdefault(k, set()).add(r)

    def _untrack(self, r: Req) -> None:
        if r in self._live:
            del self._live[r]
            for k in r.keys():
                group = self._index.get(k)
                if group is not None:
                    group.discard(r)
                    if not group:
                        del self._index[k]
            with self._accepted_lock:
                self._accepted -= 1


    # ------------------------------------------------------------------ steps
    def _finish(self, r: Req, reason: dict[str, Any], posts: list[Req] | None = None) -> None:
        """Finish ``r``; a request off its slot is answered now, or appended to ``posts`` for one batched post."""
        r.finish = reason
        r.weight_version = self.weight_version
        if r.state == "waiting":
            self.num_waiting -= 1
        self._untrack(r)
        if r.state != "running":  # a running request stays "running" until _remove takes it off its slot,
            r.state = "done"      # and is answered only then: a client that sees the answer sees it gone
            if posts is None:
                r.post(final=True)
            else:
                posts.append(r)

    def _remove(self, idxs: list[int]) -> None:
        gone_now: list[Req] = []
        try:
            for i in sorted(idxs, reverse=True):
                last = len(self.running) - 1
                gone = self.running[i]
                self._drop_holder(gone)
                gone.state, gone.slot = "done", -1
                if gone.spec.return_routed_experts:
                    gone.routed_experts = self.runner.routed_experts(i)
                self.runner.release_slot(i)
                if i != last:
                    mover = self.running[last]
                    self.runner.move_slot(last, i, mover.kv_len)
                    self.running[i] = mover
                    mover.slot = i
                self.running.pop()
                gone_now.append(gone)
        finally:  # one event-loop wake-up for all of them (was a self-pipe write per request), even after a failure
            post_final(gone_now)
        if idxs:
            self._epoch += 1

    # ------------------------------------------------------------------ introspection
    def load(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": self.num_waiting, "paused": self.paused,
                "pause_mode": self.pause_mode, "steps": self.steps, "generated_tokens": self.generated_tokens,
                "retractions": self.retractions, "shared_prompts": self.shared_prompts,
                "chunked_prefills": self.chunked_prefills, "mixed_prefills": self.mixed_prefills,
                "num_prefilling_reqs": len(self.riders) + (self.chunking is not None),
                "mixed_steps": self.mixed_steps, "overlap_steps": self.overlap_steps,
                "overlap_dropped_tokens": self.dropped_tokens, "decode_seconds": round(self.decode_seconds, 4),
                "decode_wait_seconds": round(self.decode_wait_seconds, 4), "cpu_threads": self.cpu_threads,
                "prefills": self.prefills, "prefill_seconds": round(self.prefill_seconds, 4),
                **{f"decode_{k}_seconds": round(v, 4) for k, v in self.decode_phases.items()}, **self.runner.kv_stats()}
