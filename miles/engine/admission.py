"""The scheduler's admission: queued requests (FIFO) into free KV slots while slots, prefill tokens and free pages
allow, in one padded prefill, or as riders prefilled inside the decode steps, or one long prompt in chunks between
them; prompt KV shared by the samples of one prompt and by later requests with a running holder's prompt; the
first token and the input log-probs of a prefill. A mixin of ``scheduler.Scheduler``, whose state these methods
change."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from miles.engine.req import Req, prompt_key

if TYPE_CHECKING:
    from collections import deque

    from miles.engine.model_runner import ModelRunner


class Admission:
    """Admission and prefill of ``Scheduler`` (a mixin: the state lives on the scheduler)."""

    runner: ModelRunner
    running: list[Req]
    waiting: deque[Req]
    riders: list[Req]
    chunking: Req | None

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
