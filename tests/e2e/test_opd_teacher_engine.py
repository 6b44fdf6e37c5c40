"""On-policy distillation with teacher log-probs from a teacher ENGINE (--opd-type sglang): a standalone
embedded engine serves the teacher; train.py (1 trainer rank + 1 student engine) folds its reverse KL
into the advantages."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, check_ok, check_run_dir, metrics, quickstart_copy, run

from miles.fleet.client import EngineControl
from miles.fleet.engines import build_engine_argv, engine_url
from miles.spmd.supervisor import EngineSupervisor
from miles.utils.net import find_free_port
from miles.utils.tiny_model import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_opd_with_a_teacher_engine(tmp_path: Path, quickstart_prepared: Path):
    qs = tmp_path / "qs"
    quickstart_copy(quickstart_prepared, qs)                  # prepare.sh's, built once a session
    teacher_dir = build_tiny_model(tmp_path / "teacher", hidden_size=64, num_layers=2, seed=7)  # same tokenizer
    port = find_free_port()
    argv = build_engine_argv("embedded", hf_checkpoint=str(teacher_dir), host="127.0.0.1", port=port,
                             api_key=None, device="cpu", max_running_requests=64, max_context_len=64)
    sup = EngineSupervisor(argv, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, name="teacher",
                           log_path=tmp_path / "teacher.log", max_restarts=0).start()
    try:
        async def up():
            async with EngineControl(engine_url("127.0.0.1", port)) as ctl:
                await ctl.wait_healthy(180, alive=lambda: sup.alive)
        asyncio.run(up())
        flags = subprocess.run(["bash", str(QUICKSTART / "flags.sh"), str(qs), str(qs / "model")], text=True,
                               capture_output=True, check=True, env={"NUM_ROLLOUT": "2", "PATH": "/usr/bin:/bin"})
        out, log = tmp_path / "run", tmp_path / "run.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
               "--train-backend", "fsdp", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
               *flags.stdout.split(), "--eval-interval", "100", "--output-dir", str(out), "--no-progress",
               "--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", engine_url("127.0.0.1", port),
               "--opd-kl-coef", "1.0"]
        check_ok(run(cmd, log, timeout=420), log)
    finally:
        sup.stop()
    check_run_dir(out, num_rollout=2, num_ranks=2)
    recs = metrics(out)
    assert all(r["perf/teacher_time"] > 0 for r in recs), recs
    kl = [r[k] for r in recs for k in r if "opd" in k]
    assert kl and all(v != 0 for v in kl), recs  # a different teacher: the reverse KL is not zero
