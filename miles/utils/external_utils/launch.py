"""The SPMD launch of a Miles launcher's ``train.py`` command: torchrun on one node, srun in a Slurm allocation.

Miles submits ``python3 train.py <model args> <train args>`` to a Ray cluster of ``num_nodes`` nodes of
``num_gpus_per_node`` GPUs and lets Ray place the trainer and the engines. Here every rank runs that same
command, so the launch must start exactly the ranks the role plan needs (``miles.spmd.roles``): the trainer's
``--actor-num-nodes x --actor-num-gpus-per-node``, plus ``--rollout-num-gpus`` (or the rest of the nodes) when
not ``--colocate``. ``planned_ranks`` reads those flags the way the plan does; the job itself checks the plan
against the launch again and refuses a mismatch with one line.

- Inside a Slurm allocation (``SLURM_JOB_ID``): ``srun --kill-on-bad-exit=1 --cpu-bind=none --nodes N
  --ntasks W --ntasks-per-node P python train.py ...`` (one task per rank; the ranks find the master from
  the step's first host).
- One node: ``torchrun --standalone --nnodes 1 --nproc-per-node W train.py ...``.
- Several nodes without Slurm: ``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint
  $MASTER_ADDR:$MASTER_PORT``; run the launcher on every node with the same ``MASTER_ADDR`` (the first node).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from miles.utils.external_utils.exec_command import fail, in_slurm_allocation

DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class ClusterFlags:
    """The train flags that decide how many ranks the job has (Miles's names and defaults)."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 8
    rollout_num_gpus: int | None = None
    num_gpus_per_node: int | None = None
    colocate: bool = False
    debug_train_only: bool = False
    debug_rollout_only: bool = False


def read_cluster_flags(train_argv: list[str]) -> ClusterFlags:
    """The cluster flags of ``train_argv`` (the last of a repeated flag wins, as in the job's parser)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ints = ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--num-gpus-per-node")
    for flag in ints:
        p.add_argument(flag)
    for flag in ("--colocate", "--debug-train-only", "--debug-rollout-only"):
        p.add_argument(flag, action="store_true")
    ns, _ = p.parse_known_args(train_argv)
    values = {}
    for flag in ints:
        dest = flag[2:].replace("-", "_")
        raw = getattr(ns, dest)
        if raw is None:
            continue
        try:
            values[dest] = int(raw)
        except ValueError:
            fail(f"{flag} {raw}: not an integer, so the job's ranks cannot be counted (the job's own parser "
                 f"refuses it too); pass {flag} N in the launcher's train arguments")
    return ClusterFlags(**values, colocate=ns.colocate, debug_train_only=ns.debug_train_only,
                        debug_rollout_only=ns.debug_rollout_only)


def planned_ranks(flags: ClusterFlags, slots: int) -> int:
    """The world size the role plan needs, given ``slots`` GPU slots (nodes x GPUs per node) to fill."""
    actor = flags.actor_num_nodes * flags.actor_num_gpus_per_node
    if flags.debug_rollout_only:
        return flags.rollout_num_gpus if flags.rollout_num_gpus is not None else slots
    if flags.debug_train_only or flags.colocate:
        return actor
    return actor + (flags.rollout_num_gpus if flags.rollout_num_gpus is not None else max(slots - actor, 0))


def torchrun_argv() -> list[str]:
    """torchrun of this Python (beside ``sys.executable``), else on PATH, else ``python -m torch.distributed.run``."""
    beside = Path(sys.executable).parent / "torchrun"
    if beside.is_file():
        return [str(beside)]
    return [found] if (found := shutil.which("torchrun")) else [sys.executable, "-m", "torch.distributed.run"]


def build_launch_argv(train_script: str, train_argv: list[str], num_gpus_per_node: int, num_nodes: int) -> list[str]:
    """The whole command: launcher argv + ``train_script`` + ``train_argv`` (see the module docstring)."""
    flags = read_cluster_flags(train_argv)
    per_node = flags.num_gpus_per_node or num_gpus_per_node
    if per_node < 1 or num_nodes < 1:
        fail(f"num_gpus_per_node {per_node} and num_nodes {num_nodes} must be at least 1")
    world = planned_ranks(flags, num_nodes * per_node)
    if world < 1:
        fail(f"the train flags plan {world} ranks (--actor-num-nodes {flags.actor_num_nodes} x "
             f"--actor-num-gpus-per-node {flags.actor_num_gpus_per_node}, --rollout-num-gpus "
             f"{flags.rollout_num_gpus}); give the job at least one rank")
    nnodes = -(-world // per_node)
    if nnodes > 1 and world % per_node:
        fail(f"the train flags plan {world} ranks over {nnodes} nodes of {per_node} (--num-gpus-per-node): a "
             f"multi-node job needs a multiple of {per_node}; change --actor-num-gpus-per-node/--rollout-num-gpus")
    tasks_per_node = world if nnodes == 1 else per_node
    if in_slurm_allocation():
        have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        if nnodes > have:
            fail(f"the job needs {nnodes} node(s) of {per_node} ranks ({world} ranks) but this Slurm allocation "
                 f"has {have} (SLURM_JOB_NUM_NODES); allocate {nnodes} nodes (salloc/sbatch --nodes {nnodes})")
        return ["srun", "--kill-on-bad-exit=1", "--cpu-bind=none", f"--nodes={nnodes}", f"--ntasks={world}",
                f"--ntasks-per-node={tasks_per_node}", sys.executable, train_script, *train_argv]
    if nnodes == 1:
        return [*torchrun_argv(), "--standalone", "--nnodes", "1", "--nproc-per-node", str(world),
                train_script, *train_argv]
    if not os.environ.get("MASTER_ADDR"):
        fail(f"the job needs {nnodes} nodes and no Slurm allocation is here: set MASTER_ADDR to the first "
             "node's address and run this launcher on every node (or run it inside salloc/sbatch)")
    endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT') or DEFAULT_RDZV_PORT}"
    return [*torchrun_argv(), "--nnodes", str(nnodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", os.environ.get("MILES_RDZV_ID", "miles"),
            train_script, *train_argv]
