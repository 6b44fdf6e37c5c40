"""The scheduler's decode step, and the overlap scheduler (SGLang's, on by default on CUDA).

A decode step has two halves. **Launch**: grow KV pages, build the inputs, enqueue the forward and the sampling on
the device, and enqueue the copy of the sampled tokens (and log-probs) to the host, marked by an event.
**Collect**: wait for that event, append each token to its request, check stops, then remove finished requests.

Without overlap (``--disable-overlap-schedule``; the CPU default, where the "device" is the host and nothing can
overlap) a step is launched and then collected. With overlap, step k+1 is launched *before* step k is collected,
so that the host's bookkeeping of step k runs while the device computes step k+1:

* step k+1's input tokens are step k's sampled tokens, still on the device (``Launched.tokens``; after the batch
  changed, gathered by each request's row in step k); positions and sampling steps advance by one per step;
* a request that finishes at step k (stop token or string, max_new_tokens, the context) is found one step late:
  it rode in step k+1, whose token for it is dropped (not appended, counted, or log-prob'd; ``_collect`` skips
  rows whose request is already finished). Its pages are freed when step k is collected; a page freed (or moved,
  when the last row fills the freed slot) while step k+1 runs is reused only by work enqueued after step k+1, and
  the device runs both in order;
* whatever needs the host to be current first collects the step in flight (``_sync``): a prefill that admits
  requests (it samples their first tokens anyway), a prompt chunk prefilled on its own, retraction when the page
  pool runs short, a request at the context limit (its next position would be past the cache), and every
  scheduler command except queueing new requests (aborts, pauses, weight updates, memory release, cache flushes);
* host-to-device copies on the launch path are pinned and non-blocking (``to_device``): a pageable copy may wait
  for the device's queue, i.e. for the step in flight.

Phase timers (``/get_load``, summed over steps): ``grow``, ``inputs``, ``forward`` (enqueueing it, or running it on
CPU), ``sample`` (enqueueing the sampling and the copies back) are the launch of a step; ``decode_wait_seconds`` is
the wait for a step's tokens; ``append`` and ``remove`` are its collection. With overlap the collection of step k
runs after the launch of step k+1, so the wait is time the host had nothing left to do while the device worked, and
``decode_seconds - decode_wait_seconds`` is host work hidden behind the device (unless the device outran it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles.engine.paged_cache import to_device
from miles.engine.sampling import RowParams, SamplingBatch, sample

if TYPE_CHECKING:
    from miles.engine.model_runner import ModelRunner
    from miles.engine.scheduler import Req


@dataclass(eq=False)
class Launched:
    """A sampling enqueued on the device: row ``i`` is ``reqs[i]``'s token; ``host`` fills in once ``event`` is done."""

    reqs: list[Req]
    tokens: torch.Tensor                        # [rows] int64 on the device: the next decode step's input tokens
    host: tuple[torch.Tensor | None, ...]       # tokens, log-probs, top values, top ids, token_ids_logprob values
    event: torch.cuda.Event | None              # None on CPU (the host tensors are the results)
    serial: int                                 # decode step number (-1: a first-token sampling)


