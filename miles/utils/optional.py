"""Lazy imports of optional dependencies, failing with the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {
    "sglang": "sglang",
    "megatron": "megatron",
    "megatron.core": "megatron",
    "transformer_engine": "megatron",
    "torchft": "ft",
    "nvidia_resiliency_ext": "ft",
    "wandb": "wandb",
    "mpi4py": "mpi",
}


class MissingDependencyError(ImportError):
    """An optional dependency is needed for the requested feature but is not installed."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise MissingDependencyError naming the feature and the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS.get(module, EXTRAS.get(module.split(".")[0]))
        hint = f"pip install 'miles[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise MissingDependencyError(f"{feature} needs the Python package '{module}', which is not importable ({e}). Install it with: {hint}") from e


def available(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False
