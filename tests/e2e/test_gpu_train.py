"""train.py / train_async.py on GPUs: NCCL trainer group, engines on their own GPU (broadcast over an
NCCL weight group) or on the trainer's GPU (CUDA IPC hand-off), bf16. Skipped without CUDA; run on the
lent H200s with ``pytest -m gpu tests/e2e/test_gpu_train.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, check_ok, check_run_dir, run

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    if NUM_GPUS == 0:
        pytest.skip("needs a CUDA GPU")
    d = tmp_path_factory.mktemp("quickstart")
    log = d / "prepare.log"
    check_ok(run(["bash", str(QUICKSTART / "prepare.sh"), str(d)], log, timeout=300), log)
    return d


def _flags(d: Path, n: int) -> list[str]:
    import subprocess

    out = subprocess.run(["bash", str(QUICKSTART / "flags.sh"), str(d), str(d / "model")], capture_output=True,
                         text=True, check=True, env={"NUM_ROLLOUT": str(n), "PATH": "/usr/bin:/bin"}).stdout
    # a random model earns no reward, so GRPO's advantages are zero: the entropy term keeps the weights
    # moving, so --check-weight-update-equal compares trained (changed) weights with the engines'
    return ["--train-backend", "fsdp", *out.split(), "--entropy-coef", "0.01"]


def _torchrun(nproc: int, script: str = "train.py") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script]


@pytest.mark.skipif(NUM_GPUS < 2, reason="disaggregated needs 2 GPUs")
def test_disaggregated_nccl_broadcast(quickstart: Path, tmp_path: Path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = _torchrun(2) + ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
                          *_flags(quickstart, 3), "--output-dir", str(out), "--check-weight-update-equal"]
    check_ok(run(cmd, log, timeout=600), log)
    recs = check_run_dir(out, num_rollout=3, num_ranks=2)
    assert all(r["perf/update_weights_time"] > 0 for r in recs)
    assert any(abs(r.get("train/loss", 0.0)) > 0 for r in recs), recs
    assert "(broadcast)" in log.read_text()


def test_colocated_cuda_ipc(quickstart: Path, tmp_path: Path):
    n = min(NUM_GPUS, 2)
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = _torchrun(n) + ["--colocate", "--actor-num-gpus-per-node", str(n), "--num-gpus-per-node", str(n),
                          *_flags(quickstart, 2), "--output-dir", str(out), "--check-weight-update-equal"]
    check_ok(run(cmd, log, timeout=600), log)
    check_run_dir(out, num_rollout=2, num_ranks=n)
    assert "(tensor)" in log.read_text()


@pytest.mark.skipif(NUM_GPUS < 2, reason="async needs 2 GPUs")
def test_async_disaggregated(quickstart: Path, tmp_path: Path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = _torchrun(2, "train_async.py") + ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                                            "--num-gpus-per-node", "2", *_flags(quickstart, 3),
                                            "--output-dir", str(out)]
    check_ok(run(cmd, log, timeout=600), log)
    check_run_dir(out, num_rollout=3, num_ranks=2)
