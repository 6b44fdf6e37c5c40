"""Process groups of the job, created in one fixed order on every rank.

Order (every rank calls every ``new_group``, member or not, as torch requires):

1. ``trainer``      the trainer ranks, device backend (NCCL on GPU, gloo on CPU), plus a 1-D
                    DeviceMesh ("dp") built from it for FSDP2 on the trainer ranks;
2. ``trainer_cpu``  gloo over the trainer ranks (objects, metadata); on CPU the trainer group itself;
3. ``engine<i>``    one gloo group per engine, in engine order: control among an engine's ranks.
                    The engine's GPUs belong to the engine process, never to these groups;
4. ``control``      gloo over all ranks: the driver's commands and small objects.

Every group gets the --distributed-timeout-minutes timeout. ``Groups.guard(name)`` turns a timed-out
or broken collective into one clear error naming the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from miles.config.cluster import ClusterConfig
from miles.spmd.errors import CollectiveTimeoutError, PeerGoneError
from miles.spmd.roles import RolePlan
from miles.spmd.world import World, distributed_timeout, resolve_backend
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

logger = get_logger(__name__)

_TIMEOUT_MARKERS = ("timed out", "timeout", "time out")
_PEER_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
                 "connection refused", "nccl communicator was aborted", "remote process exited")


@dataclass
class Groups:
    trainer_group: ProcessGroup | None
    trainer_mesh: DeviceMesh | None
    engine_groups: dict[int, ProcessGroup | None]
    control_group: ProcessGroup
    trainer_cpu_group: ProcessGroup | None
    timeout: timedelta = field(default=timedelta(minutes=10))

    @contextlib.contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Run collectives on group ``name``; a timeout or a dead peer becomes one readable error."""
        try:
            yield
        except RuntimeError as e:
            raise translate_collective_error(e, name, self.timeout) from e
        except TimeoutError as e:  # a bounded wait (miles.trainer.collectives) ended by the backend's own error
            gone = translate_collective_error(e.__cause__, name, self.timeout) if isinstance(
                e.__cause__, RuntimeError) else e
            if isinstance(gone, PeerGoneError):  # a member exited: say so, not "timed out after 600s"
                raise gone from e
            raise


def translate_collective_error(exc: BaseException, name: str, timeout: timedelta) -> BaseException:
    """Map a backend error to CollectiveTimeoutError / PeerGoneError; return others unchanged."""
    if isinstance(exc, CollectiveTimeoutError | PeerGoneError):  # translated already, by an inner guard
        return exc
    text = " ".join(str(exc).split()).split(" This is typically caused by")[0]  # gloo's advice to its own users
    low = text.lower()
    minutes = timeout.total_seconds() / 60
    if any(m in low for m in _PEER_MARKERS):
        return PeerGoneError(f"a member of group '{name}' exited during a collective ({text[:160]}); the first "
                             "failure is in that rank's log.")
    if any(m in low for m in _TIMEOUT_MARKERS):
        return CollectiveTimeoutError(
            f"collective on group '{name}' did not finish within {minutes:g} min: a member rank is dead or stuck "
            f"(see its log); if it is only slow, raise --distributed-timeout-minutes. ({text[:160]})")
    return exc


def _member(group: Any) -> ProcessGroup | None:
    import torch.distributed as dist

    return None if group is None or group == dist.GroupMember.NON_GROUP_MEMBER else group


def create_groups(plan: RolePlan, world: World, cluster: ClusterConfig) -> Groups:
    """Create every group of the plan (see the module docstring for the order)."""
    import torch.distributed as dist

    assert dist.is_initialized(), "init_distributed() comes before create_groups()"
    assert plan.world_size == world.world_size, (plan.world_size, world.world_size)
    timeout = distributed_timeout(cluster)
    backend = resolve_backend(world, cluster)
    trainer_group = trainer_cpu_group = None
    if plan.trainer_ranks:
        trainer_group = _member(dist.new_group(plan.trainer_ranks, timeout=timeout, backend=backend, group_desc="trainer"))
        if backend == "gloo":
            trainer_cpu_group = trainer_group
        else:
            trainer_cpu_group = _member(dist.new_group(plan.trainer_ranks, timeout=timeout, backend="gloo",
                                                       group_desc="trainer_cpu"))
    engine_groups: dict[int, ProcessGroup | None] = {}
    for spec in plan.engines:
        engine_groups[spec.engine_id] = _member(dist.new_group(spec.ranks, timeout=timeout, backend="gloo",
                                                               group_desc=f"engine{spec.engine_id}"))
    control_group = dist.new_group(list(range(world.world_size)), timeout=timeout, backend="gloo", group_desc="control")
    mesh = None
    if trainer_group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(trainer_group, world.device.type, mesh_dim_names=("dp",))
    logger.debug("groups: trainer %s, %d engine group(s), control over %d ranks", plan.trainer_ranks,
                 len(engine_groups), world.world_size)
    return Groups(trainer_group=trainer_group, trainer_mesh=mesh, engine_groups=engine_groups,
                  control_group=control_group, trainer_cpu_group=trainer_cpu_group, timeout=timeout)
