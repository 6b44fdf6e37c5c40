"""The role plan: which rank trains, which hosts an engine, which drives. Pure and identical everywhere.

``build_role_plan(cluster, world_size)`` depends only on Miles's cluster flags and the world size, so
every rank computes the same plan without talking to the others, and a plan that does not fit the
launch fails on every rank before any collective.

Layouts (P = --num-gpus-per-node, G = --rollout-num-gpus-per-engine; on CPU a GPU is a rank slot):

- disaggregated: trainer ranks ``0..A-1`` (A = --actor-num-nodes x --actor-num-gpus-per-node), then
  --rollout-num-gpus ranks cut into engines of G consecutive ranks; world size A + R.
- colocated (--colocate): engines laid over the first R trainer ranks (R defaults to A); world size A.
- --debug-train-only: trainers only. --debug-rollout-only: engines only, from rank 0.
- the critic (PPO) shares the actor's ranks; global rank 0 is always the driver.

Rank r sits on node ``r // P`` at local GPU ``r % P``. An engine never straddles a node unless G
exceeds a node, in which case it spans G / P whole nodes and has one leader per node (``node_ranks``).
Each leader starts the engine process for its node (supervisor.py); the other ranks of the engine
are ``engine_worker`` placeholders whose GPUs the engine process uses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from miles.config.base import ConfigError
from miles.config.cluster import ClusterConfig

TRAINER, ENGINE_LEADER, ENGINE_WORKER, DRIVER = "trainer", "engine_leader", "engine_worker", "driver"
_LAUNCH_HINT = "torchrun --nnodes x --nproc-per-node, mpirun -n, or srun --ntasks"


@dataclass(frozen=True)
class EngineSpec:
    """One inference engine: G consecutive ranks, whose first rank leads it."""

    engine_id: int
    ranks: list[int]
    leader_rank: int
    node_index: int  # node of the leader
    base_gpu_id: int  # local GPU index of the leader (the engine uses base_gpu_id .. base_gpu_id + G - 1 per node)
    num_gpus: int
    nnodes: int
    node_ranks: list[int]  # one leader per node, node 0's first (== leader_rank)

    def engine_node_rank(self, rank: int) -> int:
        """The index of rank's node within this engine (SGLang's --node-rank for a multi-node engine)."""
        for i, leader in enumerate(self.node_ranks):
            nxt = self.node_ranks[i + 1] if i + 1 < len(self.node_ranks) else self.ranks[-1] + 1
            if leader <= rank < nxt:
                return i
        raise ValueError(f"rank {rank} is not part of engine {self.engine_id} ({self.ranks})")


@dataclass(kw_only=True)
class RolePlan:
    trainer_ranks: list[int]
    engines: list[EngineSpec]
    colocate: bool
    driver_rank: int = 0
    num_gpus_per_node: int = 8
    world_size: int = 1
    mode: str = "disaggregated"  # disaggregated | colocated | train-only | rollout-only
    _engine_by_rank: dict[int, EngineSpec] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for spec in self.engines:
            for r in spec.ranks:
                self._engine_by_rank[r] = spec

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.num_gpus_per_node)

    @property
    def rollout_ranks(self) -> list[int]:
        return [r for spec in self.engines for r in spec.ranks]

    @property
    def critic_ranks(self) -> list[int]:
        """The critic (PPO) shares the actor's ranks."""
        return list(self.trainer_ranks)

    def node_of(self, rank: int) -> int:
        return rank // self.num_gpus_per_node

    def local_gpu_of(self, rank: int) -> int:
        return rank % self.num_gpus_per_node

    def engine_of(self, rank: int) -> EngineSpec | None:
        return self._engine_by_rank.get(rank)

    def role_of(self, rank: int) -> set[str]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        roles = set()
        if rank == self.driver_rank:
            roles.add(DRIVER)
        if rank in self.trainer_ranks:
            roles.add(TRAINER)
        spec = self.engine_of(rank)
        if spec is not None:
            roles.add(ENGINE_LEADER if rank in spec.node_ranks else ENGINE_WORKER)
        return roles

    def describe(self) -> str:
        """A table of ranks -> roles, node and local GPU, then one line per engine."""
        lines = [f"role plan: {self.mode}, {self.world_size} rank(s) on {self.num_nodes} node(s) "
                 f"({self.num_gpus_per_node} GPU slots per node), driver rank {self.driver_rank}",
                 f"{'rank':>5} {'node':>5} {'gpu':>4}  {'roles':<30} engine"]
        order = (DRIVER, TRAINER, ENGINE_LEADER, ENGINE_WORKER)
        for r in range(self.world_size):
            roles = self.role_of(r)
            spec = self.engine_of(r)
            names = ",".join(x for x in order if x in roles) or "idle"
            lines.append(f"{r:>5} {self.node_of(r):>5} {self.local_gpu_of(r):>4}  {names:<30} "
                         f"{spec.engine_id if spec else '-'}")
        for spec in self.engines:
            lines.append(f"engine {spec.engine_id}: ranks {spec.ranks[0]}-{spec.ranks[-1]}, leader {spec.leader_rank} "
                         f"on node {spec.node_index}, GPUs {spec.base_gpu_id}..{spec.base_gpu_id + min(spec.num_gpus, self.num_gpus_per_node) - 1}"
                         f" per node, {spec.nnodes} node(s), node leaders {spec.node_ranks}")
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """A short digest of the plan; ranks compare it to prove they all built the same one."""
        return hashlib.sha1(self.describe().encode()).hexdigest()[:12]


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")


