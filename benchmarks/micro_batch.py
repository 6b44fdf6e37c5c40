"""Default micro-batching vs dynamic batching: one FSDP2 trainer step on a small model, side by side.

Miles's defaults train with ``--micro-batch-size 1`` and no dynamic batching, so a 64-sample step is 64
forward/backward passes; ``--use-dynamic-batch-size`` packs them into a few. On a small model the per-pass
fixed costs (FSDP2 hooks, collectives, host syncs, Python) dominate, which is what this measures. Each
row is one configuration: the median and best wall time of ``train()`` (GRPO policy loss with KL loss,
``--num-steps-per-rollout 1``) over ``--steps`` measured calls after ``--warmup``, its ratio to the last row
(dynamic batching, the anchor, measured in the same run) and rank 0's median seconds per phase of ``train()``;
the configurations' steps alternate. On Megatron a second row runs the default path as it was before the planned
micro-batches were coalesced (one forward each, dummy passes up to the group-wide count).
``--train-backend`` picks the trainer (``megatron``, Miles's default, or ``fsdp``).

    python benchmarks/micro_batch.py                          # 1 rank, CPU, quickstart-sized model
    python benchmarks/micro_batch.py --samples 64 --steps 5 --hidden-size 128
    python benchmarks/micro_batch.py --profile default        # cProfile of one default-path step
    torchrun --nproc-per-node 2 benchmarks/micro_batch.py     # 2 ranks (gloo on CPU, NCCL on GPU)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _world import init_bench_world  # benchmarks/_world.py (the script's folder is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("logprobs", "advantages", "fwd_bwd", "optimizer", "metrics")   # rank 0's seconds a step (phase/*)
CONFIGS = {
    "default (--micro-batch-size 1)": [],
    "--micro-batch-size 8": ["--micro-batch-size", "8"],
    "--use-dynamic-batch-size": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"],
}


BEFORE = "default, one forward per micro-batch"


def _one_forward_per_micro_batch(tr) -> None:
    """The Megatron trainer as it ran before coalescing: one forward per planned micro-batch, the count
    padded group-wide with dummy passes (the shared step's ``_micro_batches``, ``miles.trainer.step``)."""
    import functools

    from miles.trainer.step import RLTrainer

    tr.coalesce_tokens = lambda: 0
    tr._micro_batches = functools.partial(RLTrainer._micro_batches, tr)


def _samples(n: int, rank: int, vocab: int):
    from miles.types import Sample

    gen = torch.Generator().manual_seed(1234 + rank)
    out = []
    for i in range(n):
        prompt = torch.randint(4, vocab, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
        r = int(torch.randint(2, 10, (1,), generator=gen))
        resp = torch.randint(4, vocab, (r,), generator=gen).tolist()
        out.append(Sample(group_index=rank * n + i // 8, index=i, tokens=prompt + resp, response_length=r,
                          reward=float(i % 3 == 0)))
    return out


def _trainer(model_dir: Path, extra: list[str], group, mesh, device, backend: str):
    from miles.config import parse_args

    cfg = parse_args(["--train-backend", backend, "--hf-checkpoint", str(model_dir), "--lr", "1e-4", "--num-rollout", "1000",
                      "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--num-steps-per-rollout", "1",
                      "--use-kl-loss", "--kl-loss-coef", "0.01"] + extra)
    from miles.trainer.build import build_trainer

    return build_trainer(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=group, mesh=mesh, device=device,
                         rollout_temperature=1.0, num_rollout=1000, global_batch_size=None, num_steps_per_rollout=1,
                         timeout=600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64, help="Samples per step (all ranks together).")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--train-backend", choices=["megatron", "fsdp"], default="megatron",
                   help="The trainer measured (Miles's default backend is megatron).")
    p.add_argument("--cpu", action="store_true", help="Stay on CPU even when a GPU is present.")
    p.add_argument("--profile", choices=["default", "dynamic"], default=None,
                   help="Print a cProfile of one step of that configuration instead of the table.")
    a = p.parse_args()

    from miles.utils.tiny_model import build_tiny_model

    device, rank, world, group, mesh = init_bench_world(not a.cpu)
    model_dir = Path(tempfile.gettempdir()) / f"miles_bench_mb_h{a.hidden_size}_l{a.num_layers}"
    if rank == 0 and not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=4, num_kv_heads=2)
    dist.barrier(group)
    if a.samples % world:
        raise SystemExit(f"--samples {a.samples} must divide over {world} ranks")

    names = list(CONFIGS)
    if a.train_backend == "megatron":
        names.insert(1, BEFORE)
    if a.profile:
        names = [names[0] if a.profile == "default" else names[-1]]
    trainers, samples = {}, None
    for name in names:
        tr = trainers[name] = _trainer(model_dir, CONFIGS.get(name, []), group, mesh, device, a.train_backend)
        if name == BEFORE:
            _one_forward_per_micro_batch(tr)
        samples = _samples(a.samples // world, rank, tr.vocab_size)
        for it in range(a.warmup):
            tr.train(samples, it)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        trainers[names[0]].train(samples, a.warmup)
        prof.disable()
        if rank == 0:
            stats = pstats.Stats(prof).sort_stats("tottime")
            stats.print_stats(35)
            stats.print_callers("wait|broadcast|allreduce|all_gather")
        names = []
    # steps alternate between the configurations, so a change of the machine's load reaches all of them
    times: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, list[list[float]]] = {n: [] for n in names}
    last: dict[str, dict] = {}
    for it in range(a.steps if names else 0):
        for name in names:
            dist.barrier(group)
            t0 = time.perf_counter()
            m = last[name] = trainers[name].train(samples, a.warmup + it)
            times[name].append(time.perf_counter() - t0)
            phases[name].append([m.get(f"phase/{k}", 0.0) for k in PHASES])
    rows = [(n, trainers[n].num_params, statistics.median(times[n]), min(times[n]), last[n]["loss"],
             [statistics.median(col) for col in zip(*phases[n])]) for n in names]
    if rank == 0 and rows:
        dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
        print(f"{a.samples} samples/step, {world} rank(s), {dev}, torch {torch.__version__}, "
              f"{rows[0][1]:,} params, {a.steps} measured steps")
        anchor = rows[-1][2]
        print(f"{'configuration':<38} {'median s/step':>14} {'best s/step':>12} {'vs last':>8} {'loss':>10}  "
              + " ".join(f"{k:>9}" for k in PHASES))
        for name, _, mean, best, loss, ph in rows:
            print(f"{name:<38} {mean:>14.3f} {best:>12.3f} {mean / anchor:>7.2f}x {loss:>10.5f}  "
                  + " ".join(f"{v:>9.4f}" for v in ph))
    dist.barrier(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
