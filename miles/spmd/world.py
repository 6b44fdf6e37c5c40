"""Who am I in this job? Launcher detection, the master address, and torch.distributed start-up.

Every rank runs the same program under one of these launchers; each writes its own variables:

=========  ===========================================================  ==========================
launcher   rank / size / local rank / local size                         master address comes from
=========  ===========================================================  ==========================
torchrun   RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE (GROUP_RANK)      MASTER_ADDR/PORT (agent)
openmpi    OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE               --master-addr, or mpi4py
mpich      PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS (Hydra)     --master-addr, or mpi4py
pmix       PMIX_RANK (size from SLURM_NTASKS or mpi4py)                  --master-addr, or mpi4py
slurm      SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NODEID          first host of the step
single     nothing: a world of one                                       127.0.0.1
=========  ===========================================================  ==========================

``read_launch_env`` only parses variables (no torch, no MPI), so a bad plan fails on every rank
within a second. ``detect_world`` completes it: the master address and port, node placement from an
MPI host exchange when needed, and the device. MPI is used only for that exchange (mpi4py, imported
lazily, then finalised); torch's CPU build has no MPI backend, so collectives run on gloo/NCCL over TCP.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

from miles.config.base import ConfigError
from miles.config.cluster import ClusterConfig
from miles.utils.logging import get_logger, warn_once
from miles.utils.net import find_free_port, host_address

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

MPI_LAUNCHERS = ("openmpi", "mpich", "pmix")


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: str
    hostname: str
    device: torch.device


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher's variables say, before any communication. master_* may be None."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    node_rank: int | None
    num_nodes: int | None
    master_addr: str | None
    master_port: int | None
    nodelist: str | None = None  # Slurm: the step's hosts; the first one is rank 0's


def _int(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            try:
                return int(value)
            except ValueError as e:
                raise ConfigError(f"launcher variable {name}={value!r} is not an integer; check the launch command.") from e
    return None


def parse_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compact task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"cannot parse SLURM tasks-per-node value {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list (``gpu[01-03,7],cpu5``) without scontrol."""
    hosts: list[str] = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(hostlist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(hostlist[start:i])
            start = i + 1
    parts.append(hostlist[start:])
    for part in filter(None, (p.strip() for p in parts)):
        hosts += _expand_one(part)
    return hosts


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end():]
    out = []
    for item in m.group(1).split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            values = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
        else:
            values = [item]
        for v in values:
            out += _expand_one(head + v + tail)
    return out


def slurm_hostnames(nodelist: str) -> list[str]:
    """Hosts of a Slurm node list, via ``scontrol show hostnames`` (falls back to a local parser)."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=15, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError) as e:
            logger.debug("scontrol show hostnames %s failed (%s); parsing it locally", nodelist, e)
    return expand_hostlist(nodelist)


def read_launch_env(env: dict[str, str] | None = None) -> LaunchEnv:
    """Parse the launcher's variables into a LaunchEnv (pure; no torch, no MPI)."""
    env = dict(os.environ if env is None else env)
    master_addr = env.get("MASTER_ADDR") or None
    master_port = _int(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if any(k.startswith("TORCHELASTIC_") for k in env) else "env"
        local_size = _int(env, "LOCAL_WORLD_SIZE")
        size = _int(env, "WORLD_SIZE")
        nodes = _int(env, "GROUP_WORLD_SIZE") or (-(-size // local_size) if local_size else None)
        return LaunchEnv(launcher, _int(env, "RANK"), size, _int(env, "LOCAL_RANK"), local_size,
                         _int(env, "GROUP_RANK"), nodes, master_addr, master_port)
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        return LaunchEnv("openmpi", rank, size, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), local_size,
                         None, None, master_addr, master_port)
    if "PMI_RANK" in env:
        return LaunchEnv("mpich", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE", "SLURM_NTASKS") or 0,
                         _int(env, "MPI_LOCALRANKID", "SLURM_LOCALID"), _int(env, "MPI_LOCALNRANKS"),
                         _int(env, "SLURM_NODEID"), _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES"),
                         master_addr, master_port)
    if "PMIX_RANK" in env:
        return LaunchEnv("pmix", _int(env, "PMIX_RANK"), _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 0,
                         _int(env, "SLURM_LOCALID"), None, _int(env, "SLURM_NODEID"),
                         _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES"), master_addr, master_port)
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return _read_slurm(env, master_addr, master_port)
    return LaunchEnv("single", 0, 1, 0, 1, 0, 1, master_addr, master_port)


def _read_slurm(env: dict[str, str], master_addr: str | None, master_port: int | None) -> LaunchEnv:
    size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    node = _int(env, "SLURM_NODEID") or 0
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") or 1
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_size = parse_tasks_per_node(per_node)[node] if per_node else None
    if master_port is None and env.get("SLURM_JOB_ID", "").isdigit():
        # the same on every task of a step, different between concurrent jobs and steps
        step = int(env["SLURM_STEP_ID"]) if env.get("SLURM_STEP_ID", "").isdigit() else 0
        master_port = 20000 + (int(env["SLURM_JOB_ID"]) * 16 + step) % 20000
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), size, _int(env, "SLURM_LOCALID"), local_size, node, nodes,
                     master_addr, master_port, nodelist)


def _prefer_flag(le: LaunchEnv, cluster: ClusterConfig) -> LaunchEnv:
    """--master-addr/--master-port win, except under torchrun, whose agent already hosts the store."""
    if le.launcher == "torchrun":
        if cluster.master_addr and cluster.master_addr != le.master_addr:
            logger.warning("--master-addr %s ignored: torchrun's rendezvous store is at %s", cluster.master_addr,
                           le.master_addr)
        return le
    return replace(le, master_addr=cluster.master_addr or le.master_addr, master_port=cluster.master_port or le.master_port)


def _select_mpi_library(launcher: str) -> None:
    """mpi4py 4 wheels load the first libmpi they find: point them at the launcher's library.

    With PyPI's ``mpich`` wheel in the environment, Open MPI ranks would otherwise load MPICH and fail
    ("unsupported PMI version"). A value already set by the user is kept.
    """
    if os.environ.get("MPI4PY_LIBMPI"):
        return
    if launcher == "openmpi":
        os.environ["MPI4PY_LIBMPI"] = "libmpi.so.40"
    elif launcher == "mpich":
        candidates = []
        for exe in ("mpiexec.hydra", "mpiexec"):
            path = shutil.which(exe)
            if path:
                candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(path))), "lib", "libmpi.so.12"))
        candidates += [os.path.join(sys.prefix, "lib", "libmpi.so.12"), "libmpi.so.12"]
        os.environ["MPI4PY_LIBMPI"] = os.pathsep.join(candidates)