def _check_critic(c: ClusterConfig) -> None:
    for critic, actor in (("critic_num_nodes", "actor_num_nodes"), ("critic_num_gpus_per_node", "actor_num_gpus_per_node")):
        cv, av = getattr(c, critic), getattr(c, actor)
        if cv is not None and cv != av:
            raise ConfigError(f"the critic shares the actor's ranks: --{critic.replace('_', '-')} {cv} must equal "
                              f"--{actor.replace('_', '-')} {av}. Fix: drop --{critic.replace('_', '-')} or set it to {av}.")


def _rollout_gpus(c: ClusterConfig, world_size: int, actor_gpus: int) -> int:
    if c.debug_train_only:
        return 0
    if c.debug_rollout_only:
        return c.rollout_num_gpus if c.rollout_num_gpus is not None else world_size
    if c.colocate:
        r = c.rollout_num_gpus if c.rollout_num_gpus is not None else actor_gpus
        if r > actor_gpus:
            raise ConfigError(
                f"colocated plan: expected at most {actor_gpus} rollout GPUs (the trainer's: --actor-num-nodes "
                f"{c.actor_num_nodes} x --actor-num-gpus-per-node {c.actor_num_gpus_per_node}), found --rollout-num-gpus {r}. "
                f"Fix: --rollout-num-gpus {actor_gpus} (or omit it), raise --actor-num-gpus-per-node, or drop --colocate.")
        return r
    if c.rollout_num_gpus is not None:
        return c.rollout_num_gpus
    left = world_size - actor_gpus
    if left <= 0:
        raise ConfigError(
            f"disaggregated plan: the world has {world_size} rank(s) and the trainer takes {actor_gpus} (--actor-num-nodes "
            f"{c.actor_num_nodes} x --actor-num-gpus-per-node {c.actor_num_gpus_per_node}), leaving none for engines. "
            f"Fix: pass --rollout-num-gpus R and launch {actor_gpus} + R ranks ({_LAUNCH_HINT}), or --colocate, "
            "or --debug-train-only.")
    return left


def _expected_world(c: ClusterConfig, actor_gpus: int, rollout_gpus: int) -> tuple[int, str]:
    trainer = (f"trainer {actor_gpus} (--actor-num-nodes {c.actor_num_nodes} x --actor-num-gpus-per-node "
               f"{c.actor_num_gpus_per_node})")
    rollout = f"rollout {rollout_gpus} (--rollout-num-gpus)"
    if c.debug_rollout_only:
        return rollout_gpus, f"{rollout}, --debug-rollout-only"
    if c.debug_train_only:
        return actor_gpus, f"{trainer}, --debug-train-only"
    if c.colocate:
        return actor_gpus, f"{trainer}, engines colocated on them"
    return actor_gpus + rollout_gpus, f"{trainer} + {rollout}"


def _make_engine(engine_id: int, ranks: list[int], p: int) -> EngineSpec:
    g = len(ranks)
    first, last = ranks[0], ranks[-1]
    flags = (f"--num-gpus-per-node {p}, --rollout-num-gpus-per-engine {g}")
    if g <= p:
        if first // p != last // p:
            raise ConfigError(
                f"engine {engine_id} would take ranks {first}-{last}, across nodes {first // p} and {last // p} ({flags}): "
                f"an engine of {g} GPUs must fit in one node. Fix: make the rollout ranks start on a node boundary "
                f"(trainer GPUs a multiple of {g}, e.g. --actor-num-gpus-per-node) or pick a "
                "--rollout-num-gpus-per-engine that divides --num-gpus-per-node.")
        node_ranks = [first]
    else:
        if g % p or first % p:
            raise ConfigError(
                f"engine {engine_id} spans ranks {first}-{last} ({flags}): an engine larger than a node must take whole "
                f"nodes, so --rollout-num-gpus-per-engine must be a multiple of {p} and start on a node boundary. "
                f"Fix: --rollout-num-gpus-per-engine {(g // p + 1) * p} or {p}, or adjust the trainer's GPUs.")
        node_ranks = ranks[::p]
    return EngineSpec(engine_id=engine_id, ranks=list(ranks), leader_rank=first, node_index=first // p,
                      base_gpu_id=first % p, num_gpus=g, nnodes=len(node_ranks), node_ranks=list(node_ranks))