class DecodeSteps:
    """The decode-step half of ``Scheduler`` (a mixin: the state lives on the scheduler)."""

    runner: ModelRunner
    running: list[Req]
    overlap: bool
    _inflight: Launched | None

    # ------------------------------------------------------------------ the step in flight
    def _sync(self) -> None:
        """Collect the step in flight (if any) now: host state is current afterwards (counted as decode time)."""
        if self._inflight is None:
            return
        t0 = time.perf_counter()
        try:
            self._collect_inflight()
        finally:
            self.decode_seconds += time.perf_counter() - t0

    def _collect_inflight(self) -> None:
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._finish_step(launched)

    def _finish_step(self, launched: Launched) -> None:
        finished = self._collect(launched, step=True)
        t = time.perf_counter()
        self._remove([r.slot for r in finished if r.state == "running"])
        self._lap("remove", t)

    def _admission_prefills(self) -> bool:
        """Whether ``_admit`` would prefill (or sample a first token) now, rather than only start a prompt that is
        prefilled in chunks or rides in the decode steps (mixed), or admit nothing. A prefill waits for the device
        anyway (it samples), so the loop collects the step in flight first: admission then sees the slots and
        pages its finished requests free, as the serial scheduler does. (Admitting with a step in flight would be
        correct too: new rows take their tokens from the host, and the device orders the work.)"""
        rn = self.runner
        head = next((r for r in self.waiting if r.finish is None), None)
        if head is None:
            return False
        n = len(head.spec.input_ids) + (len(head.output_ids) - 1 if head.retracted else 0)
        if not head.retracted and rn.can_share_running_prefix and not self._wants_input_logprobs(head) \
                and self._holder(tuple(head.spec.input_ids)) is not None:
            return True
        if n > self.max_prefill_tokens and rn.chunk_row is not None:
            return False
        mix = self._mix_budget()
        return not (self._mix_ok(mix) and n <= self._mix_longest()
                    and (head.retracted or not self._wants_input_logprobs(head)))

    def _mix_budget(self) -> int:
        """Prompt tokens one decode step carries for the riders (0: this engine has no mixed steps)."""
        return min(self.runner.mix_step_tokens, self.max_prefill_tokens)

    def _mix_longest(self) -> int:
        """The longest prompt that rides (``MIX_MAX_CHUNKS`` graph chunks of ``mix_tokens``, within the budget's cap)."""
        return min(self.runner.mix_tokens, self.max_prefill_tokens) * self.MIX_MAX_CHUNKS

    def _mix_ok(self, budget: int) -> bool:
        """Whether refills ride in the decode steps now: the engine can mix, something decodes (or rides), a ride row
        is free, and fewer than ``mix_below`` requests could be admitted (more: one batched prefill)."""
        busy = len(self.running) + len(self.riders)
        return (budget > 0 and busy > 0 and bool(self._free_ride_rows)
                and min(self.runner.max_slots - busy, self.num_waiting) < self.mix_below)

    # ------------------------------------------------------------------ sampling
    @staticmethod
    def _row(r: Req) -> RowParams:
        return RowParams(r.spec.temperature, r.spec.top_p, r.spec.top_k, r.spec.min_p, r.seed, r.spec.logit_bias)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """First tokens (admission, a completed chunked prompt): sample one per row, append it, check stops."""
        need_min = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.spec.min_new_tokens]
        self._collect(self._launch_sample(reqs, logits, None, need_min, -1, cache=False), step=False)

    def _launch_sample(self, reqs: list[Req], logits: torch.Tensor, steps: torch.Tensor | None, need_min: list[int],
                       serial: int, cache: bool) -> Launched:
        """Enqueue the sampling of one token per row and its copy to the host. ``need_min``: rows that may not stop
        yet (min_new_tokens). ``cache``: the running batch (its SamplingBatch is kept until the batch changes)."""
        dev = self.runner.device
        if cache:
            if self._sb_epoch != self._epoch or self._sb is None:
                self._sb = SamplingBatch([self._row(r) for r in reqs], logits.shape[-1], dev)
                self._sb_epoch = self._epoch
            sb = self._sb
        else:
            sb = SamplingBatch([self._row(r) for r in reqs], logits.shape[-1], dev)
        if steps is None and not sb.all_greedy:
            steps = to_device(torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64), dev)
        suppress = None
        if need_min:
            rows: list[int] = []
            cols: list[int] = []
            for i in need_min:
                ids = self.stop_ids | set(reqs[i].spec.stop_token_ids)
                rows += [i] * len(ids)
                cols += ids
            suppress = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
            if rows:
                idx = to_device(torch.tensor([rows, cols], dtype=torch.long), dev)
                suppress[idx[0], idx[1]] = True
        want_lp = top_n = want_dist = False
        for r in reqs:
            if r.spec.return_logprob:
                want_lp = True
                top_n = max(top_n, r.spec.top_logprobs_num)
                want_dist = want_dist or bool(r.spec.token_ids_logprob)
        t_sample = time.perf_counter()
        out = sample(logits, sb, steps, suppress=suppress, want_logprobs=want_lp, top_n=top_n, want_dist=want_dist,
                     fused=not self.runner.deterministic)
        ids_lp = None
        if want_dist:  # the asked ids' log-probs of every row that wants them, as one flat gather
            rows, cols = [], []
            for i, r in enumerate(reqs):
                if r.spec.return_logprob and r.spec.token_ids_logprob:
                    rows += [i] * len(r.spec.token_ids_logprob)
                    cols += r.spec.token_ids_logprob
            idx = to_device(torch.tensor([rows, cols], dtype=torch.long), dev)
            ids_lp = out.logprob_dist[idx[0], idx[1]]
        results = (out.tokens, out.logprobs, out.top_values, out.top_indices, ids_lp)
        event = None
        if dev.type == "cuda":
            # copied back asynchronously; the collector waits on the event, whose synchronize() releases the GIL
            # (``.tolist()`` on a device tensor holds it while the GPU finishes), so the HTTP thread parses, answers
            # and streams during the wait
            results = tuple(x.to("cpu", non_blocking=True) if x is not None else None for x in results)
            event = torch.cuda.Event()
            event.record()
        if cache:
            self.decode_phases["sample"] += time.perf_counter() - t_sample
        return Launched(reqs, out.tokens, results, event, serial)

    def _collect(self, launched: Launched, step: bool) -> list[Req]:
        """Wait for a launched sampling's tokens, append them, check stops; returns the requests that finished.
        A row whose request finished before (overlap: at the step before this one) is dropped."""
        t_wait = time.perf_counter()
        if launched.event is not None:
            launched.event.synchronize()
        h_tok, h_lp, h_tv, h_ti, h_ids = launched.host
        toks = h_tok.tolist()
        t_append = time.perf_counter()
        if step:
            self.decode_wait_seconds += t_append - t_wait
        lps = h_lp.tolist() if h_lp is not None else None
        tv = h_tv.tolist() if h_tv is not None else None
        ti = h_ti.tolist() if h_ti is not None else None
        ids_lp = h_ids.tolist() if h_ids is not None else None
        off = 0
        finished: list[Req] = []
        appended = dropped = 0
        for i, (r, t) in enumerate(zip(launched.reqs, toks)):
            s = r.spec
            if r.finish is not None:  # computed past its end: not emitted, counted or log-prob'd
                if ids_lp is not None and s.return_logprob and s.token_ids_logprob:
                    off += len(s.token_ids_logprob)
                dropped += 1
                continue
            r.output_ids.append(t)
            if s.return_logprob:
                r.output_logprobs.append(lps[i])
                if s.top_logprobs_num:
                    k = s.top_logprobs_num
                    r.output_top.append(list(zip(tv[i][:k], ti[i][:k])))
                if s.token_ids_logprob:
                    k = len(s.token_ids_logprob)
                    r.output_token_ids_lp.append(ids_lp[off:off + k])
                    off += k
            self._check_finished(r)
            if r.finish is not None:
                finished.append(r)
            appended += 1
        self.generated_tokens += appended
        self.dropped_tokens += dropped
        if step:
            self._lap("append", t_append)
        return finished

    def _check_finished(self, r: Req) -> None:
        s, t = r.spec, r.output_ids[-1]
        if s.max_new_tokens is not None and len(r.output_ids) >= s.max_new_tokens:
            return self._finish(r, {"type": "length", "length": s.max_new_tokens})
        if not s.ignore_eos and (t in self.stop_ids or t in s.stop_token_ids):
            return self._finish(r, {"type": "stop", "matched": t})
        if s.stop_strs:
            longest = max(len(x) for x in s.stop_strs)
            tail = self.tokenizer.decode(r.output_ids[-(longest + 1):], skip_special_tokens=s.skip_special_tokens)
            for stop in s.stop_strs:
                if stop in tail:
                    r.stop_trim = len(stop)
                    return self._finish(r, {"type": "stop", "matched": stop})
        # the context this token's KV would need (not r.kv_len: with overlap that already counts the next step)
        if len(s.input_ids) + len(r.output_ids) - 1 >= self.runner.max_ctx:
            return self._finish(r, {"type": "length", "length": len(r.output_ids)})
        if r.stream and len(r.output_ids) - r.last_emit >= s.stream_interval:
            r.last_emit = len(r.output_ids)
            r.post(final=False)

    # ------------------------------------------------------------------ one decode step
    def _grow_pages(self) -> None:
        """Paged cache: a page for every running request whose next token starts one; when the pool is short,
        collect the step in flight (its finished requests free pages), then retract the newest running requests
        (back to the queue head, KV recomputed on readmission)."""
        rn = self.runner
        free = rn.free_pages()
        if free is None:
            return
        ps = rn.page_size
        need = [i for i, r in enumerate(self.running) if r.kv_len % ps == 0]
        if len(need) > free and self._inflight is not None:
            self._collect_inflight()
            free = rn.free_pages()
            need = [i for i, r in enumerate(self.running) if r.kv_len % ps == 0]
        if len(need) > free and (self.chunking is not None or self.riders):  # the newest work: recomputed later
            self.retractions += (self.chunking is not None) + len(self.riders)
            self._requeue_chunking()
            self._requeue_riders()
            free = rn.free_pages()
        while len(need) > free and len(self.running) > 1:
            self._retract_last()
            self.retractions += 1
            need = [i for i in need if i < len(self.running)]
            free = rn.free_pages()
        rn.grow_pages(need)

    def _mix_chunks(self) -> list[tuple[Req, list[int], int, int]]:
        """The prompt chunks the next decode step carries (request, sequence, start, length): the riders' next tokens
        in their order, up to ``_mix_budget()`` tokens in all (the last one may stop mid-prompt), and only while the
        page pool holds them with a page of headroom per running request; none: the step decodes only."""
        rn = self.runner
        budget = self._mix_budget()
        free = rn.free_pages()
        if free is not None:
            free -= len(self.running)
        out = []
        for r in self.riders:
            if budget <= 0:
                break
            seq = r.spec.input_ids + r.output_ids[:-1] if r.retracted else r.spec.input_ids
            start = r.kv_len
            t = min(budget, len(seq) - start)
            need = rn.pages_for(start + t) - rn.pages_held(r.ride_row)
            if free is not None:
                if need > free:
                    break
                free -= need
            out.append((r, seq, start, t))
            budget -= t
        return out

    def _step_inputs(self, prev: Launched | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next step's (tokens, positions, sampling steps) on the device. Unchanged batch: the last step's outputs
        and positions + 1. Otherwise one host-to-device copy; a request in the uncollected step ``prev`` (overlap)
        takes its token from that step's device output by its row there, the others from the host."""
        if self._dev_epoch == self._epoch and self._dev is not None:
            return self._dev
        reqs = self.running
        ps = prev.serial if prev is not None else None
        pend = [r.launched == ps for r in reqs]
        host = torch.tensor([[0 if p else r.output_ids[-1] for r, p in zip(reqs, pend)], [r.kv_len for r in reqs],
                             [len(r.output_ids) + p for r, p in zip(reqs, pend)],
                             [r.row if p else -1 for r, p in zip(reqs, pend)]], dtype=torch.long)
        tokens, positions, steps, src = to_device(host, self.runner.device).unbind(0)
        if prev is not None and any(pend):
            tokens = torch.where(src >= 0, prev.tokens[src.clamp(min=0)], tokens)
        return tokens, positions, steps

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        try:
            self._decode_step_timed()
        finally:
            self.decode_seconds += time.perf_counter() - t0

    def _lap(self, phase: str, since: float) -> float:
        """Add the time since ``since`` to ``phase`` of ``decode_phases``; returns now (the next phase's start)."""
        now = time.perf_counter()
        self.decode_phases[phase] += now - since
        return now

    def _decode_step_timed(self) -> None:
        rn = self.runner
        if self._inflight is not None and any(r.kv_len >= rn.max_ctx for r in self.running):
            self._collect_inflight()   # a request at the context limit: it finishes with the step in flight
        t = time.perf_counter()
        self._grow_pages()
        t = self._lap("grow", t)
        reqs = self.running
        chunks = self._mix_chunks()
        if not reqs and not chunks:
            if self.riders:   # nothing decodes and no rider's next chunk fits the pool: back to the queue, whose
                self._requeue_riders()   # admission (a batched prefill with nothing running) waits for pages
            return
        prev = self._inflight
        tokens, positions, steps = self._step_inputs(prev)
        max_len = max((r.kv_len for r in reqs), default=0) + 1
        t = self._lap("inputs", t)
        if not chunks:
            logits = rn.decode(tokens, positions, max_len)
        else:  # mixed: the riders' next prompt chunks are in this forward too (logits row n + j: chunk j's last token)
            logits = rn.decode_mixed_many(tokens, positions, max_len,
                                          [(cr.ride_row, seq[start:start + clen], start) for cr, seq, start, clen in chunks])
            self.mixed_steps += 1
        n = len(reqs)
        ps = prev.serial if prev is not None else None   # rows of ``prev`` have one token more than appended
        need_min = [i for i, r in enumerate(reqs)
                    if r.spec.min_new_tokens and len(r.output_ids) + (r.launched == ps) < r.spec.min_new_tokens]
        self._serial += 1
        serial = self._serial
        for i, r in enumerate(reqs):
            r.kv_len += 1
            r.launched, r.row = serial, i
        next_pos = positions + 1
        late = []   # completed riders that join after this step's sampling (a retracted request, or 0 tokens)
        if chunks:
            keep = list(range(n))   # logits rows of this step's sampling: the decode rows, then the riders that join
            for j, (cr, seq, start, clen) in enumerate(chunks):
                cr.kv_len = start + clen
                if cr.kv_len < len(seq):
                    continue
                if not cr.retracted and cr.spec.max_new_tokens != 0:
                    # joins now as the next row and draws its first token in this step's sampling, with the others
                    row = len(self.running)
                    self._join_chunked(cr, logits[n + j], False)
                    cr.launched, cr.row = serial, row
                    if cr.spec.min_new_tokens:
                        need_min.append(row)
                    keep.append(n + j)
                else:
                    late.append((cr, logits[n + j]))
            joined = len(keep) - n
            if joined:
                steps = torch.cat([steps, steps.new_zeros(joined)])
                next_pos = torch.cat([next_pos, to_device(torch.tensor([r.kv_len for r in self.running[n:]]),
                                                          next_pos.device)])
            logits = logits[:n] if not joined else logits[to_device(torch.tensor(keep), logits.device)]
        if not self.running:   # the forward carried only riders' prompt chunks, none complete: nothing to sample
            self._lap("forward", t)
            self._join_late(late)
            return
        epoch = self._epoch
        self._lap("forward", t)
        launched = self._launch_sample(list(self.running), logits, steps, need_min, serial, cache=True)
        self._dev = (launched.tokens.view(-1), next_pos, steps + 1)
        self._dev_epoch = epoch
        self.steps += 1
        self.last_step_time = time.time()
        if self.overlap:  # collect the step before while the device runs this one
            self._inflight = launched
            if prev is not None:
                self.overlap_steps += 1
                self._finish_step(prev)
        else:
            self._finish_step(launched)
        self._join_late(late)

    def _join_late(self, late: list[tuple[Req, torch.Tensor]]) -> None:
        """Riders whose prompt completed in this step but that draw no token in its sampling join now: a retracted
        request resuming (its next token is its last one), or one asking for 0 new tokens (finished at once)."""
        if not late:
            return
        t = time.perf_counter()
        for cr, chunk_last in late:
            row = len(self.running)
            if self._join_chunked(cr, chunk_last, False):
                self._first_token(cr, chunk_last)
                if cr.finish is not None:
                    self._remove([row])
        self._lap("remove", t)
