"""Without megatron-core, --train-backend megatron is one line naming the install command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


def test_missing_megatron_core_is_one_line(tmp_path: Path) -> None:
    shim = tmp_path / "shim" / "megatron"          # a ``megatron`` package without ``core`` shadows the real one
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    code = ("from types import SimpleNamespace\n"
            "from miles.trainer.build import build_trainer\n"
            "from miles.trainer.megatron import megatron_available\n"
            "assert not megatron_available()\n"
            "try:\n    build_trainer(SimpleNamespace(train_backend='megatron'), None, None, group=None, device='cpu', "
            "rollout_temperature=1.0, num_rollout=1, global_batch_size=None, num_steps_per_rollout=1, timeout=1)\n"
            "except Exception as e:\n    print(type(e).__name__, '|', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("MilesError | --train-backend megatron (the default, as in Miles) needs megatron-core, "
                                  "which is not installed: pip install 'miles[megatron]' (megatron-core 0.16.1), or "
                                  "train with --train-backend fsdp.")