def build_role_plan(cluster: ClusterConfig, world_size: int) -> RolePlan:
    """The plan for ``world_size`` ranks under these flags; raises ConfigError naming the flag to change."""
    c = cluster
    if c.debug_train_only and c.debug_rollout_only:
        raise ConfigError("--debug-train-only and --debug-rollout-only exclude each other: pass at most one.")
    for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "num_gpus_per_node"):
        _positive(name, getattr(c, name))
    if c.rollout_num_gpus is not None and c.rollout_num_gpus < 0:
        raise ConfigError(f"--rollout-num-gpus must be >= 0, got {c.rollout_num_gpus}.")
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}; check the launch command ({_LAUNCH_HINT}).")
    _check_critic(c)
    p, g = c.num_gpus_per_node, c.rollout_num_gpus_per_engine
    actor_gpus = 0 if c.debug_rollout_only else c.actor_num_nodes * c.actor_num_gpus_per_node
    rollout_gpus = _rollout_gpus(c, world_size, actor_gpus)
    if rollout_gpus % g:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {g} does not divide {rollout_gpus} rollout GPUs (--rollout-num-gpus"
            f"{'' if c.rollout_num_gpus is not None else ', derived'}): the engine size must divide the rollout GPUs. Fix: "
            f"--rollout-num-gpus {max(g, rollout_gpus - rollout_gpus % g)} or a --rollout-num-gpus-per-engine dividing {rollout_gpus}.")
    expected, breakdown = _expected_world(c, actor_gpus, rollout_gpus)
    if expected != world_size:
        raise ConfigError(
            f"world size mismatch: the plan needs {expected} rank(s) ({breakdown}), but the launcher started "
            f"{world_size}. Fix: launch {expected} ranks ({_LAUNCH_HINT}), or change --actor-num-gpus-per-node/"
            "--actor-num-nodes/--rollout-num-gpus to fit the launch.")
    if c.debug_rollout_only:
        mode, start = "rollout-only", 0
    elif c.debug_train_only:
        mode, start = "train-only", 0
    elif c.colocate:
        mode, start = "colocated", 0
    else:
        mode, start = "disaggregated", actor_gpus
    engines = [_make_engine(e, list(range(start + e * g, start + (e + 1) * g)), p) for e in range(rollout_gpus // g)]
    return RolePlan(trainer_ranks=list(range(actor_gpus)), engines=engines, colocate=mode == "colocated",
                    driver_rank=0, num_gpus_per_node=p, world_size=world_size, mode=mode)


def check_placement(plan: RolePlan, rank: int, node_rank: int, num_nodes: int, local_world_size: int,
                    on_gpu: bool = False) -> None:
    """The launcher's real placement must match the plan's nodes (``rank // --num-gpus-per-node``).

    Every rank sees the same local world size under a homogeneous launch, so a mismatch fails
    everywhere; a rank-specific mismatch (round-robin mapping) fails on that rank and the launcher
    ends the job. On CPU one node may simulate several (a GPU is a rank slot); on GPU it may not,
    since engines take GPU ``rank % --num-gpus-per-node`` while trainers take ``cuda:<local rank>``.
    """
    p = plan.num_gpus_per_node
    if on_gpu and num_nodes == 1 and plan.num_nodes > 1:
        raise ConfigError(
            f"node layout mismatch: the plan spreads {plan.world_size} ranks over {plan.num_nodes} nodes of "
            f"--num-gpus-per-node {p} GPUs, but the launcher ran all of them on this one GPU node. Fix: "
            f"--num-gpus-per-node {local_world_size} (the ranks on this node), or launch {p} ranks per node.")
    if num_nodes > 1 and local_world_size != p:
        raise ConfigError(
            f"node layout mismatch: the plan puts --num-gpus-per-node {p} ranks on each node, but the launcher put "
            f"{local_world_size} on this node ({num_nodes} nodes). Fix: --num-gpus-per-node {local_world_size}, or "
            f"launch {p} ranks per node (torchrun --nproc-per-node, mpirun -npernode, srun --ntasks-per-node).")
    if num_nodes > 1 and plan.node_of(rank) != node_rank:
        raise ConfigError(
            f"rank {rank} runs on node {node_rank}, but the plan expects node {plan.node_of(rank)} (ranks are placed "
            "in blocks of --num-gpus-per-node). Fix: map ranks by node in blocks (mpirun --map-by slot, srun "
            "--distribution=block).")
