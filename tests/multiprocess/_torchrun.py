"""Run a multi-process test file as its own ``torchrun`` worker script (the file re-enters through its
``__main__`` branch), with one thread per rank and this folder importable from the workers."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def torchrun_self(script: Path, nproc: int, port: int, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` of ``script`` on ``nproc`` local ranks. Output goes through a file, not a
    pipe: CPU shared-memory tensors start torch's ``torch_shm_manager``, which inherits the workers' stdout and
    would hold a pipe open; stdout and stderr come back together in ``stdout``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(script), *args]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        log.seek(0)
        proc.stdout, proc.stderr = log.read(), ""
    return proc
