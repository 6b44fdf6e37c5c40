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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from miles.engine.decode_step import DecodeSteps, Launched
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import BadRequest, GenSpec
from miles.engine.routed_experts import RECORDED_MODEL_TYPES
from miles.engine.sampling import SamplingBatch
from miles.utils.logging import get_logger

logger = get_logger("miles.engine.scheduler")


def prompt_key(spec: GenSpec) -> tuple:
    """What prompt KV is shared by: the token ids, and the images' bytes (``spec.mm.key``) for an image prompt, so that
    prompts whose image tokens are equal but whose images differ never share KV or first-token logits; and the LoRA
    adapter (``spec.lora_path``) a request runs with, whose KV differs from the base model's."""
    ids = tuple(spec.input_ids)
    key = ids if spec.mm is None else (ids, spec.mm.key)
    return key if spec.lora_path is None else (key, "lora", spec.lora_path)


class QueueFull(RuntimeError):
    """The engine holds --max-queued-requests requests already: HTTP 503 (retry later)."""


class Events:
    """What the scheduler thread tells the event loop about one request: ``(tokens so far, final)`` pairs.

    An ``asyncio.Queue`` did this at ~10x the cost to build; a request with ``n=100000`` builds 100000 of them
    on the event loop. ``put_nowait`` runs on the loop (through ``call_soon_threadsafe``), ``get`` awaits there.
    """

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: tuple[int, bool]) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> tuple[int, bool]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


@contextlib.contextmanager
def gc_paused():
    """Build many small objects without the collector rescanning them as they pile up (4x faster at 100000)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def post_final(reqs: list[Req]) -> None:
    """``r.post(final=True)`` for each, as one event-loop callback per loop instead of one wake-up per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Events, tuple[int, bool]]]] = {}
    for r in reqs:
        by_loop.setdefault(r.loop, []).append((r.events, (len(r.output_ids), True)))

    def deliver(batch: list[tuple[Events, tuple[int, bool]]]) -> None:
        for ev, item in batch:
            ev.put_nowait(item)
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(deliver, batch)


