"""``--deterministic-mode`` means the same on both trainer backends (built through ``build_trainer`` on 2 real gloo
ranks): torch's deterministic algorithms on (an op without a deterministic implementation raises instead of
running), cuDNN deterministic and not autotuned, and on the Megatron backend megatron-core's own
``TransformerConfig.deterministic_mode`` on every model it builds (Miles's meaning: radixark/miles@v0.1.0
sets up the same for Megatron). One GRPO rollout trains under it; without the flag none of it is set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _torchrun import torchrun_self

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def _worker(model_dir: str, out: str, backend: str, deterministic: str) -> None:
    import torch
    import torch.distributed as dist
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo")
    flags = ["--deterministic-mode"] if deterministic == "1" else []
    tr = build(model_dir, ["--train-backend", backend, "--rollout-batch-size", "4", "--use-kl-loss", "--kl-loss-coef",
                           "0.01", "--entropy-coef", "0.01", *flags])
    rank = dist.get_rank()
    metrics = tr.train(random_samples(2, 2, seed=rank, vocab=tr.vocab_size, first_group=2 * rank), rollout_id=0)
    res = {"backend": tr.backend, "torch": torch.are_deterministic_algorithms_enabled(),
           "cudnn": bool(torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark),
           "grad_norm": metrics["grad_norm"]}
    if backend == "megatron":
        res["mcore"] = [bool(m.config.deterministic_mode) for m in (tr.model, tr.ref)]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_deterministic_mode_on_both_backends(tiny_model_dir: Path, tmp_path: Path, free_port: int,
                                             backend: str) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    results = {}
    for flag in ("1", "0"):
        out = tmp_path / f"{backend}_{flag}.json"
        proc = torchrun_self(HERE, 2, free_port, str(tiny_model_dir), str(out), backend, flag, timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:]
        results[flag] = json.loads(out.read_text())
    on, off = results["1"], results["0"]
    assert on["backend"] == backend and on["torch"] and on["cudnn"] and on["grad_norm"] > 0, on
    assert not off["torch"] and not off["cudnn"], off
    if backend == "megatron":
        assert on["mcore"] == [True, True] and off["mcore"] == [False, False], (on, off)


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
