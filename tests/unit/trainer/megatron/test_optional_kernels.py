"""megatron-core's import-time warnings that apex / transformer-engine are absent are filtered by message
(``miles/trainer/megatron/__init__.py``); one info line says which optional kernels are absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[4]
# the megatron-core modules the trainer imports that warn about absent optional kernels
IMPORTS = ("import miles.trainer.megatron as m; import megatron.core.optimizer; "
           "from megatron.core.models.gpt import gpt_layer_specs; "
           "from megatron.core.distributed.fsdp.src.megatron_fsdp import mixed_precision; "
           "print(m.optional_kernels_line())")


def test_optional_kernel_warnings_are_filtered_and_said_once() -> None:
    out = subprocess.run([sys.executable, "-c", IMPORTS], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not installed" not in out.stderr, out.stderr[-3000:]
    import importlib.util

    absent = [n for n, mod in (("apex", "apex"), ("transformer-engine", "transformer_engine"))
              if importlib.util.find_spec(mod) is None]
    if absent:
        assert out.stdout.strip() == (f"megatron-core optional kernels absent ({', '.join(absent)} not installed): "
                                      "torch's implementations are used (optimizer, norms, gradient clipping).")


def test_other_megatron_warnings_are_kept() -> None:
    code = ("import warnings, miles.trainer.megatron\n"
            "with warnings.catch_warnings(record=True) as w:\n"     # the filters in place, UserWarnings recorded
            "    for i, text in enumerate(['Apex is not installed. Falling back to Torch Norm', 'something else']):\n"
            "        warnings.warn_explicit(text, UserWarning, 'x.py', i, module='megatron.core.models.backends')\n"
            "print([str(x.message) for x in w])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "['something else']", out.stdout + out.stderr[-2000:]
