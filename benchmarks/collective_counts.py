"""The collectives one ``train()`` call issues on rank 0, by where they come from (issue 13's fixed costs).

On a small CPU host each gloo collective costs 1-2 ms whatever its size, so their count is a fixed per-step
cost. This builds the quickstart-sized trainer of ``micro_batch.py`` (``--use-dynamic-batch-size``, the default
distributed optimizer on the Megatron backend), runs one warm-up ``train()``, then counts the
``torch.distributed`` calls of one ``train()`` by the first known function on the caller's stack; the
"before" column runs the same step with torch's own per-parameter ``ZeroRedundancyOptimizer`` sync and the
metric names gathered as objects (what ran before ``parallel._zero_class`` and
``collectives.bounded_union_of_names``).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/collective_counts.py
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/collective_counts.py --train-backend fsdp
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import types
from pathlib import Path

import torch.distributed as dist
from _world import init_bench_world  # benchmarks/_world.py (the script's folder is on sys.path)
from micro_batch import CONFIGS, _samples, _trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend",
               "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list")
SOURCES = (   # (function on the stack, file suffix or "", row); the first that matches, innermost frame first
    ("_sync_params", "", "ZeroRedundancyOptimizer parameter sync"),
    ("sync_count", "batching.py", "batching.sync_count"),
    ("_all_keys", "", "metric names"),
    ("_group_sum", "step.py", "_group_sum (step totals, _extra_metrics, _perf_metrics)"),
    ("_group_rows", "step.py", "per-rank phase rows"),
    ("reduce", "metrics.py", "metric sums (MetricSums.reduce)"),
    ("finish_grads", "parallel.py", "gradients (parallel.finish_grads)"),
    ("clip_grad_norm", "", "gradient norm"),
)


def _source(frame: types.FrameType | None) -> str:
    first_miles = None
    while frame is not None:
        code = frame.f_code
        for fn, suffix, row in SOURCES:
            if code.co_name == fn and code.co_filename.endswith(suffix):
                return row
        if first_miles is None and "/miles/" in code.co_filename:
            first_miles = f"other: {Path(code.co_filename).name}:{code.co_name}"
        frame = frame.f_back
    return first_miles or "other"


def _count(tr, samples, step: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    real = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def wrap(name):
        def call(*a, **kw):
            counts[_source(sys._getframe(1))] += 1
            return real[name](*a, **kw)
        return call

    for n in real:
        setattr(dist, n, wrap(n))
    try:
        tr.train(samples, step)
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return counts


def _as_before(tr) -> None:
    """Torch's per-parameter sync and the object gather of the metric names on this trainer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from miles.trainer.collectives import bounded_all_gather_object

    if isinstance(tr.optimizer, ZeroRedundancyOptimizer):
        tr.optimizer._sync_params = types.MethodType(ZeroRedundancyOptimizer._sync_params, tr.optimizer)

    def _all_keys(keys):
        gathered = bounded_all_gather_object(sorted(keys), tr.group, tr.timeout, tr.device, "metric names")
        return sorted(set().union(*gathered))

    tr._all_keys = _all_keys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64, help="Samples per step (all ranks together).")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--train-backend", choices=["megatron", "fsdp"], default="megatron")
    a = p.parse_args()

    from miles.utils.tiny_model import build_tiny_model

    device, rank, world, group, mesh = init_bench_world(False)
    model_dir = Path(tempfile.gettempdir()) / f"miles_bench_mb_h{a.hidden_size}_l{a.num_layers}"
    if rank == 0 and not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=4, num_kv_heads=2)
    dist.barrier(group)
    extra = CONFIGS["--use-dynamic-batch-size"]
    columns = {}
    for name in ("before", "now"):
        tr = _trainer(model_dir, extra, group, mesh, device, a.train_backend)
        if name == "before":
            _as_before(tr)
        samples = _samples(a.samples // world, rank, tr.vocab_size)
        tr.train(samples, 0)
        dist.barrier(group)
        columns[name] = _count(tr, samples, 1)
    if rank == 0:
        print(f"{a.train_backend}, {world} rank(s), {a.samples} samples, {extra}: collectives of one train() on "
              "rank 0")
        rows = sorted(set(columns["before"]) | set(columns["now"]))
        print(f"{'issued by':<58} {'before':>7} {'now':>5}")
        for r in rows:
            print(f"{r:<58} {columns['before'][r]:>7} {columns['now'][r]:>5}")
        print(f"{'total':<58} {sum(columns['before'].values()):>7} {sum(columns['now'].values()):>5}")
    dist.barrier(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
