"""The weight sender contract, the shared sync choreography, and ``build_weight_sender``.

A sender moves the trainer's current weights into every engine and labels them with a new
``weight_version``. All trainer ranks construct the same sender and call every gathering method
(``sync``, ``sync_one``, ``check``) together: the trainer's ``iter_weight_buckets`` gathers FSDP2 shards
in lockstep on all ranks. Only the *source* rank (trainer rank 0, or each colocated engine's leader in
``tensor`` mode) talks to engines; the ``engines`` arguments matter only there.

Every sync runs the same choreography over HTTP (``miles.fleet.client.EngineControl``, one call per
engine, issued concurrently, each bounded by the time left of ``--update-weight-timeout``):

    pause_generation(--pause-generation-mode) -> begin_weight_update -> <mode's transfer>
    -> end_weight_update -> flush_cache (skipped for in_place) -> continue_generation

The new version travels in the transfer's own update calls (SGLang's ``weight_version`` field of
``/update_weights_from_*``, which sets the engine's version on success); ``/update_weight_version`` is
sent only when no update call carried it. When the whole model is one bucket and every engine is the
embedded one (``/get_server_info`` says ``"engine": "miles-embedded"``, asked once per engine), the
``broadcast`` and ``tensor`` transports send that bucket as ONE request that also pauses, flushes and
continues (``miles.fleet.client.whole_sync_params``): one round trip per sync instead of seven.

It returns a :class:`SyncResult` (gather / transfer / engine-load / control / total seconds, bytes).
A failure raises :class:`WeightSyncError` naming the engine and the step; the engines are left paused
(their weights may be half-updated) for the caller (``miles.ft``) to replace or resync them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from miles.config.base import ConfigError
from miles.config.sglang import LORA_ADAPTER_NAME
from miles.config.weights import WeightSyncConfig
from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

MODES = ("broadcast", "p2p", "disk-delta", "tensor")


class WeightSyncError(MilesError):
    """A weight sync failed or timed out; the message names the engine(s) and the step."""


class WeightSource(Protocol):
    """What a trainer exposes to the senders (every trainer backend implements it; the weight plane never imports
    the trainer plane). Optional: ``iter_weight_shards(bucket_bytes, dtype)``, an iterator of lists of
    ``miles.weight_sync.p2p.LocalShard`` (this rank's dim-0 rows of each HF tensor, in the buckets of
    ``iter_weight_buckets``), which ``p2p`` takes when present; a trainer whose shards are not dim-0 row ranges
    of the HF tensors (Megatron's TP shards) leaves it out, and ``p2p`` sends each rank's dim-0 share of the full
    tensors instead. Optional: ``mtp_weight_prefixes()``, the HF name prefixes of the multi-token-prediction layers
    it exports, which ``--check-weight-update-equal`` does not ask the engines for (weight_sync/check.py). Optional:
    ``weight_export_is_partial()``, True when the export is part of the model the engines serve (a multimodal
    checkpoint trained text-only: the towers stay as the engines loaded them), which disk-delta's full versions say
    in their manifest (``disk_delta.write_version``'s ``partial``). Optional: ``iter_trained_weight_buckets(bucket_bytes,
    dtype)``, the buckets of ``iter_weight_buckets`` less the tensors training never changes (LoRA: the merged targets
    only), which ``--lora-base-cpu-backup`` sends after the first sync. With LoRA adapters served by the engines
    (``lora_adapter``): ``iter_base_weight_buckets`` (the same buckets with the adapters unmerged) and
    ``lora_adapter()`` (collective: adapter_config.json's dict and the HF PEFT-named tensors)."""

    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors, bucket by bucket; collective on every trainer rank, every rank iterates to the
        end and receives the full tensors."""
        ...


@dataclass(frozen=True)
class EngineTarget:
    """An engine as the weight plane sees it: its URL and how many ranks it adds to a weight group."""

    url: str
    num_workers: int = 1          # the engine's TP size (GPUs); each worker is one rank of the group
    engine_id: int | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"engine {self.url}: num_workers (--rollout-num-gpus-per-engine) must be >= 1, got {self.num_workers}")


@dataclass
class SyncResult:
    """Timings of one sync (seconds; overlapping phases make the parts sum to more than ``total_s``)."""

    mode: str
    version: int
    num_engines: int = 0
    num_buckets: int = 0
    num_tensors: int = 0
    bytes: int = 0                # tensor bytes moved per engine
    gather_s: float = 0.0         # trainer: gathering shards + packing buckets
    transfer_s: float = 0.0       # moving bytes (broadcast / serialize / write)
    load_s: float = 0.0           # engines: from bytes received to weights in place
    control_s: float = 0.0        # pause/begin/end/version/flush/continue
    total_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    # fields not measured when the result is read: a detached sync returns before its transfer and the engines'
    # load (``WeightSender.sync(detach=True)``), which its landed result (``WeightSender.take_landed``) reports
    unmeasured: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def as_metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        """The measured fields (never a 0 standing for one not measured yet: ``unmeasured`` ones are left out)."""
        d = {k: v for k, v in asdict(self).items() if isinstance(v, int | float) and k != "version"
             and k not in self.unmeasured}
        d.update(self.extra)
        if "gbps" not in self.unmeasured:
            d["gbps"] = self.gbps
        return {prefix + k: float(v) for k, v in d.items()}


class _Loop:
    """One background event loop per sender for its HTTP control calls (never the caller's loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="miles-weight-sync-http", daemon=True)
        self._thread.start()

    def submit(self, coro: Awaitable[Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


class Deadline:
    """The time left of one sync's ``--update-weight-timeout``."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = float(seconds), what
        self.end = time.monotonic() + self.seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise WeightSyncError(f"{self.what} exceeded --update-weight-timeout={self.seconds:g}s")
        return left


class WeightSender(ABC):
    """Base of the three transports; see the module docstring for the contract."""

    mode: str = ""

    def __init__(self, cfg: WeightSyncConfig, source: WeightSource, *, is_source: bool,
                 engines: Sequence[EngineTarget] = (), dtype: torch.dtype | None = None,
                 initial_version: int = 0, status_group: Any = None,
                 control_factory: Callable[[EngineTarget, float], Any] | None = None,
                 lora_adapter: bool = False) -> None:
        self.cfg, self.source, self.is_source = cfg, source, is_source
        # the engines serve the LoRA adapters (--sglang-enable-lora with --lora-rank, as Miles does): the base goes
        # unmerged (WeightSource.iter_base_weight_buckets) and each sync loads the adapter (lora_adapter) under
        # LORA_ADAPTER_NAME, which the rollouts name (the tensor and broadcast transports)
        self.lora_adapter = lora_adapter
        if lora_adapter:
            check_lora_adapter_mode(self.mode)
        self.dtype = dtype
        self.engines: list[EngineTarget] = list(engines)
        self.weight_version = int(initial_version)
        self.status_group = status_group          # trainer group: every rank learns whether a sync failed
        self._control_factory = control_factory or _default_control
        self._controls: dict[str, Any] = {}
        self._embedded: dict[str, bool] = {}      # url -> the engine serves whole-sync requests
        self._loop: _Loop | None = None
        # --lora-base-cpu-backup: after a full sync succeeded the engines hold the frozen base (and keep it across the
        # colocated memory release), so the next syncs send the trained tensors only (decided alike on every rank)
        self._base_sent = False
        self._trained_only = False
        self._detach_this = False  # this sync may leave the engines' answer to a thread (sync(detach=True))
        self._detach_rollout: int | None = None  # the rollout a detached sync's weights come from (its log lines)
        self._landed: SyncResult | None = None   # the last detached sync that landed, not yet taken (take_landed)

    # -- public API ------------------------------------------------------------------------------------
    def connect(self, engines: Sequence[EngineTarget] | None = None) -> None:
        """Prepare the transport for ``engines`` (source rank); called once after engines are up."""
        if engines is not None:
            self.engines = list(engines)

    def reconnect(self, live_engines: Sequence[EngineTarget]) -> None:
        """Membership changed: drop state about dead engines and prepare for the live ones only."""
        self.engines = list(live_engines)
        self._embedded.clear()

    def sync(self, engines: Sequence[EngineTarget] | None = None, *, bump_version: bool = True,
             full: bool = False, detach: bool = False, rollout_id: int | None = None) -> SyncResult:
        """Push the trainer's current weights. Collective on every trainer rank.

        ``bump_version`` False re-sends the current version (use it only when the trainer has not
        stepped since the last sync). ``engines`` (source rank) restricts the targets. With
        ``--lora-base-cpu-backup`` a sync after the first successful one sends the trained tensors only
        (``WeightSource.iter_trained_weight_buckets``) unless ``full``.

        ``detach`` (``train_async.py``): when the sync is one request to embedded engines (the whole model in one
        bucket, ``broadcast``), return once the weights are packed into the send buffer, and leave the request,
        the broadcast and the engines' answer to a thread; the trainer may train on meanwhile. The caller must
        :meth:`land` the sync before the engines generate with it (the next sync and :meth:`close` do too); a
        failure is raised there. Ignored under ``--check-weight-update-equal`` and by the other transports. The
        result then says ``extra["detached"] == 1`` and leaves out what the thread measures later (``unmeasured``:
        transfer, load, GB/s; ``total_s`` is the seconds the call took): the landed sync logs them, naming
        ``rollout_id`` (the rollout whose training made these weights), and :meth:`take_landed` returns them.
        Only the process that called ``sync`` holds the thread, so only it can land it (``train_async.py``
        detaches only where the driver is this sender's source rank).
        """
        version = self.weight_version + 1 if bump_version else self.weight_version
        targets = list(self.engines if engines is None else engines)
        err: BaseException | None = None
        result = SyncResult(self.mode, version, num_engines=len(targets))
        # the engines keep the frozen base: --lora-base-cpu-backup (colocated), or separate engines serving the adapters
        # (as Miles skips the base sync of a distributed LoRA sync)
        keeps_base = self.cfg.lora_base_cpu_backup or (self.lora_adapter and self.mode == "broadcast")
        self._trained_only = keeps_base and self._base_sent and not full
        # an adapter sync is two requests (base, adapter): never detached; nor an unflattened one (its tensors are the
        # trainer's own, which the next step changes while the thread would send them; a flattened bucket is a copy)
        self._detach_this = (detach and self.is_source and not self.cfg.check_weight_update_equal
                             and not self.lora_adapter and getattr(self, "flatten", True))
        self._detach_rollout = rollout_id
        try:
            self.land()  # a detached sync still in flight lands before the next one starts
        except (WeightSyncError, OSError, RuntimeError, ValueError) as e:  # every rank reaches _agree below
            err = e
        try:
            if err is None:
                result = self._sync(targets, version)
            else:
                for _ in self.iter_buckets():  # the other trainer ranks gather in lockstep: keep up with them
                    pass
        except (WeightSyncError, OSError, RuntimeError, ValueError) as e:
            err = e
        finally:
            trained_only, self._trained_only = self._trained_only, False
            self._detach_this = False
        self._agree(err)
        self._base_sent = True
        if trained_only:
            result.extra["trained_only"] = 1.0
        self.weight_version = version
        if self.cfg.check_weight_update_equal:
            err = None
            try:
                self.check()
            except (WeightSyncError, RuntimeError, ValueError) as e:
                err = e
            self._agree(err)
        if result.unmeasured:  # detached: the thread's part is logged when it lands (_log_landed)
            logger.info("weight sync v%d (%s, detached%s) to %d engine(s): returned after %.3fs (gather and pack "
                        "%.3fs, control %.3fs), %.1f MB; its transfer and the engines' load are logged when it lands",
                        version, self.mode, "" if rollout_id is None else f", rollout {rollout_id}",
                        result.num_engines, result.total_s, result.gather_s, result.control_s, result.bytes / 1e6)
            return result
        adapter = result.extra.get("lora_adapter_tensors")
        logger.info("weight sync v%d (%s%s%s) to %d engine(s): %.3fs total, gather %.3fs, transfer %.3fs, load %.3fs, "
                    "control %.3fs, %.1f MB, %.2f GB/s", version, self.mode,
                    "" if not trained_only else ", base kept by the engines" if self.lora_adapter
                    else ", trained tensors only: --lora-base-cpu-backup",
                    f", LoRA adapter {LORA_ADAPTER_NAME} ({int(adapter)} tensors)" if adapter else "", result.num_engines,
                    result.total_s,
                    result.gather_s, result.transfer_s, result.load_s, result.control_s, result.bytes / 1e6, result.gbps)
        return result

    def land(self) -> float:
        """Wait until a detached sync (``sync(detach=True)``) has been answered by its engines; the seconds waited
        (0.0 when none is in flight). Raises :class:`WeightSyncError` when it failed, or when it did not finish
        within ``--update-weight-timeout`` (then its thread may still hold the weight-update group: no later sync
        starts until that thread has ended; each raises saying so). Every wait here is bounded by that flag."""
        return self._land_detached()

    def take_landed(self) -> SyncResult | None:
        """The last detached sync that landed successfully, with what its thread measured (transfer, load, total
        seconds, GB/s; ``extra["rollout_id"]`` when ``sync`` named it), once: None until another lands. Not atomic
        across threads: train_async.py takes it on the event-loop thread only."""
        landed, self._landed = self._landed, None
        return landed

    def _log_landed(self, landed: SyncResult, waited: float) -> None:
        rollout = landed.extra.get("rollout_id")
        logger.info("weight sync v%d (%s, detached%s) landed: %.3fs total (%.3fs of it before sync returned), "
                    "transfer %.3fs, load %.3fs, %.1f MB, %.2f GB/s; waited %.3fs for it", landed.version, self.mode,
                    "" if rollout is None else f", rollout {int(rollout)}", landed.total_s,
                    landed.extra.get("returned_s", 0.0), landed.transfer_s, landed.load_s, landed.bytes / 1e6,
                    landed.gbps, waited)

    @property
    def detached_in_flight(self) -> bool:
        """A detached sync has not been landed yet."""
        return False  # only a transport that can detach (broadcast) overrides this and _land_detached

    def _land_detached(self) -> float:
        return 0.0

    def sync_one(self, engine: EngineTarget | None) -> SyncResult:
        """Bring one (new) engine to the current version before it is routed to. Collective: the other
        trainer ranks call it too (``engine`` matters only on the source rank)."""
        return self.sync([engine] if self.is_source and engine is not None else [], bump_version=False, full=True)

    def check(self) -> int:
        """``--check-weight-update-equal`` now (collective): every engine equals the trainer, bitwise."""
        from miles.weight_sync.check import check_weights_equal

        return check_weights_equal(self)

    def close(self) -> None:
        if self._loop is not None:
            for ctl in self._controls.values():
                try:
                    self._loop.submit(ctl.close()).result(5)
                except (FutureTimeout, RuntimeError, OSError):
                    pass
            self._loop.close()
            self._loop = None

    # -- for subclasses -------------------------------------------------------------------------------
    @abstractmethod
    def _sync(self, engines: list[EngineTarget], version: int) -> SyncResult:
        """Gather (all ranks) and transfer (source) one version; raise WeightSyncError on failure."""

    def iter_buckets(self, *, full: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets of this sync (collective): the trainer's weights, or with ``--lora-base-cpu-backup`` after the
        first sync only the trained ones; ``full``: all of them whatever the sync sends (the equality check)."""
        if self.lora_adapter:    # the frozen base (the adapters go by lora_adapter); nothing once the engines keep it
            if self._trained_only and not full:
                return iter(())
            return self.source.iter_base_weight_buckets(self.cfg.update_weight_buffer_size, self.dtype)
        if self._trained_only and not full:
            trained = getattr(self.source, "iter_trained_weight_buckets", None)
            if trained is None:
                raise WeightSyncError("--lora-base-cpu-backup: the weight source has no iter_trained_weight_buckets "
                                      "(a trainer backend without it refuses the flag at start; a bug)")
            return trained(self.cfg.update_weight_buffer_size, self.dtype)
        return self.source.iter_weight_buckets(self.cfg.update_weight_buffer_size, self.dtype)

    def timed_buckets(self, result: SyncResult) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``iter_buckets`` (collective), adding the time spent gathering to ``result.gather_s``."""
        it = self.iter_buckets()
        while True:
            t0 = time.monotonic()
            bucket = next(it, None)
            result.gather_s += time.monotonic() - t0
            if bucket is None:
                return
            yield bucket

    def control(self, engine: EngineTarget) -> Any:
        ctl = self._controls.get(engine.url)
        if ctl is None:
            ctl = self._controls[engine.url] = self._control_factory(engine, self.cfg.update_weight_timeout)
        return ctl

    def submit_all(self, engines: Sequence[EngineTarget], call: Callable[[Any], Awaitable[Any]]) -> list[Future]:
        """Start ``call(control)`` for every engine on the HTTP loop; returns one future per engine."""
        if self._loop is None:
            self._loop = _Loop()
        return [self._loop.submit(call(self.control(e))) for e in engines]

    def wait_all(self, engines: Sequence[EngineTarget], futures: list[Future], deadline: Deadline, step: str) -> list[Any]:
        """Wait for every future; the first failure (or the deadline) raises naming engine and step."""
        out = []
        for e, fut in zip(engines, futures):
            try:
                out.append(fut.result(timeout=deadline.left()))
            except FutureTimeout:
                for f in futures:
                    f.cancel()
                raise WeightSyncError(f"{step} on engine {e.url} did not answer within --update-weight-timeout="
                                      f"{deadline.seconds:g}s") from None
            except WeightSyncError:
                raise
            except Exception as exc:  # noqa: BLE001 - any engine-side failure becomes one clear error
                for f in futures:
                    f.cancel()
                raise WeightSyncError(f"{step} failed on engine {e.url}: {exc}") from exc
        return out

    def call_all(self, engines: Sequence[EngineTarget], call: Callable[[Any], Awaitable[Any]], deadline: Deadline, step: str) -> list[Any]:
        return self.wait_all(engines, self.submit_all(engines, call), deadline, step)

    def unload_adapter(self, engines: Sequence[EngineTarget], deadline: Deadline) -> None:
        """``/unload_lora_adapter`` of the run's adapter on every engine before a new one loads (both adapter
        transports); a failure there is fine: the first sync has nothing to unload."""
        async def unload(c: Any) -> None:
            try:
                await c.unload_lora_adapter(LORA_ADAPTER_NAME, timeout=deadline.left())
            except Exception as e:  # noqa: BLE001 - the first sync has nothing to unload
                logger.debug("unload_lora_adapter before the load: %s", e)
        self.call_all(engines, unload, deadline, "unload_lora_adapter")

    def begin(self, engines: Sequence[EngineTarget], deadline: Deadline) -> None:
        """pause -> begin_weight_update on every engine."""
        mode = self.cfg.pause_generation_mode
        self.call_all(engines, lambda c: c.pause_generation(mode), deadline, f"pause_generation(mode={mode})")
        self.call_all(engines, lambda c: c.begin_weight_update(), deadline, "begin_weight_update")

    def finish(self, engines: Sequence[EngineTarget], version: int, deadline: Deadline, *, versioned: bool = True) -> None:
        """end_weight_update -> [update_weight_version, only when not ``versioned``: no update call carried the
        version] -> flush_cache -> continue_generation."""
        self.call_all(engines, lambda c: c.end_weight_update(), deadline, "end_weight_update")
        if not versioned:
            self.call_all(engines, lambda c: c.update_weight_version(str(version)), deadline, "update_weight_version")
        if self.cfg.pause_generation_mode != "in_place":
            self.call_all(engines, lambda c: c.flush_cache(), deadline, "flush_cache")
        self.call_all(engines, lambda c: c.continue_generation(), deadline, "continue_generation")

    def whole_sync_mode(self, engines: Sequence[EngineTarget], deadline: Deadline) -> str | None:
        """The pause mode to send with a one-request sync (``whole_sync``), or None when some engine is not
        the embedded one (SGLang: the full choreography)."""
        return self.cfg.pause_generation_mode if self.all_embedded(engines, deadline) else None

    def all_embedded(self, engines: Sequence[EngineTarget], deadline: Deadline) -> bool:
        """Whether every engine is the embedded one (which serves miles's extensions: whole syncs, ordered
        buckets). Asks each engine's ``/get_server_info`` once; an engine that does not answer is taken for
        SGLang this time and asked again next sync."""
        unknown = [e for e in engines if e.url not in self._embedded]
        if unknown:
            async def probe(ctl: Any) -> bool:
                info = await ctl.get_server_info() if hasattr(ctl, "get_server_info") else None
                return isinstance(info, dict) and info.get("engine") == "miles-embedded"
            for e, fut in zip(unknown, self.submit_all(unknown, probe)):
                try:
                    self._embedded[e.url] = bool(fut.result(timeout=min(10.0, deadline.left())))
                except Exception as exc:  # noqa: BLE001 - the full choreography then, which reports real failures
                    logger.debug("get_server_info on %s: %s: %s", e.url, type(exc).__name__, exc)
        return bool(engines) and all(self._embedded.get(e.url, False) for e in engines)

    def _agree(self, err: BaseException | None) -> None:
        """Every trainer rank raises when any rank failed (over ``status_group``), else only the failing one."""
        if self.status_group is not None:
            import torch.distributed as dist

            flag = torch.tensor([1 if err is not None else 0], dtype=torch.int32)
            if dist.get_backend(self.status_group) == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.status_group)
            if err is None and int(flag.item()):
                raise WeightSyncError(f"weight sync v{self.weight_version + 1} failed on another trainer rank (see its log)")
        if err is not None:
            if isinstance(err, WeightSyncError):
                raise err
            raise WeightSyncError(f"weight sync ({self.mode}) failed: {err}") from err


def check_lora_adapter_mode(mode: str) -> None:
    """Adapters go to the engines as Miles sends them: ``/load_lora_adapter_from_tensors`` (colocated, ``tensor``) or
    ``/load_lora_adapter_from_distributed`` over the weight-update group (``broadcast``); Miles refuses LoRA with
    disk-delta, and p2p has no adapter path."""
    if mode not in ("tensor", "broadcast"):
        raise ConfigError(f"--sglang-enable-lora with --lora-rank syncs the LoRA adapters to the engines, which is "
                          f"built for the tensor (colocated: load_lora_adapter_from_tensors) and broadcast "
                          f"(load_lora_adapter_from_distributed) transports; --update-weight-transfer-mode {mode} is "
                          "not: use broadcast (or --colocate), or drop --sglang-enable-lora to sync merged weights.")


def _default_control(engine: EngineTarget, timeout: float) -> Any:
    from miles.fleet.client import EngineControl

    return EngineControl(engine.url, api_key=engine.api_key, timeout=timeout)


def resolve_mode(cfg: WeightSyncConfig, colocate: bool) -> str:
    """The transport for ``--update-weight-transfer-mode``. Colocated, ``broadcast`` (Miles's default) is the
    same-device hand-off: engine and trainer share each GPU, where NCCL cannot put two ranks (Miles, too,
    hands colocated weights over by CUDA IPC whatever the mode says). ``p2p`` needs separate devices."""
    mode = cfg.update_weight_transfer_mode
    if mode not in MODES:
        raise ConfigError(f"--update-weight-transfer-mode {mode!r} is not one of {', '.join(MODES)}")
    if colocate and mode == "broadcast":
        return "tensor"
    if colocate and mode == "p2p":
        raise ConfigError("--update-weight-transfer-mode p2p sends over a process group between separate devices and "
                          "cannot be used with --colocate; drop the flag (colocated runs hand weights over in place)")
    return mode


def build_weight_sender(cfg: WeightSyncConfig, source: WeightSource, *, colocate: bool = False, **kwargs: Any) -> WeightSender:
    """The sender for ``--update-weight-transfer-mode`` (``resolve_mode``: colocated broadcast is ``tensor``).

    ``kwargs`` go to the sender's constructor (is_source, engines, dtype, device, ...).
    """
    mode = resolve_mode(cfg, colocate)
    if mode == "broadcast":
        from miles.weight_sync.broadcast import BroadcastSender

        return BroadcastSender(cfg, source, **kwargs)
    if mode == "p2p":
        from miles.weight_sync.p2p import P2PSender

        return P2PSender(cfg, source, **kwargs)
    if mode == "tensor":
        from miles.weight_sync.tensor import TensorSender

        return TensorSender(cfg, source, **kwargs)
    if not cfg.update_weight_disk_dir:
        raise ConfigError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir "
                          "(a directory every engine can read)")
    from miles.weight_sync.disk_delta_sender import DiskDeltaSender

    return DiskDeltaSender(cfg, source, **kwargs)
