"""The bf16 recipe is the same on both trainer backends (one rank; CPU over gloo, and on a GPU).

FSDP2 computes with bf16 parameters (``MixedPrecisionPolicy``) on fp32 masters and reduces fp32 gradients;
``optim.MasterWeights`` does the same on plain modules (bf16 copies of the fp32 parameters for the forward
and backward, fp32 gradient sums, the update on the masters): the Megatron backend always, the FSDP
backend on a one-rank group (``unwrapped``). Each trains the same 2 rollouts (GRPO with KL loss, KL reward,
entropy bonus, TIS) from the same tiny model: "fsdp2" (FSDP2-wrapped, forced), "fsdp" (the one-rank default,
unwrapped), "megatron"; compared: log-probs before training, step metrics and the parameter update after the
2 steps (HF names). The yardstick is the FSDP backend against itself with another micro-batching
(``--micro-batch-size 1`` instead of 3): the same recipe with the sums in another order, i.e. the spread
bf16 rounding alone gives (Adam's first steps turn rounding of near-zero gradients into full-size updates).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def _worker(model_dir: str, out: str, kind: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from test_megatron import _all_logprobs, _flags
    from torch.distributed.device_mesh import DeviceMesh
    from trainer_harness import build, parse, random_samples

    from miles.trainer import modeling
    from miles.trainer.fsdp import FSDPTrainer

    dist.init_process_group("gloo" if kind == "cpu" else "nccl")
    group = dist.group.WORLD
    dev = torch.device("cpu") if kind == "cpu" else torch.device("cuda", 0)
    if kind != "cpu":
        torch.cuda.set_device(dev)
    samples = random_samples(4, 4, seed=7, vocab=90)
    hf = load_file(str(Path(model_dir) / "model.safetensors"))
    res: dict = {}
    runs = {}
    for name in ("fsdp2", "fsdp", "fsdp_mb1", "megatron"):
        backend = "megatron" if name == "megatron" else "fsdp"
        argv = _flags(backend, 1) + ["--bf16"] + (["--micro-batch-size", "1"] if name == "fsdp_mb1" else [])
        if name == "fsdp2":                      # FSDP2 with its MixedPrecisionPolicy, as on more ranks
            # a subclass that never takes the one-rank unwrapped path: built directly, as build_trainer has no
            # such backend (the other arguments as build_run_trainer passes them)

            class Wrapped(FSDPTrainer):
                def unwrapped(self, offload: bool = False) -> bool:
                    return False

            cfg = parse(model_dir, argv)
            tr = Wrapped(cfg.train, cfg.algo, cfg.checkpoint, mesh=DeviceMesh.from_group(group, device_type=kind),
                         group=group, device=dev, rollout_temperature=cfg.rollout.rollout_temperature,
                         num_rollout=cfg.data.num_rollout, global_batch_size=None, num_steps_per_rollout=1,
                         timeout=cfg.cluster.distributed_timeout_minutes * 60)
        else:
            tr = build(model_dir, argv, group=group, device=dev)
        if backend == "fsdp":
            res[f"{name}_wrapped"] = modeling.is_fsdp(tr.model)
        else:
            res["megatron_param_dtypes"] = sorted({str(p.dtype) for p in tr.model.parameters()})
            res["megatron_ref_dtypes"] = sorted({str(p.dtype) for p in tr.ref.parameters()})
        lp = _all_logprobs(tr, samples)
        metrics = [tr.train(samples, rid) for rid in range(2)]
        sd = tr.state_dict_for_check()
        runs[name] = (lp, metrics, {k: sd[k] - hf[k] for k in hf})
        del tr

    def rel_l2(a: dict, b: dict) -> float:
        num = sum(((a[k] - b[k]).double() ** 2).sum().item() for k in hf)
        return (num / sum((b[k].double() ** 2).sum().item() for k in hf)) ** 0.5

    f2, f, f1, m = runs["fsdp2"], runs["fsdp"], runs["fsdp_mb1"], runs["megatron"]
    res["update_rel_l2"] = rel_l2(m[2], f2[2])                   # Megatron vs FSDP2
    res["unwrapped_rel_l2"] = rel_l2(f[2], f2[2])                # one-rank FSDP (MasterWeights) vs FSDP2
    res["floor_rel_l2"] = rel_l2(f1[2], f[2])                    # FSDP vs FSDP, other micro-batching
    res["lp_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(m[0], f2[0]))
    res["unwrapped_lp_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(f[0], f2[0]))
    res["metrics"] = {k: [[r[k] for r in run[1]] for run in (f2, f, f1, m)]
                      for k in ("loss", "pg_loss", "entropy", "kl_loss", "grad_norm")}
    torch.save(res, out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"precision_{kind}.txt").write_text(repr(res))
    dist.destroy_process_group()


def _launch(model_dir: Path, tmp_path: Path, port: int, kind: str) -> dict:
    import torch

    out = tmp_path / f"precision_{kind}.pt"
    from _torchrun import torchrun_self

    proc = torchrun_self(HERE, 1, port, str(model_dir), str(out), kind, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    print({k: v for k, v in res.items()})
    return res


def test_bf16_recipe_matches_fsdp_on_cpu(tiny_model_dir: Path, tmp_path: Path, free_port: int) -> None:
    res = _launch(tiny_model_dir, tmp_path, free_port, "cpu")
    assert res["fsdp2_wrapped"] and not res["fsdp_wrapped"] and not res["fsdp_mb1_wrapped"], res
    assert res["megatron_param_dtypes"] == ["torch.float32"], res      # fp32 masters outside the compute window
    assert res["megatron_ref_dtypes"] == ["torch.bfloat16"], res       # the frozen reference: bf16 only
    assert res["unwrapped_rel_l2"] == 0.0, res     # same kernels on CPU: MasterWeights == FSDP2's bf16, bitwise
    _check(res)


def _check(res: dict) -> None:
    # the same recipe: log-probs of the untrained model within bf16 rounding of each other, the first step's
    # loss and gradient norm closer than another micro-batching gets, the update within 3x the floor
    assert res["lp_max_abs_diff"] < 1e-2 and res["unwrapped_lp_max_abs_diff"] < 1e-2, res
    fsdp2, fsdp, mb1, meg = (run[0] for run in res["metrics"]["grad_norm"])
    for other in (fsdp, meg):
        assert abs(other - fsdp2) <= max(2 * abs(mb1 - fsdp), 1e-4 * fsdp2), res["metrics"]["grad_norm"]
    assert res["update_rel_l2"] < 3 * res["floor_rel_l2"] and res["unwrapped_rel_l2"] < res["floor_rel_l2"], res


@pytest.mark.gpu
def test_bf16_recipe_matches_fsdp_on_gpu(tiny_model_dir: Path, tmp_path: Path, free_port: int) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    res = _launch(tiny_model_dir, tmp_path, free_port, "cuda")
    _check(res)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