class Req:
    """One generation as the scheduler tracks it. Lists only grow, so the event loop may read prefixes."""

    def __init__(self, spec: GenSpec, seed: int, loop: asyncio.AbstractEventLoop, stream: bool):
        self.spec = spec
        self.rid = spec.rid
        self.seed = seed
        self.loop = loop
        self.stream = stream
        self.events = Events()
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[list[tuple[float, int]]] = []
        self.output_token_ids_lp: list[list[float]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top: list[list[tuple[float, int]]] | None = None
        self.input_token_ids_lp: list[list[float]] | None = None   # token_ids_logprob at each input position
        self.kv_len = 0
        self.retracted = False
        self.finish: dict[str, Any] | None = None
        self.stop_trim = 0           # characters of a matched stop string to cut from the text
        self.created = time.time()
        self.last_emit = 0
        self.weight_version = ""
        self.slot = -1               # index in Scheduler.running while running
        self.state = "new"           # new -> waiting -> running (-> waiting when retracted) -> done
        self.health = False          # an internal /health probe: finished at once when generation pauses
        # while running with its prompt's KV intact: the logits after the prompt, so that a later request with
        # the same prompt (the next samples of an RL group) shares this one's prompt KV instead of prefilling it
        self.prompt_logits: torch.Tensor | None = None
        self.prompt_key: tuple[int, ...] | None = None
        self.weights_epoch = -1
        self.chunk_lp: list[float] = []                    # input log-probs gathered chunk by chunk
        self.chunk_top: list[list[tuple[float, int]]] = []
        self.chunk_ids_lp: list[list[float]] = []
        self.routed_experts: torch.Tensor | None = None   # [tokens run, layers, top-k], set when it leaves its slot
        self.launched = -1           # the last decode step it ran in (DecodeSteps) and its row there
        self.row = -1
        self.ride_row = -1           # while a rider (prefilled inside decode steps): its block-table row

    def keys(self) -> list[str]:
        """The rid and each of its ``_``-prefixes: the abort keys that reach this request."""
        parts = self.rid.split("_")
        return ["_".join(parts[:i]) for i in range(len(parts), 0, -1)]

    def post(self, final: bool) -> None:
        n = len(self.output_ids)
        self.loop.call_soon_threadsafe(self.events.put_nowait, (n, final))


class Scheduler(DecodeSteps):
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

    # ------------------------------------------------------------------ control (run on the scheduler thread)
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

    def _drop_holder(self, r: Req) -> None:
        if r.prompt_key is not None:
            group = self._prompt_holders.get(r.prompt_key)
            if group is not None:
                group.pop(r, None)
                if not group:
                    del self._prompt_holders[r.prompt_key]
        r.prompt_key = r.prompt_logits = None

    def _holder(self, key: tuple[int, ...]) -> Req | None:
        """A running request with this prompt whose prompt KV is from the current weights."""
        group = self._prompt_holders.get(key)
        if not group:
            return None
        for h in group:
            if h.state == "running" and h.weights_epoch == self.runner.weights_epoch:
                return h
        return None

    HOLDERS = 2
    MIX_MAX_CHUNKS = 4   # a refill whose prompt needs more mixed graph chunks (mix_tokens) than this is prefilled on
    #                      its own instead: a rider's prompt tokens attend to its earlier ones through the decode kernel

    def _admit(self) -> None:
        """Admit queued requests (FIFO) while slots, prefill tokens and (paged) free pages allow; one prefill.

        A prompt is prefilled once: the other samples of it admitted together start from a copy of its KV (slot
        cache) or share its full pages (paged cache), and so does a later request whose prompt a running
        request holds (the next samples of an RL group admitted in a later batch: no prefill at all, the first
        token is sampled from the holder's post-prompt logits)."""
        rn = self.runner
        uniq: list[Req] = []
        dups: list[tuple[Req, int]] = []     # (request, index in uniq of the request that prefills its prompt)
        held: list[tuple[Req, Req]] = []     # (request, running request holding its prompt)
        first: dict[tuple[int, ...], int] = {}
        budget = self.max_prefill_tokens
        free = rn.free_pages()
        reserve = free is not None and rn.deterministic
        if reserve:  # the pages the running requests may still take (see _final_pages)
            free -= sum(self._final_pages(r) - rn.pages_held(r.slot) for r in self.running)
        share_running = rn.can_share_running_prefix
        mix = self._mix_budget()
        mix_ok = self._mix_ok(mix)
        riding = len(self.riders)
        while self.waiting and len(self.running) + riding + len(uniq) + len(dups) + len(held) < rn.max_slots:
            r = self.waiting[0]
            if r.finish is not None:  # aborted while queued
                self.waiting.popleft()
                continue
            n = len(r.spec.input_ids) + (len(r.output_ids) - 1 if r.retracted else 0)
            key = None if r.retracted else prompt_key(r.spec)
            src = first.get(key) if key is not None else None
            holder = None
            if src is None and key is not None and share_running and not self._wants_input_logprobs(r):
                holder = self._holder(key)
            if src is None and holder is None and n > self.max_prefill_tokens and rn.chunk_row is not None:
                if reserve and self._final_pages(r) > free:
                    break
                if not (uniq or dups or held):  # prefilled in chunks from the next iteration on
                    self.waiting.popleft()
                    self.num_waiting -= 1
                    r.state, r.kv_len, self.chunking = "prefilling", 0, r
                    rn.set_lora(rn.chunk_row, r.spec.lora_index)
                    self.chunked_prefills += 1
                break
            if (src is None and holder is None and mix_ok and n <= self._mix_longest()
                    and (r.retracted or not self._wants_input_logprobs(r))):
                # a refill: its prompt rides in the next decode steps (mixed), after the riders before it; the
                # requests gathered for a batched prefill so far go first
                if (not (uniq or dups or held) and self._free_ride_rows
                        and (free is None or rn.pages_for(n + 1) + len(self.running) + riding <= free)):
                    self.waiting.popleft()
                    self.num_waiting -= 1
                    r.state, r.kv_len, r.ride_row = "prefilling", 0, self._free_ride_rows.pop()
                    rn.set_lora(r.ride_row, r.spec.lora_index)
                    self.riders.append(r)
                    self.mixed_prefills += 1
                    riding += 1
                    if free is not None:
                        free -= rn.pages_for(n + 1)
                    continue
                break
            if src is None and holder is None and uniq and n * (len(uniq) + 1) > budget:
                break
            if free is not None:
                # the pages it takes now (one copied page when it shares a prompt), and one page of headroom
                # per running request so that decode rarely has to retract; batch-invariant mode: every page it
                # may take, so that decode never retracts
                shared = src is not None or holder is not None
                pages = (self._final_pages(r) if reserve else rn.pages_for(n + 1)) - (n // rn.page_size if shared else 0)
                headroom = 0 if reserve else len(self.running) + len(uniq) + len(dups) + len(held)
                if pages + headroom > free:
                    break
                free -= pages
            self.waiting.popleft()
            self.num_waiting -= 1
            r.state = "admitting"
            if holder is not None:
                held.append((r, holder))
            elif src is None:
                if key is not None:
                    first[key] = len(uniq)
                uniq.append(r)
                budget -= n
            else:
                dups.append((r, src))
        if not uniq and not held:
            return
        batch = uniq + [r for r, _ in dups] + [r for r, _ in held]
        self._admitting = batch
        seqs = [r.spec.input_ids + r.output_ids[:-1] if r.retracted else r.spec.input_ids for r in uniq]
        want = [(not r.retracted) and self._wants_input_logprobs(r) for r in batch]
        want_full = want[: len(uniq)]
        for j, (_, src) in enumerate(dups):
            want_full[src] = want_full[src] or want[len(uniq) + j]
        start = len(self.running)
        # R3: only the slots whose request asked record their MoE routing (the others' forwards run no router hooks);
        # a prompt's prefill records for its samples that ask too, and stops after sharing if it did not ask itself
        asks = [r.spec.return_routed_experts for r in batch]
        record = asks[: len(uniq)]
        for j, (_, src) in enumerate(dups):
            record[src] = record[src] or asks[len(uniq) + j]
        for i, on in enumerate(record + asks[len(uniq):]):
            rn.record_routes(start + i, on)
        for i, r in enumerate(batch):        # the LoRA adapter each row's tokens run with (0: the base model)
            rn.set_lora(start + i, r.spec.lora_index)
        if uniq:
            self.prefills += 1
            last, full = rn.prefill(start, seqs, want_full, [r.spec.mm for r in uniq])
        else:
            last, full = None, []
        rows = list(range(len(uniq))) + [src for _, src in dups]
        by_src: dict[int, list[int]] = {}  # the samples of one prompt get its KV together
        for j, (_, src) in enumerate(dups):
            by_src.setdefault(src, []).append(start + len(uniq) + j)
        for src, dsts in by_src.items():
            rn.share_prefix_many(start + src, dsts, len(seqs[src]))
        for i in range(len(uniq)):
            if record[i] and not asks[i]:
                rn.record_routes(start + i, False)
        full = full + [full[src] for _, src in dups] + [None] * len(held)
        seqs = seqs + [seqs[src] for _, src in dups] + [r.spec.input_ids for r, _ in held]
        base = len(uniq) + len(dups)
        for j, (r, h) in enumerate(held):
            rn.share_prefix(h.slot, start + base + j, len(r.spec.input_ids))
        self.shared_prompts += len(held)
        logits = last[rows] if last is not None and (dups or held) else last
        if held:
            extra = torch.stack([h.prompt_logits for _, h in held])
            logits = extra if logits is None else torch.cat([logits, extra])
        full = [f if w else None for f, w in zip(full, want)]
        for i, (r, s) in enumerate(zip(batch, seqs)):
            r.kv_len = len(s)
            r.state, r.slot = "running", start + i
        self.running.extend(batch)
        self._admitting = []
        self._epoch += 1
        fresh = [i for i, r in enumerate(batch) if not r.retracted]
        for r in batch:
            r.retracted = False
        if share_running:  # up to HOLDERS running requests per prompt keep a copy of its post-prompt logits
            for i in fresh:
                r = batch[i]
                key = prompt_key(r.spec)
                group = self._prompt_holders.setdefault(key, {})
                if len(group) < self.HOLDERS:
                    r.prompt_key, r.prompt_logits, r.weights_epoch = key, logits[i].clone(), rn.weights_epoch
                    group[r] = None
        for i in fresh:
            if full[i] is not None:
                self._input_logprobs(batch[i], full[i])
        zero = [i for i in fresh if batch[i].spec.max_new_tokens == 0]
        sample_rows = [i for i in fresh if batch[i].spec.max_new_tokens != 0]
        if sample_rows:
            reqs = [batch[i] for i in sample_rows]
            self._sample_and_append(reqs, logits[sample_rows])
        done = [start + i for i in zero]
        for i in zero:
            self._finish(batch[i], {"type": "length", "length": 0})
        self._remove(done + [start + i for i in sample_rows if batch[i].finish is not None])

    def _final_pages(self, r: Req) -> int:
        """Batch-invariant mode, paged cache: the pages ``r`` holds when it has generated all it may (its prompt plus
        max_new_tokens, at most the context). Admission reserves them, so that decode never runs short of pages and
        no running request is retracted: a retracted request's KV is recomputed by a prefill, whose last bits differ
        from the decode steps' that wrote it, and which requests get retracted depends on the others."""
        rn = self.runner
        new = r.spec.max_new_tokens
        end = rn.max_ctx if new is None else min(len(r.spec.input_ids) + new, rn.max_ctx)
        return rn.pages_for(end)

    def _prefill_chunk(self) -> None:
        """The next chunk (at most max_prefill_tokens tokens) of the prompt being prefilled in chunks; after the
        last one it becomes a running request (its row moved into the running rows) and samples its first token."""
        r, rn = self.chunking, self.runner
        seq = r.spec.input_ids + r.output_ids[:-1] if r.retracted else r.spec.input_ids
        start = r.kv_len
        t = min(self.max_prefill_tokens, len(seq) - start)
        need = rn.pages_for(start + t) - rn.pages_held(rn.chunk_row)
        if need + len(self.running) > rn.free_pages():  # wait: running requests free pages as they finish
            if not self.running and need > rn.free_pages():
                raise RuntimeError(f"the KV pool cannot hold a {len(seq)}-token prompt")
            return
        want = (not r.retracted) and self._wants_input_logprobs(r)
        last, full = rn.prefill_chunk(rn.chunk_row, seq[start:start + t], start, want)
        if want:
            self._chunk_input_logprobs(r, full, start, t)
        r.kv_len = start + t
        if r.kv_len < len(seq):
            return
        row = len(self.running)
        if self._join_chunked(r, last, want):
            self._first_token(r, last)
            if r.finish is not None:
                self._remove([row])

    def _first_token(self, r: Req, last: torch.Tensor) -> None:
        if r.spec.max_new_tokens == 0:
            self._finish(r, {"type": "length", "length": 0})
        else:
            self._sample_and_append([r], last[None])

    def _join_chunked(self, r: Req, last: torch.Tensor, want: bool) -> bool:
        """The prompt prefilled in chunks (between decode steps, or a rider's inside them) is complete: its row joins
        the running rows (as the last one). Returns whether it is fresh (its first token still to draw from
        ``last``) rather than a retracted request resuming."""
        rn = self.runner
        if r is self.chunking:
            self.chunking = None
            src = rn.chunk_row
        else:
            src = r.ride_row
            self.riders.remove(r)
            self._free_ride_rows.append(src)
            r.ride_row = -1
        row = len(self.running)
        rn.move_slot(src, row, r.kv_len)
        r.state, r.slot = "running", row
        self.running.append(r)
        self._epoch += 1
        fresh, r.retracted = not r.retracted, False
        if not fresh:
            return False
        key = prompt_key(r.spec)
        group = self._prompt_holders.setdefault(key, {})
        if rn.can_share_running_prefix and len(group) < self.HOLDERS:
            r.prompt_key, r.prompt_logits, r.weights_epoch = key, last.clone(), rn.weights_epoch
            group[r] = None
        elif not group:
            del self._prompt_holders[key]
        if want:
            lsl = r.spec.logprob_start_len
            r.input_logprobs = ([None] + r.chunk_lp)[lsl:]
            if r.spec.top_logprobs_num:
                r.input_top = ([[]] + r.chunk_top)[lsl:]
            if r.spec.token_ids_logprob:
                r.input_token_ids_lp = ([[]] + r.chunk_ids_lp)[lsl:]
            r.chunk_lp, r.chunk_top, r.chunk_ids_lp = [], [], []
        return True

    @staticmethod
    def _chunk_input_logprobs(r: Req, logits: torch.Tensor, start: int, t: int) -> None:
        """Input log-probs of the tokens that positions ``start..start+t-1`` predict (as ``_input_logprobs``)."""
        tgt = r.spec.input_ids[start + 1: start + t + 1]
        if not tgt:
            return
        lp = torch.log_softmax(logits[: len(tgt)], dim=-1)
        r.chunk_lp += lp.gather(1, torch.tensor(tgt, device=lp.device)[:, None]).squeeze(1).tolist()
        if r.spec.top_logprobs_num:
            v, i = lp.topk(min(r.spec.top_logprobs_num, lp.shape[-1]), dim=-1)
            r.chunk_top += [list(zip(a, b)) for a, b in zip(v.tolist(), i.tolist())]
        if r.spec.token_ids_logprob:
            r.chunk_ids_lp += lp[:, list(r.spec.token_ids_logprob)].tolist()

    @staticmethod
    def _wants_input_logprobs(r: Req) -> bool:
        return r.spec.return_logprob and r.spec.logprob_start_len >= 0

    def _input_logprobs(self, r: Req, logits: torch.Tensor) -> None:
        s = r.spec
        ids = torch.tensor(s.input_ids, device=logits.device)
        lp = torch.log_softmax(logits[:-1], dim=-1)
        tok_lp = lp.gather(1, ids[1:, None]).squeeze(1).tolist()
        r.input_logprobs = ([None] + tok_lp)[s.logprob_start_len:]
        if s.top_logprobs_num:
            v, i = lp.topk(min(s.top_logprobs_num, lp.shape[-1]), dim=-1)
            rows = [list(zip(a, b)) for a, b in zip(v.tolist(), i.tolist())]
            r.input_top = ([[]] + rows)[s.logprob_start_len:]
        if s.token_ids_logprob:  # SGLang's input_token_ids_logprobs: those ids' log-probs at every input position
            rows = lp[:, list(s.token_ids_logprob)].tolist()
            r.input_token_ids_lp = ([[]] + rows)[s.logprob_start_len:]

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
