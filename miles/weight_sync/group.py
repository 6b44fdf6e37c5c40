"""Weight-update process groups outside the torch world: a TCPStore we host, one group per formation.

The trainer's source rank hosts ``TCPStore(host, port, is_master=True)`` itself (under torchrun a
``tcp://`` rendezvous would only ever be a client: ``TORCHELASTIC_USE_AGENT_STORE``) and every formation
of the group lives on ``PrefixStore(group_name, store)``, so re-forming after an engine restart never
collides with an earlier formation's keys. Engines connect to the same store as clients.

The group is built exactly as SGLang's ``init_custom_process_group`` builds it (torch's
``_new_process_group_helper`` on the prefixed store, gloo on CPU, NCCL on GPU), so both ends use the
same store keys whether the engine is SGLang or the embedded engine. It is not part of the default
world: nothing here needs ``init_process_group`` and nothing disturbs the trainer's own groups. Every blocking step (rendezvous, each broadcast) is bounded by a timeout and
turned into :class:`WeightGroupError` naming the group and the step.
"""

from __future__ import annotations

import datetime
import inspect
import time

import torch
import torch.distributed as dist

from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)


class WeightGroupError(MilesError):
    """A weight-update group could not form or a collective on it failed or timed out."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def _new_group(name: str, store: dist.Store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta,
               device: torch.device | None) -> dist.ProcessGroup:
    """The group exactly as SGLang's ``init_custom_process_group`` builds it (same store keys), so the
    trainer's side meets SGLang engines and the embedded engine alike."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    params = inspect.signature(_new_process_group_helper).parameters
    kwargs: dict = {"backend_options" if "backend_options" in params else "pg_options": None, "timeout": timeout}
    if backend == "nccl" and device is not None and "device_id" in params:
        kwargs["device_id"] = device
    # When this process's default group was bound to a device (an NCCL trainer world initialised with
    # device_id), torch would build the new group by ncclCommSplit of the default group, which the
    # engines are not part of: hide the binding while the group is created so it rendezvous on the store.
    default = _world.default_pg if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None) if default is not None else None
    if bound is not None:
        default.bound_device_id = None
    try:
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), dist.PrefixStore(name, store),
                                          group_name=name, **kwargs)
    finally:
        if bound is not None:
            default.bound_device_id = bound
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def host_store(port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """Host a TCPStore on this process (listening on all interfaces); ``port=0`` lets the OS pick.

    The chosen port is ``store.port``.
    """
    try:
        return dist.TCPStore("0.0.0.0", port, None, True, _td(timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise WeightGroupError(f"could not host the weight-update TCPStore on port {port}: {e}") from e


def connect_store(host: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Connect to a store hosted elsewhere (the engine side of ``/init_weights_update_group``)."""
    try:
        return dist.TCPStore(host, int(port), None, False, _td(timeout_s))
    except (RuntimeError, OSError) as e:
        raise WeightGroupError(f"could not reach the weight-update TCPStore at {host}:{port} within {timeout_s}s: {e}") from e


class WeightGroup:
    """One formation of a weight-update group. Rank 0 is the trainer's source rank.

    Construction blocks until all ``world_size`` members have joined (bounded by ``timeout_s``).
    """

    def __init__(self, name: str, store: dist.Store, rank: int, world_size: int, backend: str,
                 timeout_s: float = 300.0, device: torch.device | None = None) -> None:
        self.name, self.rank, self.world_size, self.backend = name, rank, world_size, backend
        self.timeout_s = float(timeout_s)
        self.device = device
        t0 = time.monotonic()
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-update group backend must be 'gloo' or 'nccl', got {backend!r}")
        try:
            self.pg = _new_group(name, store, rank, world_size, backend, _td(timeout_s), device)
            if backend == "nccl" and device is not None:
                # form the communicator now (bounded), not lazily inside the first broadcast
                self.broadcast(torch.zeros(1, dtype=torch.uint8, device=device), what="warm-up")
        except (RuntimeError, dist.DistError) as e:
            raise WeightGroupError(f"weight-update group {name!r} (rank {rank}/{world_size}, {backend}) did not form "
                                   f"within {timeout_s:.0f}s: {e}") from e
        logger.debug("weight-update group %s formed (rank %d/%d, %s) in %.3fs", name, rank, world_size, backend, time.monotonic() - t0)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None, what: str = "broadcast") -> None:
        """Broadcast ``tensor`` in place from group rank ``src``; raises WeightGroupError on failure/timeout."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            work = dist.broadcast(tensor, group_src=src, group=self.pg, async_op=True)
            if not work.wait(_td(timeout)):
                raise RuntimeError(f"timed out after {timeout:.0f}s")
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()
        except (RuntimeError, dist.DistError) as e:
            self.abort()
            raise WeightGroupError(f"weight-update group {self.name!r}: {what} of {tensor.numel() * tensor.element_size()} bytes "
                                   f"failed (a member died or stalled?): {e}") from e

    def abort(self) -> None:
        """Tear the communicator down without waiting for peers (used after a failure)."""
        if self.pg is None:
            return
        fn = getattr(self.pg, "abort", None)
        try:
            if fn is not None:
                fn()
        except RuntimeError as e:
            logger.debug("weight-update group %s abort: %s", self.name, e)
        self.destroy()

    def destroy(self) -> None:
        pg, self.pg = self.pg, None
        if pg is None:
            return
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError) as e:
            logger.debug("weight-update group %s destroy: %s", self.name, e)
