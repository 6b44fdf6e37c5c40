"""Synchronous RL training (GRPO, GSPO, PPO, REINFORCE++, SFT) as one SPMD job: every rank runs this file.

    # CPU, 2 trainer ranks (FSDP2) + 2 embedded engines, the quickstart:
    torchrun --nproc-per-node 4 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 2 \
        --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 --num-gpus-per-node 4 $(bash examples/quickstart/flags.sh)
    # 8 GPUs: 4 train, 4 serve (SGLang when installed); or --colocate to share them
    torchrun --nproc-per-node 8 train.py --actor-num-gpus-per-node 4 --rollout-num-gpus 4 ...
    # the same under mpirun (mpirun -n 8 python train.py ...) or Slurm (sbatch slurm/grpo.sh)

Global rank 0 drives (data, rollout manager, router, the loop in ``miles.run.loop``); trainer ranks
train; engine leader ranks supervise their engine process. ``--dry-run`` prints the plan and exits.
"""

from __future__ import annotations

import asyncio


async def train(args) -> None:
    from miles.run.entry import dry_run, run_job

    if args.output.dry_run:
        print(dry_run(args))  # the plan is this command's output
        return
    from miles.run.loop import RLLoop

    # bootstrap (launcher, role plan, process groups) -> build (engines, trainer + resume, router,
    # weight sender, data) -> driver: initial weight sync and the loop; others: follow -> close.
    await run_job(args, RLLoop)


def main() -> None:
    from miles.config import parse_args
    from miles.spmd.errors import run_main

    run_main(lambda: asyncio.run(train(parse_args())))


if __name__ == "__main__":
    main()
