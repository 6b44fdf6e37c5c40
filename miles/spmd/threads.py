"""CPU threads per process: each process that computes in a phase of the loop gets its share of the cores.

In ``train.py``'s loop the phases take turns: the engines generate while the trainer ranks wait for the
samples, then the trainer ranks train (and send the weights) while the engines wait. A process that waits
blocks (gloo collectives, HTTP awaits, the engine's idle scheduler: no spinning), so the processes of one
phase may use every core the job has on the node. Each trainer rank's torch intra-op threads and each engine
process's (its ``OMP_NUM_THREADS``) are therefore its share among the processes that compute *at the same
time*, not among all processes of the node:

    trainer rank r:   |cpus(r)| // (trainer ranks whose CPUs overlap r's)
    engine e:         |cpus(e)| // (engine processes whose CPUs overlap e's)
    train_async.py:   trainer ranks and engines compute at once: one share among all of them

``cpus(r)`` is the rank's CPU affinity as the launcher left it (Slurm's per-task binding, the GPU ranks' NUMA
binding, a cgroup ``cpu.max`` quota), so ranks bound to separate cores never share, and ranks that share a
set split it. An engine process runs on its leader rank's CPUs. Every process gets at least one thread.

``OMP_NUM_THREADS`` set by the user (in the environment or ``--train-env-vars``) fixes the count of every
process of the job instead, as in plain torch. torchrun sets ``OMP_NUM_THREADS=1`` for its workers when the
user gave none and it starts several a node; that value is torchrun's, not a choice, and the plan replaces it.

Between two parallel regions an OpenMP worker busy-waits before it sleeps: libgomp's default is 300,000 spins,
~3.5 ms here, so a process that ends its phase keeps a core busy into the next phase, and on a machine where
other jobs run a thread spins while the peer it waits for is descheduled. :func:`default_openmp_env` sets
``GOMP_SPINCOUNT=10000`` (~0.1 ms) for the job's processes unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is
given; it must run before torch loads libgomp.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from miles.config.base import ConfigError
from miles.spmd.roles import RolePlan


@dataclass(frozen=True)
class CpuThreads:
    """Threads of this rank's processes: ``trainer`` (this rank, when it trains) and ``engine`` (the engine
    process this rank starts, when it generates); ``source`` says where the counts come from."""

    trainer: int
    engine: int
    source: str  # "phases" (the plan above) or "OMP_NUM_THREADS" (fixed by the user)


def describe_threads(plan: RolePlan, per_rank: Sequence[CpuThreads]) -> str:
    """One line for the whole job: the counts of its trainer ranks and engine processes (``per_rank[r]``)."""
    if per_rank and per_rank[0].source == "OMP_NUM_THREADS":
        return f"CPU threads: {per_rank[0].trainer} in every process (OMP_NUM_THREADS)"

    def counts(values: list[int]) -> str:
        return "/".join(str(v) for v in sorted(set(values))) or "-"

    return (f"CPU threads: {counts([per_rank[r].trainer for r in plan.trainer_ranks])} per trainer rank while it "
            f"trains, {counts([per_rank[r].engine for r in engine_processes(plan)])} per engine process while it "
            "generates (the cores of a node shared by the processes of each phase; OMP_NUM_THREADS=N fixes N)")


SPIN_COUNT = "10000"


def default_openmp_env(env: dict[str, str] | None = None) -> bool:
    """``GOMP_SPINCOUNT=SPIN_COUNT`` in ``env`` (default ``os.environ``, inherited by the engine processes) unless
    the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``; True when it set it. Only a process that has not loaded
    torch yet takes it (libgomp reads it once, when torch loads it)."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def usable_cpus(pid: int = 0) -> list[int]:
    """The CPUs this process may run on: its affinity, cut to a cgroup v2 ``cpu.max`` quota when one is lower."""
    cpus = sorted(os.sched_getaffinity(pid))
    quota = _cgroup_quota()
    return cpus[:quota] if quota is not None and quota < len(cpus) else cpus


def _cgroup_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """``cpu.max``'s quota / period, rounded up (None without a quota)."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return max(1, math.ceil(int(quota) / int(period))) if quota != "max" else None
    except (OSError, ValueError):
        return None


def user_omp_threads(env: Mapping[str, str] | None = None, launcher_env: Mapping[str, str] | None = None,
                     train_env_vars: Mapping[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` as the user set it; None when unset or set by torchrun for its workers.

    ``launcher_env``: the environment the launcher process was started with (default: the parent's, read from
    ``/proc`` under torchrun); a value torchrun added itself is absent there. ``train_env_vars``: what
    ``--train-env-vars`` set (the user's too)."""
    env = os.environ if env is None else env
    raw = env.get("OMP_NUM_THREADS")
    if raw is None or not raw.strip():
        return None
    if "TORCHELASTIC_RUN_ID" in env and "OMP_NUM_THREADS" not in (train_env_vars or {}):
        # a torchrun worker: was the value in torchrun's own environment?
        parent = _parent_env() if launcher_env is None else launcher_env
        if parent is not None and "OMP_NUM_THREADS" not in parent:
            return None
    first = raw.split(",")[0].strip()  # OpenMP's list form "4,2": the outer level's count
    if not first.isdigit() or int(first) < 1:
        raise ConfigError(f"OMP_NUM_THREADS={raw!r} is not a positive whole number: give e.g. OMP_NUM_THREADS=4, or "
                          "unset it (each process then gets its share of the node's cores in the phases it computes)")
    return int(first)


def _parent_env() -> dict[str, str] | None:
    """The parent process's initial environment (None when it cannot be read)."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def cpu_ranges(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (what ranks exchange: short even for a large node)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] + 1 == c:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def parse_cpu_ranges(text: str) -> list[int]:
    """The inverse of :func:`cpu_ranges`."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def engine_processes(plan: RolePlan) -> list[int]:
    """The rank that starts each engine process (one per engine and node: its node leaders)."""
    return [r for spec in plan.engines for r in spec.node_ranks]


def plan_threads(plan: RolePlan, rank: int, cpus: Sequence[Sequence[int]], *, overlap: bool,
                 fixed: int | None = None) -> CpuThreads:
    """This rank's :class:`CpuThreads`. ``cpus[r]``: rank r's usable CPUs (:func:`usable_cpus`, every rank's);
    ``overlap``: trainer ranks and engines compute at the same time (``train_async.py``); ``fixed``: the user's
    ``OMP_NUM_THREADS`` (:func:`user_omp_threads`)."""
    if fixed is not None:
        return CpuThreads(trainer=fixed, engine=fixed, source="OMP_NUM_THREADS")
    if len(cpus) != plan.world_size:
        raise ValueError(f"plan_threads: {len(cpus)} CPU sets for a world of {plan.world_size}")
    sets = [frozenset(c) for c in cpus]
    trainers, engines = list(plan.trainer_ranks), engine_processes(plan)

    def share(r: int, peers: list[int]) -> int:
        mine = sets[r]
        sharing = sum(1 for p in peers if plan.node_of(p) == plan.node_of(r) and sets[p] & mine)
        return max(1, len(mine) // max(1, sharing))

    train_peers = trainers + engines if overlap else trainers
    engine_peers = trainers + engines if overlap else engines
    return CpuThreads(trainer=share(rank, train_peers) if rank in trainers else 1,
                      engine=share(rank, engine_peers) if rank in engines else 1, source="phases")