def _mpi_exchange(le: LaunchEnv) -> LaunchEnv:
    """One MPI allgather of (host, address) and a broadcast of rank 0's port; then MPI is finalised."""
    _select_mpi_library(le.launcher)
    try:
        import mpi4py

        mpi4py.rc.threads = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:
        reason = f"(mpi4py: {' '.join(str(e).split())[:200]})"
        if le.master_addr is None:
            raise ConfigError(
                f"no master address under {le.launcher}: expected --master-addr HOST (or MASTER_ADDR) or a working "
                f"mpi4py to share rank 0's address, found neither {reason}. Fix: pass --master-addr <rank 0's host> "
                "--master-port PORT, or install mpi4py (pip install 'miles[mpi]') built for this MPI.") from e
        raise ConfigError(
            f"{le.launcher} did not put the world size and local ranks in the environment and mpi4py cannot ask "
            f"MPI {reason}. Fix: install mpi4py (pip install 'miles[mpi]') built for this MPI, or launch with "
            "mpirun/mpiexec/srun, which export them.") from e
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if le.world_size and (rank, size) != (le.rank, le.world_size):
        raise ConfigError(f"mpi4py sees rank {rank} of {size} but the launcher variables say {le.rank} of "
                          f"{le.world_size}: mpi4py loaded another MPI library (set MPI4PY_LIBMPI to this launcher's libmpi).")
    hostname = socket.gethostname()
    port = le.master_port or (find_free_port("0.0.0.0") if rank == 0 else 0)
    hosts = comm.allgather((hostname, host_address()))
    port = comm.bcast(port, root=0)
    MPI.Finalize()
    names = [h for h, _ in hosts]
    order = list(dict.fromkeys(names))
    local = [r for r, h in enumerate(names) if h == hostname]
    single_host = len(order) == 1
    master = le.master_addr or ("127.0.0.1" if single_host else hosts[0][1])
    return replace(le, rank=rank, world_size=size, local_rank=local.index(rank), local_world_size=len(local),
                   node_rank=order.index(hostname), num_nodes=len(order), master_addr=master, master_port=port)


