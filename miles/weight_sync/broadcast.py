"""Broadcast transport (disaggregated default): trainer rank 0 -> every engine worker, NCCL or gloo.

Forming a group (``connect`` / ``reconnect``), on the source rank: host the TCPStore once; pick a fresh
``group_name``; world = 1 + the engines' workers; engine e's workers take ranks ``1 + sum(workers of
engines before e)``...; post ``/init_weights_update_group`` to every engine concurrently while joining as
rank 0 (both sides block until all have joined, bounded by ``--update-weight-timeout``). Re-forming
destroys the old group first; a failed broadcast aborts the group, and the next sync re-forms it with
the engines it is given.

One sync: every trainer rank iterates ``iter_weight_buckets`` in lockstep (the FSDP2 all-gathers run on
the caller's thread only). The source packs each bucket into one fresh uint8 buffer and hands it to a
sender thread, which posts ``/update_weights_from_distributed`` (``load_format="flattened_bucket"``) to
every engine and broadcasts the buffer on the weight group, while the main thread already gathers the
next bucket; with ``max_in_flight=2`` an engine loads bucket k while bucket k+1 is broadcast. A whole sync
(the model in one bucket, embedded engines: one request) has no next bucket, so the calling thread posts
and broadcasts it itself (``_send_inline``: the same request and bytes, no thread). The
trainer group and the weight group are different communicators driven by different
threads, each in a fixed order, so the classic "all-gather vs broadcast" deadlock cannot occur; on a
sender failure the source keeps draining the gathers so the other trainer ranks never hang.

The engine side is ``miles.engine.weights.WeightGroups`` (same group construction, same bucket layout).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from miles.config.sglang import LORA_ADAPTER_NAME
from miles.utils.logging import get_logger
from miles.utils.net import host_address
from miles.weight_sync.base import Deadline, EngineTarget, SyncResult, WeightSender, WeightSyncError
from miles.weight_sync.buckets import dtype_to_str, pack_bucket
from miles.weight_sync.detached import Detached, DetachedLanding
from miles.weight_sync.group import WeightGroup, WeightGroupError, host_store

logger = get_logger(__name__)

_DONE = object()


def _end_rendezvous(store: Any, name: str, world: int, wait_s: float = 2.0) -> None:
    """End a group's rendezvous that can no longer complete. Every rank publishes its address under
    ``<name>/.../<rank>`` in the store and reads the others'; replacing each rank's value with an unusable
    one makes every member still waiting (this process's helper thread, live engines, an engine whose
    init arrives late) fail at once instead of after the group timeout. Best effort: the key layout is
    read off rank 0's own key (written by the helper thread as it starts), waited for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    try:
        while True:
            ranked = [k.lstrip("/") for k in store.list_keys()
                      if k.lstrip("/").startswith(f"{name}/") and k.rsplit("/", 1)[-1].isdigit()]
            if ranked or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not ranked:
            logger.debug("ending the rendezvous of %s: no key of it in the store", name)
            return
        prefix = ranked[0].rsplit("/", 1)[0]
        for rank in range(world):
            store.set(f"{prefix}/{rank}", b"miles: this group's formation failed; join the next one")
    except (RuntimeError, ValueError) as e:  # the store is the trainer's own; this is best effort
        logger.debug("ending the rendezvous of %s: %s", name, e)


