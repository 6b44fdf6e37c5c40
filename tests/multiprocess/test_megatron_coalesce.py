"""Miles's default micro-batching (``--micro-batch-size 1``, no dynamic batching) on the Megatron backend: the
planned micro-batches share forwards (``MegatronTrainer._coalesce``) and the count is no longer padded over the DP
group, and the step is the old one (one forward per sample, dummy passes up to the group-wide count) up to float
summation order: the same loss and metrics, the same gradients after the DP reduction, the same updated weights.
2 gloo ranks (DP 2): rank 1 with fewer samples, then with none; per-sample and per-token loss, KL loss and an
entropy term; the reference log-probs (a forward-only pass) are coalesced too.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()

CONFIGS = {     # name: (flags, samples of rank 1; rank 0 has 6)
    "per_sample": (["--use-kl-loss", "--kl-loss-coef", "0.05", "--entropy-coef", "0.01"], 3),
    "per_token": (["--calculate-per-token-loss", "--use-kl-loss", "--kl-loss-coef", "0.05"], 3),
    "empty_rank": (["--use-kl-loss", "--kl-loss-coef", "0.05"], 0),
}


def _worker(model_dir: str, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from miles.config import parse_args
    from miles.trainer.fsdp import FSDPTrainer
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.types import Sample

    class Probe(MegatronTrainer):
        """Counts the model forwards and keeps the reduced, clipped gradients of the step."""

        forwards = 0

        def _rows_forward(self, model, mb, x=None):
            self.forwards += 1
            return super()._rows_forward(model, mb, x)

        def _clip_grad_norm(self) -> float:
            gn = super()._clip_grad_norm()
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
            return gn

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(11 + rank)
    all_samples = []
    for k in range(6):
        prompt, resp = int(torch.randint(3, 9, (1,), generator=gen)), int(torch.randint(2, 7, (1,), generator=gen))
        all_samples.append(Sample(group_index=rank * 10 + k // 3, index=k, reward=float(k % 2),
                                  tokens=torch.randint(4, 90, (prompt + resp,), generator=gen).tolist(),
                                  response_length=resp, loss_mask=[1] * (resp - 1) + [k % 2]))
    res: dict = {}
    for name, (extra, rank1_samples) in CONFIGS.items():
        samples = all_samples if rank == 0 else all_samples[:rank1_samples]
        for mode in ("slow", "coalesced"):
            cfg = parse_args(["--hf-checkpoint", model_dir, "--num-rollout", "2", "--rollout-batch-size", "3",
                              "--n-samples-per-prompt", "3", "--lr", "1e-3", "--num-steps-per-rollout", "1",
                              "--train-backend", "megatron", "--micro-batch-size", "1"] + extra)
            torch.manual_seed(0)
            tr = Probe(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=group, device=torch.device("cpu"),
                       rollout_temperature=1.0, num_rollout=2, global_batch_size=None, num_steps_per_rollout=1,
                       timeout=60)
            if mode == "slow":      # the path before: one forward per sample, dummies up to the group-wide count
                tr.coalesce_tokens = lambda: 0
                tr._micro_batches = functools.partial(FSDPTrainer._micro_batches, tr)
            metrics = tr.train(samples, 0)
            res[f"{name}/{mode}"] = {
                "metrics": {k: float(v) for k, v in metrics.items() if not k.startswith(("phase", "perf"))
                            and "time" not in k and "per_s" not in k and k != "mfu"},
                "grads": {n: g.double().flatten().tolist() for n, g in tr.grads.items()},
                "params": {n: t.double().flatten().tolist() for n, t in tr.state_dict_for_check().items()},
                "forwards": tr.forwards}
            del tr
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    dist.barrier(group)
    dist.destroy_process_group()


def _rel(a: list[float], b: list[float]) -> float:
    """Relative L2 difference of ``a`` from ``b``."""
    import torch

    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def test_coalesced_micro_batches_give_the_one_forward_per_sample_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    from miles.utils.net import find_free_port

    out = tmp_path / "res.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr", "127.0.0.1",
           "--master-port", str(find_free_port()), str(HERE), str(tiny_model_dir), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res, res1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    for name, (_, rank1_samples) in CONFIGS.items():
        slow, fast = res[f"{name}/slow"], res[f"{name}/coalesced"]
        # rank 0: 6 samples, 6 forwards of the reference and 6 of the training pass one by one, 1 + 1 coalesced;
        # rank 1 padded to 6 + 6 with dummies before, now its own samples only (none: no forward at all)
        assert slow["forwards"] == 12 and fast["forwards"] == 2, (slow["forwards"], fast["forwards"])
        assert res1[f"{name}/slow"]["forwards"] == 12
        assert res1[f"{name}/coalesced"]["forwards"] == (2 if rank1_samples else 0)
        assert slow["metrics"].keys() == fast["metrics"].keys()
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm", "ppo_kl", "entropy"):
            s, f = slow["metrics"][key], fast["metrics"][key]
            assert abs(s - f) <= 1e-5 * max(abs(s), 1e-3), (name, key, s, f)
        assert slow["grads"].keys() == fast["grads"].keys() and slow["grads"]
        worst = max(_rel(fast["grads"][n], slow["grads"][n]) for n in slow["grads"])
        assert worst < 1e-5, (name, worst)                   # fp32 summed in another order: ~1e-7
        # one AdamW step (lr 1e-3) turns those roundings of near-zero gradients into ~1e-6 of the weights
        worst = max(_rel(fast["params"][n], slow["params"][n]) for n in slow["params"])
        assert worst < 2e-5, (name, worst)
    # the two losses are different configurations (the comparison above is not vacuous)
    assert len({res[f"{n}/slow"]["metrics"]["loss"] for n in CONFIGS}) == len(CONFIGS)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
