"""Asynchronous RL training: generation of rollout k+1 overlaps training on rollout k (one SPMD job).

    torchrun --nproc-per-node 4 train_async.py --actor-num-nodes 1 --actor-num-gpus-per-node 2 \
        --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 --num-gpus-per-node 4 \
        $(bash examples/quickstart/flags.sh) --update-weights-interval 1 --use-tis

Weights are synced every ``--update-weights-interval`` rollouts (after the generation in flight
finishes); samples carry the weight version they were generated with and ``--max-weight-staleness N``
drops older ones. ``--colocate`` is refused: generation and training run at the same time, so they
cannot share devices. The loop is ``miles.run.async_loop.AsyncRLLoop``.
"""

from __future__ import annotations

import asyncio


async def train(args) -> None:
    from miles.run.entry import dry_run, run_job

    if args.output.dry_run:
        print(dry_run(args))  # the plan is this command's output
        return
    from miles.run.async_loop import AsyncRLLoop

    # bootstrap -> build (engines, trainer + resume, router, weight sender, data) -> driver: initial
    # weight sync, then the overlapped loop; other ranks follow the driver's commands -> close.
    await run_job(args, AsyncRLLoop)


def main() -> None:
    from miles.config import parse_args
    from miles.spmd.errors import run_main

    run_main(lambda: asyncio.run(train(parse_args(is_async=True))))


if __name__ == "__main__":
    main()
