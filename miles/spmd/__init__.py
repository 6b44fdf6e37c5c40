"""The SPMD plane: one job, every rank the same program, roles from a pure plan.

    ctx = bootstrap(cfg)          # detect the launcher, build the plan, init torch.distributed, groups
    ctx.world.rank, ctx.plan.role_of(ctx.world.rank), ctx.groups.control_group

Modules: ``world`` (launchers, master address, init), ``roles`` (RolePlan), ``groups`` (process groups
in a fixed order), ``supervisor`` (engine child processes), ``numa`` (GPU rank binding), ``errors``
(``run_main``: one readable line per rank for known errors), ``smoke`` (a collective smoke test).
Importing this package does not import torch: a bad plan fails before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.spmd.errors import run_main
from miles.spmd.roles import DRIVER, ENGINE_LEADER, ENGINE_WORKER, TRAINER, EngineSpec, RolePlan, build_role_plan
from miles.spmd.world import World, detect_world, init_distributed, read_launch_env
from miles.utils.logging import configure_logging, get_logger, set_role

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.spmd.groups import Groups

__all__ = ["SPMDContext", "bootstrap", "run_main", "build_role_plan", "detect_world", "init_distributed",
           "RolePlan", "EngineSpec", "World"]

logger = get_logger(__name__)


@dataclass
class SPMDContext:
    world: World
    plan: RolePlan
    groups: Groups

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def roles(self) -> set[str]:
        return self.plan.role_of(self.world.rank)

    @property
    def engine(self) -> EngineSpec | None:
        return self.plan.engine_of(self.world.rank)

    @property
    def is_driver(self) -> bool:
        return DRIVER in self.roles

    @property
    def is_trainer(self) -> bool:
        return TRAINER in self.roles

    @property
    def is_engine_leader(self) -> bool:
        return ENGINE_LEADER in self.roles

    def close(self) -> None:
        """Destroy every process group (the end of a clean run)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def role_label(roles: set[str]) -> str:
    """The log prefix's role: driver > trainer > engine."""
    if DRIVER in roles:
        return "driver"
    if TRAINER in roles:
        return "trainer"
    if roles & {ENGINE_LEADER, ENGINE_WORKER}:
        return "engine"
    return "idle"


def bootstrap(cfg: MilesConfig) -> SPMDContext:
    """Detect the world, build the plan (failing on every rank before any collective), init, groups."""
    from miles.spmd.roles import check_placement

    cluster = cfg.cluster
    launch = read_launch_env()
    configure_logging(rank=launch.rank, role="main", level=cfg.output.log_level)
    plan = build_role_plan(cluster, launch.world_size) if launch.world_size else None
    world = detect_world(cluster)  # may share the master address over MPI
    if plan is None:  # PMIx without a size in the environment: known only after the MPI exchange
        plan = build_role_plan(cluster, world.world_size)
    check_placement(plan, world.rank, world.node_rank, world.num_nodes, world.local_world_size,
                    on_gpu=world.device.type == "cuda")
    configure_logging(rank=world.rank, role=role_label(plan.role_of(world.rank)), level=cfg.output.log_level)
    set_role(role_label(plan.role_of(world.rank)))
    if world.rank == plan.driver_rank:
        logger.info("launcher %s, %d rank(s) on %d node(s), device %s\n%s", world.launcher, world.world_size,
                    world.num_nodes, world.device, plan.describe())
    init_distributed(world, cluster)
    from miles.spmd.groups import create_groups

    groups = create_groups(plan, world, cluster)
    return SPMDContext(world=world, plan=plan, groups=groups)
