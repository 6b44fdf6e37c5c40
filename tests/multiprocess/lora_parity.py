"""The FSDP-vs-Megatron LoRA comparison's shared scaffolding (tests/multiprocess/test_fsdp_lora_moe.py, _deepseek.py,
_gdn.py, _vlm.py): each rank's samples, the worker loop that trains each backend in turn from the same adapters and
saves what it measured on rank 0, the torchrun launch of a test file's worker, and the distances the tests bound."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

METRICS = ("loss", "pg_loss", "kl_loss", "grad_norm")


def samples(rid: int, rank: int, world: int) -> list:
    """Each rank's samples of rollout ``rid``: one group of 3 per rank of a 2-rank run; one rank takes both."""
    from trainer_harness import random_samples

    ranks = range(2) if world == 1 else (rank,)
    return [s for r in ranks for s in random_samples(1, 3, seed=1000 * rid + r, first_group=r)]


def train_backends(model_dir: str, out: str, flags_of: Callable[[str], list[str]], *,
                   before: Callable[[Any, str], dict] | None = None, after: Callable[[Any, str], dict] | None = None,
                   backends: tuple[str, ...] = ("fsdp", "megatron"), kind: str = "cpu") -> None:
    """The torchrun worker: per backend, the trainer of ``flags_of(backend)``, its export (``init``), ``before``'s
    entries, 2 rollouts' step metrics, the export after (``final``), ``after``'s entries and the log-probs of a probe
    batch (``lp``); rank 0 saves {backend: entries} to ``out``. ``kind``: "cpu" (gloo) or "cuda" (NCCL)."""
    import torch
    import torch.distributed as dist
    from trainer_harness import build, policy_logprobs

    dist.init_process_group("gloo" if kind == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if kind == "cpu" else torch.device("cuda", rank)
    if kind == "cuda":
        torch.cuda.set_device(device)
    res: dict = {}
    probe = samples(7, 0, 1)
    for backend in backends:
        tr = build(model_dir, flags_of(backend), device=device)
        r = {"init": tr.state_dict_for_check(), "metrics": {}, **(before(tr, backend) if before else {})}
        for rid in range(2):
            r["metrics"][rid] = tr.train(samples(rid, rank, world), rid)
        r["final"] = tr.state_dict_for_check()
        r.update(after(tr, backend) if after else {})
        r["lp"] = policy_logprobs(tr, probe)
        res[backend] = r
        del tr
    if rank == 0:
        torch.save(res, out)
    dist.barrier()
    dist.destroy_process_group()


def launch(script: Path, nproc: int, *args: str, timeout: int) -> Any:
    """``script`` under torchrun on ``nproc`` local ranks with ``args`` (its ``__main__``'s), a free port."""
    from _torchrun import torchrun_self

    from miles.utils.net import find_free_port

    return torchrun_self(script, nproc, find_free_port(), *args, timeout=timeout)


def launch_and_load(script: Path, nproc: int, out: Path, *args: str, timeout: int) -> dict:
    """``launch`` (``args`` name ``out`` for the worker), asserted to succeed; -> what the worker saved to ``out``."""
    import torch

    r = launch(script, nproc, *args, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(out, weights_only=False)


def metric_diffs(a: dict, b: dict) -> dict[str, float]:
    """Step metric -> the largest |a - b| over the 2 rollouts."""
    return {key: max(abs(a["metrics"][rid][key] - b["metrics"][rid][key]) for rid in (0, 1)) for key in METRICS}


def logprob_distance(a: dict, b: dict) -> float:
    """The largest |a - b| of two runs' probe log-probs."""
    return max(abs(x - y) for p, q in zip(a["lp"], b["lp"]) for x, y in zip(p, q))


def distance(a: dict, b: dict, base: dict) -> tuple[float, float]:
    """Max abs difference of two exports and its relative L2 over the update of ``b`` (over ``base``'s keys)."""
    diff = max((a[k] - b[k]).abs().max().item() for k in base)
    num = sum(((a[k] - b[k]) ** 2).sum().item() for k in base)
    den = sum(((b[k] - base[k]) ** 2).sum().item() for k in base)
    return diff, (num / den) ** 0.5
