"""A detached whole sync (``WeightSender.sync(detach=True)``, ``broadcast``): its post, broadcast and engine answer run
on a thread of their own, and ``land()`` waits for them.

:class:`Detached` is one such sync; :class:`DetachedLanding` is the ``broadcast`` sender's side: starting the thread
(a thread that cannot start sends inline instead: nothing is left "in flight"), landing it within
``--update-weight-timeout`` plus ``land_grace_s``, and abandoning one that overran (its group is never used again, and
every later landing refuses while its thread runs)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from miles.utils.logging import get_logger
from miles.weight_sync.base import Deadline, EngineTarget, SyncResult, WeightSyncError
from miles.weight_sync.group import WeightGroup

logger = get_logger(__name__)

THREAD_NAME = "miles-weight-detached"


class Detached:
    """A whole sync whose post, broadcast and engine answer run on their own thread (``sync(detach=True)``).

    The thread fills ``measured`` (its own result: the returned one is the caller's, read at once) and
    ``finished``; ``group`` is the weight-update group it broadcasts on, which nothing else may use while it runs."""

    def __init__(self, returned: SyncResult, engines: list[EngineTarget], deadline: Deadline, group: WeightGroup,
                 previous: int, rollout_id: int | None) -> None:
        self.returned, self.engines, self.deadline, self.group = returned, engines, deadline, group
        self.version = returned.version
        self.previous = previous  # the sender's version before this sync: back to it when the sync fails
        self.rollout_id = rollout_id
        self.measured = SyncResult(returned.mode, returned.version, num_engines=len(engines))
        self.failure: list[BaseException] = []
        self.thread: threading.Thread | None = None
        self.started = self.finished = 0.0

    def run(self, send: Callable[[], None]) -> None:
        """The thread's body: ``send`` records its own failures in ``failure``; anything else escaping it (the
        sender loop re-raises KeyboardInterrupt and SystemExit) is recorded too, so ``land()`` never reports a
        success with nothing measured."""
        self.started = time.monotonic()
        try:
            send()
        except BaseException as e:
            if not self.failure:
                self.failure.append(WeightSyncError(f"{self.what}: its sender thread ended on {type(e).__name__}: {e}"))
            raise
        finally:
            self.finished = time.monotonic()

    @property
    def what(self) -> str:
        return f"weight sync v{self.version} (detached{'' if self.rollout_id is None else f', rollout {self.rollout_id}'})"

    def landed(self) -> SyncResult:
        """The returned result with what the thread measured: total = the call's seconds + the thread's."""
        r = self.returned
        extra = {**r.extra, "returned_s": r.total_s,
                 **({"rollout_id": float(self.rollout_id)} if self.rollout_id is not None else {})}
        return dataclasses.replace(r, transfer_s=self.measured.transfer_s, load_s=self.measured.load_s,
                                   total_s=r.total_s + (self.finished - self.started), extra=extra, unmeasured=())


class DetachedLanding:
    """The ``broadcast`` sender's detached syncs (a mixin of ``BroadcastSender``, which provides ``_group``,
    ``_destroy_group``, ``_drop_group``, ``_name_suspects``, ``_log_landed``, ``weight_version`` and ``device``)."""

    # land() waits this long past a detached sync's --update-weight-timeout for its thread, whose own waits end at
    # that deadline and then report which engine and step did not answer
    land_grace_s = 5.0

    def _init_detached(self) -> None:
        self._detached: Detached | None = None  # a detached whole sync not yet landed
        # a detached sync whose thread outlived land()'s bounded wait: it may still hold its group (dropped from
        # this sender, never used again); every later sync refuses to start while that thread runs
        self._overran: Detached | None = None
        self._land_lock = threading.Lock()

    def _start_detached(self, det: Detached, send: Callable[[], None]) -> bool:
        """Run ``send`` on the detached sync's thread; the sync is in flight only once that thread started. False
        when it could not start (the caller then sends inline, as a sync that does not detach)."""
        thread = threading.Thread(target=det.run, name=THREAD_NAME, daemon=True, args=(send,))
        try:
            thread.start()
        except RuntimeError as e:  # "can't start new thread": out of threads or memory
            logger.warning("%s: its sender thread could not start (%s); sending it on the calling thread", det.what, e)
            return False
        det.thread = thread
        self._detached = det
        return True

    @property
    def detached_in_flight(self) -> bool:
        return self._detached is not None

    def _land_detached(self) -> float:
        """Wait for a detached sync's engines to answer (see ``WeightSender.land``); raises its failure. The wait is
        bounded by the sync's ``--update-weight-timeout`` plus ``land_grace_s``; a thread still running then is
        left with its group (dropped from this sender: no collective on it will start here again)."""
        self._refuse_while_overran()
        det = self._detached
        if det is None:
            return 0.0
        t0 = time.monotonic()
        assert det.thread is not None  # published only once its thread started (_start_detached)
        det.thread.join(timeout=max(0.0, det.deadline.end - time.monotonic()) + self.land_grace_s)
        waited = time.monotonic() - t0
        with self._land_lock:  # a second caller landing at the same time waited for the same thread
            first = self._detached is det
            if first:
                self._detached = None
        if det.thread.is_alive():
            if first:
                self._abandon(det)
            raise WeightSyncError(f"{det.what} did not finish within --update-weight-timeout={det.deadline.seconds:g}s "
                                  f"(+{self.land_grace_s:g}s): its sender thread still holds weight-update group "
                                  f"{det.group.name!r}, which no later sync will use; the engines may be stalled or "
                                  f"slower than the flag allows -- engines: {[e.url for e in det.engines]}")
        if det.failure:
            if first:
                self.weight_version = det.previous  # as after a plain sync that failed: the engines lack this version
                if self._group is det.group:
                    self._on_device()
                    self._drop_group(notify=[])  # unusable now: the next sync re-forms it
            raise self._name_suspects(det.failure[0], det.engines)
        if first:
            self._landed = det.landed()
            self._log_landed(self._landed, waited)
        return waited

    def _on_device(self) -> None:
        """The sender's CUDA device on this thread (land() may run on an ``asyncio.to_thread`` worker, and the CUDA
        current device is per thread) before an NCCL group is destroyed here."""
        if self.device is not None and self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(self.device)

    def _abandon(self, det: Detached) -> None:
        """A detached sync overran land()'s bounded wait: its thread may be inside a collective on ``det.group``.
        The group leaves this sender without being destroyed under the thread (that could hang or interleave);
        no collective starts on it again, and later syncs refuse to start while the thread runs."""
        self.weight_version = det.previous  # the engines may lack this version
        if self._group is det.group:
            self._group, self._group_engines = None, []
        self._overran = det
        logger.error("%s overran --update-weight-timeout=%gs; weight-update group %s is abandoned to its thread",
                     det.what, det.deadline.seconds, det.group.name)

    def _refuse_while_overran(self) -> None:
        """Raise while an overran detached sync's thread still runs; once it ended, destroy its group (bounded), in
        the one caller that takes it (a generation's and an eval's land() may run at once)."""
        with self._land_lock:
            det = self._overran
            if det is None:
                return
            assert det.thread is not None
            if det.thread.is_alive():
                raise WeightSyncError(f"{det.what} overran --update-weight-timeout={det.deadline.seconds:g}s and its "
                                      f"sender thread still holds weight-update group {det.group.name!r}: no weight "
                                      "sync can land or start until it ends (stop the run, or wait for the thread)")
            self._overran = None
        self._on_device()
        self._destroy_group(det.group, det.engines)  # the thread is done with it: the next sync forms a new one

    # BroadcastSender's (and WeightSender's: _landed, _log_landed); no stubs here, which would shadow WeightSender's
    _group: WeightGroup | None
    _group_engines: list[EngineTarget]
    _landed: SyncResult | None
    device: torch.device | None
    weight_version: int
