"""megatron-core's first import through ``miles.trainer.megatron`` (``lean_import``): no torch compiler and no wandb
imported, its jit-fused functions compiled on their first call (GPU) or run as plain torch (CPU trainer), and wandb
importable as usual afterwards. Each case runs in a fresh interpreter: only a first import shows it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

PROBE = r"""
import json, sys, importlib.util
import miles.trainer.megatron as backend
assert backend.megatron_available()           # importlib.util.find_spec must not spend the finder
import megatron.core
import megatron.core.models.gpt, megatron.core.transformer.moe.router
from megatron.core.jit import jit_fuser
from megatron.core.transformer.moe import router
from miles.trainer.megatron import lean_import
out = {"inductor_after_import": "torch._inductor.compile_fx" in sys.modules,
       "wandb_after_import": sys.modules.get("wandb") is not None,
       "jit_fuser_is_lazy": jit_fuser is lean_import.lazy_compile,
       "finder_left": any(type(f).__name__ == "_Finder" for f in sys.meta_path),
       "router_fused_is_lazy": getattr(router.TopKRouter._apply_expert_bias, "__wrapped_model__", None) is not None}
import torch
MODE = sys.argv[1]
if MODE == "cpu":
    lean_import.run_fused_eagerly()
    calls = []
    def f(x):
        calls.append(1)
        return x * 2 + 1
    g = jit_fuser(f)
    out["eager_result"] = g(torch.ones(2)).tolist()
    out["eager_ran_python"] = len(calls)
    out["inductor_after_eager_call"] = "torch._inductor.compile_fx" in sys.modules
else:
    real, seen = lean_import._REAL_COMPILE[0], []
    lean_import._REAL_COMPILE[0] = lambda model, **kw: (seen.append(kw), real(model, **kw))[1]
    g = lean_import.lazy_compile(lambda x: x + 1, backend="eager")
    out["compiles_before_call"] = len(seen)
    out["compiled_result"] = [g(torch.zeros(1)).tolist(), g(torch.ones(1)).tolist()]

    class Scale:                      # a method, as megatron-core decorates TopKRouter._apply_expert_bias
        factor = 3.0

        @lean_import.lazy_compile(backend="eager")
        def apply(self, x):
            return x * self.factor
    out["method_result"] = Scale().apply(torch.ones(2)).tolist()
    out["compiles"] = seen
    module = lean_import.lazy_compile(torch.nn.Linear(2, 2), backend="eager")
    out["module_wrapper"] = type(module).__name__
    out["loader_restored"] = type(megatron.core.__spec__.loader).__name__ != "_Loader" and \
        type(megatron.core.__loader__).__name__ != "_Loader"
import wandb
out["wandb_importable_after"] = hasattr(wandb, "init")
print(json.dumps(out))
"""


def probe(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE, mode], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_import_skips_the_compiler_and_wandb_and_cpu_runs_fused_functions_eagerly() -> None:
    out = probe("cpu")
    assert out["inductor_after_import"] is False      # 2.43 s -> 0.82 s a process (docs/benchmarks.md)
    assert out["wandb_after_import"] is False
    assert out["jit_fuser_is_lazy"] and out["router_fused_is_lazy"]
    assert out["finder_left"] is False
    assert out["eager_result"] == [3.0, 3.0] and out["eager_ran_python"] == 1
    assert out["inductor_after_eager_call"] is False
    assert out["wandb_importable_after"] is True


def test_lazily_decorated_function_compiles_on_its_first_call() -> None:
    out = probe("compile")
    assert out["compiles_before_call"] == 0
    assert out["compiled_result"] == [[1.0], [2.0]]
    assert out["method_result"] == [3.0, 3.0]
    assert out["compiles"] == [{"backend": "eager"}] * 3  # once each (function, method, module), its arguments
    assert out["module_wrapper"] == "OptimizedModule"     # a module gets torch's own wrapper
    assert out["loader_restored"] is True
    assert out["wandb_importable_after"] is True
