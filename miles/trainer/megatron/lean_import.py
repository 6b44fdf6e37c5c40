"""megatron-core's first import without two costs it does not need here: 2.43 s -> 0.82 s a process (2-core box; docs/benchmarks.md).

``import megatron.core`` (0.16.1) imports everything its package ``__init__`` names, and two of those imports cost
more than the rest together:

- its ``jit_fuser`` is ``torch.compile``, applied as a decorator to a dozen fused activations when their modules are
  imported; decorating already imports torch's whole compiler stack (``torch._inductor``, about 1.5 s of CPU), though
  nothing is compiled until a decorated function is first called. While megatron-core's package is first imported,
  ``torch.compile`` is ``lazy_compile``: the decorated function calls the real ``torch.compile`` on its first call
  and that compiled function from then on, the same compile at the same moment (torch compiles on the first call
  anyway); the compiler is imported only by a process that calls one of them. On CPU (``run_fused_eagerly()``,
  from ``compat.apply_cpu_compat``) they run as the plain torch they are, as megatron-core's own
  ``disable_jit_fuser`` would make them: inductor's C++ build of each (e.g. the MoE router's
  ``_apply_expert_bias``, recompiled per router instance) cost seconds of every CPU process's first step.
- ``inference/contexts/dynamic_context.py`` imports ``wandb`` when it is installed (about 0.5 s), for its own
  inference logging, which this backend never uses: during that import ``wandb`` reads as absent (megatron-core's
  ``HAVE_WANDB = False``, its documented fallback; its ``timers.py`` binds ``wandb = None`` too, for
  ``Timers.write(writer=wandb)``, which this project does not call); this project's own ``--use-wandb`` imports it
  normally later.

``install()`` (called by this package's ``__init__``, before any megatron-core import of a rank) puts a finder on
``sys.meta_path`` that wraps the one execution of ``megatron/core/__init__.py``, whoever imports it first, and
removes itself after; nothing changes once megatron-core is imported.

    python -X importtime -c "import miles.trainer.megatron, megatron.core"     # see what is left
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from typing import Any

_EAGER = [False]
_REAL_COMPILE: list[Callable] = []          # torch.compile itself, as the window found it


def run_fused_eagerly() -> None:
    """From now on the functions decorated through ``lazy_compile`` run uncompiled (the CPU trainer)."""
    _EAGER[0] = True


def lazy_compile(model: Callable | None = None, **kwargs: Any) -> Callable:
    """``torch.compile``'s signature, compiling on the first call instead of importing the compiler now."""
    if model is None:                       # @torch.compile(mode=...): a decorator
        return lambda fn: lazy_compile(fn, **kwargs)
    import torch

    if isinstance(model, torch.nn.Module):  # a module keeps torch's own wrapper (OptimizedModule)
        return _REAL_COMPILE[0](model, **kwargs)
    compiled: Callable | None = None

    @functools.wraps(model)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal compiled
        if _EAGER[0]:
            return model(*args, **kw)
        if compiled is None:
            compiled = _REAL_COMPILE[0](model, **kwargs)
        return compiled(*args, **kw)

    call.__wrapped_model__ = model          # what was decorated (tests, debugging)
    return call


@contextlib.contextmanager
def lean_window() -> Iterator[None]:
    """``torch.compile`` lazy and ``wandb`` absent for the duration (each restored after, even on error)."""
    import torch

    real = torch.compile
    _REAL_COMPILE[:] = [real]
    hide_wandb = "wandb" not in sys.modules
    torch.compile = lazy_compile
    if hide_wandb:
        sys.modules["wandb"] = None         # `import wandb` raises ImportError while this holds
    try:
        yield
    finally:
        torch.compile = real
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        uninstall()                         # once: megatron-core is being imported
        try:
            with lean_window():
                self.inner.exec_module(module)
        finally:                            # the package keeps its own loader (pkgutil.get_data and kin)
            module.__loader__ = self.inner
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self.inner


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` as the other finders do (``importlib.util.find_spec`` included) and wraps its loader;
    the first execution removes the finder."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Wrap megatron-core's first import (a no-op once it is imported or the finder is in place)."""
    if "megatron.core" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_FINDER)
