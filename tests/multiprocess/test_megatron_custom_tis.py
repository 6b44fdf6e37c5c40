"""``--custom-tis-function-path`` on the Megatron backend (2 gloo ranks, TP 2 and TP 1 x DP 2, CPU): the trainer
calls Miles's function through the shared policy loss (``losses.policy_loss_with_tis``), with per-sample lists
and the ``--custom-config-path`` keys in ``args``. A function that reproduces the built-in truncation gives the
built-in ``--use-tis`` step's metrics and weights bitwise; one that zeroes every weight gives pg_loss 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
CALLS: list[dict] = []


def clamp_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """The built-in TIS (clamp of exp(old - rollout) to [--tis-clip-low, --tis-clip]), written as Miles's plugin."""
    import torch

    w = torch.cat([(t.float() - r.float()).clamp(-20.0, 20.0).exp() for t, r in zip(train_log_probs, rollout_log_probs)])
    w = w.clamp(args.tis_clip_low, args.tis_clip)
    CALLS.append({"tis_mode": args.tis_mode, "lengths": list(kwargs["response_lengths"]),
                  "n": len(train_log_probs), "masks": [int(m.numel()) for m in loss_masks]})
    return pg_loss * w, loss_masks, {"w": w}


def zero_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    import torch

    return pg_loss * 0.0, loss_masks, {"w": torch.zeros_like(pg_loss)}


def _worker(model_dir: str, out: str, tp: int, yaml: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from trainer_harness import build

    from miles.types import Sample

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    base = ["--lr", "1e-2", "--train-backend", "megatron", "--use-tis",
            "--tis-clip", "1.2", "--tis-clip-low", "0.9", "--tensor-model-parallel-size", str(tp),
            # the same packed micro-batches for every run (the built-in TIS run would otherwise coalesce its
            # micro-batches and a custom function's would not: a float summation order apart)
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"]
    res = {}
    for name, extra in (("builtin", []), ("clamp", ["--custom-config-path", yaml, "--custom-tis-function-path",
                                                   "test_megatron_custom_tis.clamp_tis"]),
                        ("zero", ["--custom-tis-function-path", "test_megatron_custom_tis.zero_tis"])):
        torch.manual_seed(0)
        tr = build(model_dir, base + extra, group=group)
        gen = torch.Generator().manual_seed(7 + rank)
        samples = [Sample(group_index=rank, index=k, tokens=torch.randint(4, 90, (7,), generator=gen).tolist(),
                          response_length=3, reward=float(k % 2),
                          rollout_log_probs=(torch.randn(3, generator=gen) * 0.3 - 4.2).tolist()) for k in range(2)]
        metrics = tr.train(samples, 0)
        sd = tr.state_dict_for_check()
        res[name] = {"metrics": {k.rsplit("/", 1)[-1]: float(v) for k, v in metrics.items()},
                     "params": {k: v.double().sum().item() for k, v in sd.items()}}
        del tr
    import test_megatron_custom_tis as plugins  # the module the flags name (this file runs as __main__)

    res["calls"] = plugins.CALLS
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier(group)
    dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "tp1_dp2"])
def test_custom_tis_on_megatron_is_the_shared_loss(tiny_model_dir: Path, tmp_path: Path, tp: int) -> None:
    from miles.utils.net import find_free_port

    yaml = tmp_path / "mis.yaml"
    yaml.write_text("tis_mode: clamp\n")          # names no flag: reaches the function's args, as in Miles
    out = tmp_path / "res.json"
    from _torchrun import torchrun_self

    proc = torchrun_self(HERE, 2, find_free_port(), str(tiny_model_dir), str(out), str(tp), str(yaml), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    calls = res["calls"]
    assert calls and all(c["tis_mode"] == "clamp" for c in calls)
    # per-sample lists of the samples this rank trains (TP 2: the TP group's 4; DP 2: its own 2), 3 tokens each
    assert sum(c["n"] for c in calls) == (4 if tp == 2 else 2)
    assert all(n == 3 for c in calls for n in c["lengths"] + c["masks"])
    builtin, clamp, zero = res["builtin"], res["clamp"], res["zero"]
    for key in ("loss", "pg_loss", "grad_norm"):
        assert clamp["metrics"][key] == builtin["metrics"][key], (key, clamp["metrics"], builtin["metrics"])
    assert clamp["params"] == builtin["params"]
    assert zero["metrics"]["pg_loss"] == 0.0 and builtin["metrics"]["pg_loss"] != 0.0
    assert zero["params"] != builtin["params"]           # the step did follow the function's weights
    assert "w" in clamp["metrics"] and "w" in zero["metrics"]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
