"""The scheduler's request record (``Req``) and what travels with it to the event loop: ``Events`` (a request's
``(tokens so far, final)`` pairs), ``post_final`` (one loop callback for many answers), ``prompt_key`` (what prompt
KV is shared by), ``QueueFull`` (HTTP 503) and ``gc_paused``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections import deque
from typing import Any

import torch

from miles.engine.protocol import GenSpec


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