class BroadcastSender(DetachedLanding, WeightSender):
    """``--update-weight-transfer-mode broadcast``. ``flatten=False`` sends one broadcast per tensor;
    ``max_in_flight`` buckets may await their engines' answers (2: an engine loads bucket k while k+1 travels)."""

    mode = "broadcast"
    num_sources = 1  # trainer ranks in the weight-update group (ranks 0..num_sources-1)

    def __init__(self, cfg, source, *, device: torch.device | str | None = None, master_addr: str | None = None,
                 store_port: int = 0, flatten: bool = True, max_in_flight: int = 2, **kwargs: Any) -> None:
        super().__init__(cfg, source, **kwargs)
        self.device = torch.device(device) if device is not None else None
        self.master_addr = master_addr
        self.store_port = store_port
        self.flatten = flatten
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight  # buckets posted whose engine answer is still outstanding
        self._store = None
        self._group: WeightGroup | None = None
        self._group_engines: list[EngineTarget] = []
        self._formations = 0
        self._in_flight: collections.deque = collections.deque()  # buckets whose engine answers are outstanding
        self._init_detached()  # detached.py: the detached sync in flight, an overran one, their lock

    # -- group membership ----------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return "nccl" if self.device is not None and self.device.type == "cuda" else "gloo"

    @property
    def group_name(self) -> str | None:
        return self._group.name if self._group is not None else None

    def connect(self, engines: Sequence[EngineTarget] | None = None) -> None:
        super().connect(engines)
        if self.is_source:
            self._group, self._group_engines = self._form(self.engines), list(self.engines)

    def reconnect(self, live_engines: Sequence[EngineTarget]) -> None:
        """Destroy the current group (telling the engines still alive) and form one with ``live_engines``."""
        super().reconnect(live_engines)
        if not self.is_source:
            return
        try:
            self.land()  # a detached sync's thread still broadcasting on the group is done with it first
        except WeightSyncError as e:
            logger.warning("re-forming the weight-update group after: %s", e)
        self._drop_group(notify=[e for e in self._group_engines if e in self.engines])
        self._group, self._group_engines = self._form(self.engines), list(self.engines)

    def _drop_group(self, notify: Sequence[EngineTarget]) -> None:
        group, self._group, self._group_engines = self._group, None, []
        self._destroy_group(group, notify)

    def _destroy_group(self, group: WeightGroup | None, notify: Sequence[EngineTarget]) -> None:
        """Destroy ``group`` here and (bounded) on the engines ``notify``."""
        if group is None:
            return
        # Both ends tear down at once: an NCCL communicator's destruction can wait for its peers.
        futs = self.submit_all(notify, lambda c: c.destroy_weights_update_group(group.name)) if notify else []
        group.destroy()
        if futs:
            deadline = Deadline(min(30.0, self.cfg.update_weight_timeout), f"destroying weight-update group {group.name}")
            for e, f in zip(notify, futs):
                try:
                    f.result(timeout=max(0.0, deadline.end - time.monotonic()))
                except Exception as exc:  # noqa: BLE001 - a dead engine cannot confirm; nothing to undo
                    logger.warning("destroy_weights_update_group(%s) on %s: %s: %s", group.name, e.url, type(exc).__name__, exc)

    def _form(self, engines: Sequence[EngineTarget], name: str | None = None) -> WeightGroup:
        """Form a group of ``num_sources`` trainer ranks (this one is rank 0; ``p2p`` has the others join
        on their own) and every engine worker, whose ranks follow."""
        if not engines:
            raise WeightSyncError("cannot form a weight-update group without engines")
        timeout = self.cfg.update_weight_timeout
        if self._store is None:
            self._store = host_store(self.store_port, timeout)
        if name is None:
            self._formations += 1
            name = f"miles-weights-{self._formations}-{uuid.uuid4().hex[:8]}"
        world = self.num_sources + sum(e.num_workers for e in engines)
        addr = self.master_addr or host_address()
        deadline = Deadline(timeout, f"forming weight-update group {name}")
        offsets, off = [], self.num_sources
        for e in engines:
            offsets.append(off)
            off += e.num_workers
        futs = [self.submit_all([e], lambda c, o=o: c.init_weights_update_group(addr, self._store.port, o, world, name, self.backend,
                                                                                timeout=timeout))[0]
                for e, o in zip(engines, offsets)]
        t0 = time.monotonic()
        group = self._join_group(name, world, timeout, engines, futs)
        self.wait_all(engines, futs, deadline, f"init_weights_update_group({name})")
        logger.info("weight-update group %s formed: %d engine(s), world %d, %s, %s:%d, %.2fs", name, len(engines), world,
                    self.backend, addr, self._store.port, time.monotonic() - t0)
        return group

    def _join_group(self, name: str, world: int, timeout: float, engines: Sequence[EngineTarget],
                    futs: list) -> WeightGroup:
        """Rank 0's side of the group, formed in a helper thread while the engines' ``/init_weights_update_group``
        answers are watched: an engine that refuses or cannot be reached will never join, so the formation
        fails at once, naming it, instead of waiting out the group timeout.

        The formation uses its own client of the store (a waiting rendezvous holds its client's lock: on a
        shared client the next formation would wait behind it), and a failed one is ended for every member
        still waiting in it (:func:`_end_rendezvous`), so neither this process nor a live engine stays blocked."""
        out: dict[str, Any] = {}
        store = self._store.clone() if hasattr(self._store, "clone") else self._store

        def form() -> None:
            try:
                if self.device is not None and self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # the CUDA current device is per thread
                out["group"] = WeightGroup(name, store, 0, world, self.backend, timeout_s=timeout, device=self.device)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                out["error"] = e

        helper = threading.Thread(target=form, name=f"miles-form-{name}", daemon=True)
        helper.start()
        while helper.is_alive():
            helper.join(0.05)
            failed = [(e, f.exception()) for e, f in zip(engines, futs) if f.done() and not f.cancelled()
                      and f.exception() is not None]
            if failed and helper.is_alive():
                _end_rendezvous(self._store, name, world)
                helper.join(5.0)
                why = "; ".join(f"{e.url}: {type(err).__name__}: {err}" for e, err in failed)
                raise WeightSyncError(f"weight-update group {name!r} cannot form: engine(s) did not join ({why}) "
                                      f"-- engines: {[x.url for x in engines]}")
        if "error" in out:
            for f in futs:
                f.cancel()
            why = [f"{e.url}: {f.exception()}" for e, f in zip(engines, futs)
                   if f.done() and not f.cancelled() and f.exception() is not None]
            raise WeightSyncError(f"{out['error']} -- engines: {[x.url for x in engines]}"
                                  + (f"; their answers: {why}" if why else "")) from out["error"]
        return out["group"]

    # -- one sync ------------------------------------------------------------------------------------
    def _sync(self, engines: list[EngineTarget], version: int) -> SyncResult:
        result = SyncResult(self.mode, version, num_engines=len(engines))
        t_start = time.monotonic()
        if not self.is_source:
            for _ in self.timed_buckets(result):
                pass
            if self.lora_adapter:
                self.source.lora_adapter()   # collective: the adapters' gathers
            result.total_s = time.monotonic() - t_start
            return result
        deadline = Deadline(self.cfg.update_weight_timeout, f"weight sync v{version} (broadcast)")
        temp_group = None
        try:
            if not engines:
                for _ in self.timed_buckets(result):
                    pass
                if self.lora_adapter:
                    self.source.lora_adapter()
                return result
            if self._group is None:
                self.connect(self.engines)
            group = self._group
            if [e.url for e in engines] != [e.url for e in self._group_engines]:
                group = temp_group = self._form(engines)  # a subset (a newcomer): a group of its own
                self._detach_this = False  # destroyed when this call returns: no thread may outlive it
            tc = time.monotonic()
            embedded = self.all_embedded(engines, deadline)
            # the adapter loads after the base and before generation continues: no one-request sync with it
            whole = self.cfg.pause_generation_mode if embedded and not self.lora_adapter else None
            if whole is None:
                self.begin(engines, deadline)
            result.control_s += time.monotonic() - tc
            buckets = self.timed_buckets(result)
            if whole is not None:  # one request for the whole sync needs the whole model in one bucket
                first = next(buckets, None)
                second = next(buckets, None) if first is not None else None
                if first is None or second is not None:
                    tc = time.monotonic()
                    self.begin(engines, deadline)
                    result.control_s += time.monotonic() - tc
                    whole = None
                buckets = itertools.chain([b for b in (first, second) if b is not None], buckets)
            self._send_all(group, engines, version, deadline, result, buckets, whole, ordered=embedded and whole is None)
            if self.lora_adapter:
                self._send_adapter(group, engines, deadline, result)
            if whole is None:
                tc = time.monotonic()
                self.finish(engines, version, deadline, versioned=result.num_buckets > 0)
                result.control_s += time.monotonic() - tc
        except (WeightSyncError, WeightGroupError) as e:
            if temp_group is None:
                self._drop_group(notify=[])  # unusable now: the next sync re-forms it
            raise WeightSyncError(str(e)) from e
        finally:
            if temp_group is not None:
                temp_group.destroy()
            result.total_s = time.monotonic() - t_start
        return result

    def _send_all(self, group: WeightGroup, engines: list[EngineTarget], version: int, deadline: Deadline, result: SyncResult,
                  buckets: Iterator[list[tuple[str, torch.Tensor]]], whole: str | None = None,
                  ordered: bool = False) -> None:
        if whole is not None:  # the whole model in one bucket: nothing to gather while it travels, so no thread
            self._send_inline(group, engines, version, deadline, result, buckets, whole)
            return
        q: queue.Queue = queue.Queue(maxsize=1)
        failure: list[BaseException] = []
        sender = threading.Thread(target=self._sender_loop, args=(q, group, engines, version, deadline, result, failure,
                                                                  whole, ordered),
                                  name="miles-weight-broadcast", daemon=True)
        sender.start()
        try:
            for bucket in buckets:
                if failure:
                    continue  # keep gathering in lockstep so the other trainer ranks finish too
                item = self._prepared(bucket, result)
                while not failure:
                    try:
                        q.put(item, timeout=min(1.0, deadline.left()))
                        break
                    except queue.Full:
                        continue
                    except WeightSyncError as e:
                        failure.append(e)
        finally:
            while sender.is_alive():
                try:
                    q.put(_DONE, timeout=0.2)
                    break
                except queue.Full:
                    if failure:
                        try:
                            q.get_nowait()
                        except queue.Empty:
                            pass
            sender.join(timeout=max(1.0, deadline.end - time.monotonic() + 5.0))
        if failure:
            raise self._name_suspects(failure[0], engines)
        if sender.is_alive():
            raise WeightSyncError(f"the weight broadcast thread is stuck past --update-weight-timeout={deadline.seconds:g}s")

    def _send_inline(self, group: WeightGroup, engines: list[EngineTarget], version: int, deadline: Deadline,
                     result: SyncResult, buckets: Iterator[list[tuple[str, torch.Tensor]]], whole: str) -> None:
        """``_sender_loop`` on the calling thread, for a whole sync (one bucket): the same request and broadcast
        without a thread start, two queue hand-offs and a join per sync. A detached sync (``sync(detach=True)``)
        packs the bucket here, then posts, broadcasts and waits for the engines' answer on a thread of its own."""
        q: queue.Queue = queue.Queue()
        for bucket in buckets:
            q.put(self._prepared(bucket, result))  # the bytes are copied out: the trainer may step again
        q.put(_DONE)
        if self._detach_this:
            det = Detached(result, engines, deadline, group, self.weight_version, self._detach_rollout)
            if self._start_detached(det, lambda: self._sender_loop(q, group, engines, version, deadline, det.measured,
                                                                   det.failure, whole, False)):
                result.extra["detached"] = 1.0
                result.unmeasured = ("transfer_s", "load_s", "gbps")  # the thread's: reported when it lands
                return
        failure: list[BaseException] = []
        self._sender_loop(q, group, engines, version, deadline, result, failure, whole, False)
        if failure:
            raise self._name_suspects(failure[0], engines)

    def _prepared(self, bucket: list[tuple[str, torch.Tensor]], result: SyncResult) -> tuple[torch.Tensor | None, list, Any]:
        """``_prepare`` with its time counted as gathering and the bucket counted in ``result``."""
        t0 = time.monotonic()
        item = self._prepare(bucket)
        result.gather_s += time.monotonic() - t0
        result.num_buckets += 1
        result.num_tensors += len(bucket)
        result.bytes += item[0].numel() if self.flatten else sum(t.numel() * t.element_size() for _, t in item[1])
        return item

    def _prepare(self, bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor | None, list, Any]:
        """(flat buffer or None, per-tensor list, CUDA event the sender waits for)."""
        if self.device is not None:
            bucket = [(n, t.to(self.device, non_blocking=True)) for n, t in bucket]
        event = None
        if self.flatten:
            flat, _ = pack_bucket(bucket)
            tensors = [(n, t) for n, t in bucket]
        else:
            flat, tensors = None, [(n, t.detach().contiguous()) for n, t in bucket]
        dev = (flat if flat is not None else tensors[0][1]).device
        if dev.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
        return flat, tensors, event

    def _sender_loop(self, q: queue.Queue, group: WeightGroup, engines: list[EngineTarget], version: int,
                     deadline: Deadline, result: SyncResult, failure: list[BaseException], whole: str | None = None,
                     ordered: bool = False) -> None:
        """Post and broadcast every bucket. Buckets travel on separate connections, so with more than one in
        flight an engine may get request k+1 before request k: ``ordered`` (every engine is the embedded one)
        numbers them and the engine takes them in order; SGLang gets one bucket in flight at a time."""
        stream = None
        in_flight = self.max_in_flight if ordered else 1
        sync_id = uuid.uuid4().hex[:12] if ordered else ""  # names the buckets of an ordered sync only
        index = itertools.count()
        pending: collections.deque = collections.deque()  # (futures, t_broadcast_done) of buckets not yet answered
        self._in_flight = pending

        def settle(keep: int) -> None:
            while len(pending) > keep:
                futs, _ = pending[0]
                t_wait = time.monotonic()
                self.wait_all(engines, futs, deadline, "update_weights_from_distributed")
                pending.popleft()
                result.load_s += time.monotonic() - t_wait  # the part of the engines' load not hidden by overlap

        try:
            while True:
                item = q.get(timeout=deadline.left())
                if item is _DONE:
                    settle(0)
                    return
                flat, tensors, event = item
                if event is not None:
                    if stream is None:
                        stream = torch.cuda.Stream(device=flat.device if flat is not None else tensors[0][1].device)
                    stream.wait_event(event)
                names = [n for n, _ in tensors]
                dtypes = [dtype_to_str(t.dtype) for _, t in tensors]
                shapes = [list(t.shape) for _, t in tensors]
                fmt = "flattened_bucket" if self.flatten else None
                kw = {"load_format": fmt, "weight_version": str(version), "flush_cache": False, "timeout": deadline.left(),
                      **({"whole_sync": whole} if whole is not None else {}),
                      **({"bucket_order": (sync_id, next(index))} if ordered else {})}
                futs = self.submit_all(engines, lambda c, a=(names, dtypes, shapes, group.name), kw=kw:
                                       c.update_weights_from_distributed(*a, **kw))
                pending.append((futs, len(names)))
                t0 = time.monotonic()
                ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                with ctx:
                    items = [(f"bucket of {len(names)} tensors", flat)] if flat is not None else [
                        (f"tensor {n!r}", t) for n, t in tensors]
                    _broadcast_or_cancel(group, items, futs, engines, deadline)
                result.transfer_s += time.monotonic() - t0
                # the engine loads bucket k while bucket k+1 is broadcast (in order: see the docstring)
                settle(in_flight - 1)
        except BaseException as e:  # noqa: BLE001 - reported to the main thread, which raises it
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise  # Ctrl-C on the calling thread (a whole sync runs inline): the run stops as interrupted
            if not isinstance(e, WeightSyncError | WeightGroupError):
                e = WeightSyncError(f"weight broadcast failed: {type(e).__name__}: {e}")
            failure.append(e)
            while True:  # unblock the producer until it sends _DONE
                try:
                    if q.get(timeout=max(0.0, deadline.end - time.monotonic() + 5.0)) is _DONE:
                        return
                except queue.Empty:
                    return

    def _send_adapter(self, group: WeightGroup, engines: list[EngineTarget], deadline: Deadline,
                      result: SyncResult) -> None:
        """The LoRA adapter to every engine over the group, as Miles's distributed LoRA sync: unload the last one (a
        failure there is fine: none yet), then ``/load_lora_adapter_from_distributed`` (names, dtypes, shapes) while
        each tensor is broadcast in that order. Every trainer rank gathers the adapter (``lora_adapter``)."""
        t0 = time.monotonic()
        config, tensors = self.source.lora_adapter()
        result.gather_s += time.monotonic() - t0
        if not tensors:
            raise WeightSyncError("LoRA adapter sync: the trainer exported no adapter tensors")
        tensors = [(n, t.to(self.device).contiguous() if self.device is not None else t.contiguous())
                   for n, t in tensors]
        self.unload_adapter(engines, deadline)
        names = [n for n, _ in tensors]
        dtypes = [dtype_to_str(t.dtype) for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        futs = self.submit_all(engines, lambda c: c.load_lora_adapter_from_distributed(
            LORA_ADAPTER_NAME, config, names, dtypes, shapes, group.name, timeout=deadline.left()))
        t1 = time.monotonic()
        _broadcast_or_cancel(group, [(f"LoRA tensor {n!r}", t) for n, t in tensors], futs, engines, deadline)
        result.transfer_s += time.monotonic() - t1
        t2 = time.monotonic()
        self.wait_all(engines, futs, deadline, "load_lora_adapter_from_distributed")
        result.load_s += time.monotonic() - t2
        result.bytes += sum(t.numel() * t.element_size() for _, t in tensors)
        result.num_tensors += len(tensors)
        result.extra["lora_adapter_tensors"] = float(len(tensors))

    def _name_suspects(self, err: BaseException, engines: list[EngineTarget]) -> BaseException:
        """Add to ``err`` which engines had not answered the bucket in flight (the stalled or dead ones)."""
        pending, self._in_flight = list(self._in_flight), collections.deque()
        silent = sorted({e.url for futs, _ in pending for e, f in zip(engines, futs)
                         if f.cancelled() or not f.done() or f.exception() is not None})
        if not silent:
            return err
        return WeightSyncError(f"{err}; engine(s) {silent} did not complete update_weights_from_distributed for the "
                               f"bucket(s) in flight: stalled or dead")

    def close(self) -> None:
        """Land a detached sync, destroy the group (telling its engines) and stop the HTTP loop."""
        try:
            self.land()
        except WeightSyncError as e:
            logger.warning("the last weight sync (detached) failed: %s", e)
        if self.is_source:
            try:
                self._drop_group(notify=list(self._group_engines))
            except WeightSyncError as e:
                logger.warning("closing the weight-update group: %s", e)
        super().close()


def _broadcast_or_cancel(group: WeightGroup, items: list[tuple[str, torch.Tensor]], futs: list, engines: list[EngineTarget],
                         deadline: Deadline) -> None:
    """Broadcast each ``(what, tensor)`` from rank 0 in order, bounded by ``deadline``; when the group fails, cancel the
    engines' pending load requests ``futs`` and raise one WeightSyncError naming the engines."""
    try:
        for what, t in items:
            group.broadcast(t, src=0, timeout_s=deadline.left(), what=what)
    except WeightGroupError as e:
        for f in futs:
            f.cancel()
        raise WeightSyncError(f"{e} (engines: {[x.url for x in engines]})") from e