def _complete(le: LaunchEnv, cluster: ClusterConfig) -> LaunchEnv:
    if le.launcher == "single":
        return replace(le, master_addr=le.master_addr or "127.0.0.1", master_port=le.master_port or find_free_port())
    mpi_needs = le.launcher in MPI_LAUNCHERS and (
        le.master_addr is None or le.local_rank is None or le.local_world_size is None or not le.world_size)
    if mpi_needs:
        le = _mpi_exchange(le)
    if le.launcher == "slurm" and not le.master_addr and le.nodelist:
        le = replace(le, master_addr=slurm_hostnames(le.nodelist)[0])  # block distribution: rank 0 on the first host
    if not le.master_addr or not le.master_port:
        missing = "address" if not le.master_addr else "port"
        raise ConfigError(
            f"no master {missing} for the {le.launcher} launch of {le.world_size} ranks: expected --master-addr/"
            f"--master-port (or MASTER_ADDR/MASTER_PORT), found addr={le.master_addr!r} port={le.master_port!r}. "
            "Fix: pass --master-addr <rank 0's host> --master-port PORT.")
    local_size = le.local_world_size or le.world_size
    local_rank = le.local_rank if le.local_rank is not None else le.rank % local_size
    node_rank = le.node_rank if le.node_rank is not None else le.rank // local_size
    num_nodes = le.num_nodes or -(-le.world_size // local_size)
    return replace(le, local_rank=local_rank, local_world_size=local_size, node_rank=node_rank, num_nodes=num_nodes)


def pick_device(cluster: ClusterConfig, local_rank: int, local_world_size: int) -> torch.device:
    """cuda:<local GPU> when GPUs are visible (or --device cuda), else cpu."""
    import torch

    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if cluster.device == "cuda" and not has_cuda:
        raise ConfigError("--device cuda, but this process sees no CUDA GPU (check CUDA_VISIBLE_DEVICES and the "
                          "launcher's GPU options); use --device cpu to run on CPU.")
    if cluster.device == "cpu" or not has_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)  # the launcher gave each rank its own GPU (e.g. --gpus-per-task=1)
    if count < local_world_size:
        raise ConfigError(f"one GPU per rank: this node runs {local_world_size} ranks but sees {count} GPUs. Launch "
                          f"{count} ranks per node (torchrun --nproc-per-node, mpirun -npernode, srun --ntasks-per-node).")
    return torch.device("cuda", local_rank)


def detect_world(cluster: ClusterConfig, env: dict[str, str] | None = None) -> World:
    """Find this rank's place in the job (see the module docstring for the launchers)."""
    le = _complete(_prefer_flag(read_launch_env(env), cluster), cluster)
    if not 0 <= le.rank < le.world_size:
        raise ConfigError(f"launcher says rank {le.rank} of a world of {le.world_size}; check the launch command.")
    device = pick_device(cluster, le.local_rank, le.local_world_size)
    return World(rank=le.rank, world_size=le.world_size, local_rank=le.local_rank, local_world_size=le.local_world_size,
                 node_rank=le.node_rank, num_nodes=le.num_nodes, master_addr=le.master_addr, master_port=le.master_port,
                 launcher=le.launcher, hostname=socket.gethostname(), device=device)


def resolve_backend(world: World, cluster: ClusterConfig) -> str:
    """The backend of the default (trainer) group: --distributed-backend (Miles's default nccl) on GPU, gloo on CPU."""
    backend = cluster.distributed_backend
    if backend == "auto":
        return "nccl" if world.device.type == "cuda" else "gloo"
    if backend == "nccl" and world.device.type != "cuda":
        warn_once(logger, "--distributed-backend nccl: this rank runs on CPU, where NCCL does not exist; using gloo")
        return "gloo"
    return backend


def distributed_timeout(cluster: ClusterConfig) -> timedelta:
    if cluster.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes must be positive, got {cluster.distributed_timeout_minutes}.")
    return timedelta(minutes=cluster.distributed_timeout_minutes)


def init_distributed(world: World, cluster: ClusterConfig) -> None:
    """Start torch.distributed for this world: NCCL on GPU (gloo groups come from groups.py), gloo on CPU.

    On a GPU node the rank is first pinned to its GPU and bound to that GPU's NUMA node (numa.py).
    """
    import torch
    import torch.distributed as dist

    from miles.spmd.errors import MilesError

    backend = resolve_backend(world, cluster)
    timeout = distributed_timeout(cluster)
    if world.device.type == "cuda":
        from miles.spmd.numa import bind_to_gpu

        torch.cuda.set_device(world.device)
        bind_to_gpu(world.device)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (world.rank, world.world_size):
            raise MilesError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, not {world.rank} of {world.world_size}.")
        return
    # No device_id: NCCL communicators are created lazily, so engine ranks (whose GPU belongs to the
    # engine process) never allocate one for the world group, which carries no traffic.
    try:
        init: dict = {"init_method": f"tcp://{world.master_addr}:{world.master_port}"}
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun --max-restarts keeps its store across attempts: without a prefix per attempt, a relaunched
            # rank reads the dead attempt's gloo addresses and the rendezvous fails (miles.ft relaunch tests).
            store = dist.TCPStore(world.master_addr, world.master_port, world.world_size, is_master=False, timeout=timeout)
            init = {"store": dist.PrefixStore(f"miles/attempt_{attempt}", store)}
        dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size, timeout=timeout, **init)
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError are RuntimeErrors
        text = " ".join(str(e).split())[:300]
        hint = ("another process holds the port: pass --master-port PORT (or MASTER_PORT)"
                if "in use" in text.lower() or "eaddrinuse" in text.lower() else
                f"some ranks did not join within {cluster.distributed_timeout_minutes} min or cannot reach "
                f"{world.master_addr}:{world.master_port}; check the launch and --master-addr")
        raise MilesError(f"rank {world.rank}: rendezvous at {world.master_addr}:{world.master_port} failed ({text}); "
                         f"{hint}.") from e
    logger.info("torch.distributed up: %d ranks on %d node(s), backend %s, master %s:%d, launcher %s",
                world.world_size, world.num_nodes, backend, world.master_addr, world.master_port, world.launcher)
