"""Cluster layout flags (Miles names): who trains, who serves, where."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="Nodes for the actor (trainer).")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8, help="GPUs (CPU: ranks) per node for the actor.")
    g.add_argument("--critic-num-nodes", type=int, default=None, help="Nodes for the critic (PPO); shares the actor's ranks.")
    g.add_argument("--critic-num-gpus-per-node", type=int, default=None, help="GPUs per node for the critic (PPO).")
    g.add_argument("--rollout-num-gpus", type=int, default=None, help="Total GPUs for rollout engines (disaggregated).")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, help="GPUs per engine (= SGLang TP size).")
    g.add_argument("--num-gpus-per-node", type=int, default=8, help="GPUs (CPU: rank slots) per node of the job.")
    g.add_argument("--colocate", action="store_true", help="Engines share the trainer's GPUs (offloading between phases).")
    g.add_argument("--offload", action="store_true", help="Offload both trainer and engines between phases (colocated).")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="Offload trainer state while generating (default: on with --colocate or --offload).")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="Release engine memory while training (default: on with --colocate or --offload).")
    g.add_argument("--debug-train-only", action="store_true", help="Only the trainer: no engines.")
    g.add_argument("--debug-rollout-only", action="store_true", help="Only rollout engines: no trainer.")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10, help="Timeout of every collective.")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo", "auto"], default="nccl",
                   help="Backend of trainer collectives. A rank on CPU has no NCCL and uses gloo (logged); "
                        "auto: nccl on GPU, gloo on CPU.")
    g.add_argument("--master-addr", type=str, default=None, help="Rendezvous host when the launcher gives none.")
    g.add_argument("--master-port", type=int, default=None, help="Rendezvous port when the launcher gives none.")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when GPUs are visible.")


@dataclass(kw_only=True)
class ClusterConfig:
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    critic_num_nodes: int | None
    critic_num_gpus_per_node: int | None
    rollout_num_gpus: int | None
    rollout_num_gpus_per_engine: int
    num_gpus_per_node: int
    colocate: bool
    offload: bool
    offload_train: bool | None
    offload_rollout: bool | None
    debug_train_only: bool
    debug_rollout_only: bool
    distributed_timeout_minutes: float
    distributed_backend: str
    master_addr: str | None
    master_port: int | None
    device: str

    @property
    def offloads_train(self) -> bool:
        """Whether the trainer is offloaded while engines generate: --offload-train as given, else on with --colocate
        or --offload (Miles's default)."""
        return bool(self.offload_train if self.offload_train is not None else (self.offload or self.colocate))
