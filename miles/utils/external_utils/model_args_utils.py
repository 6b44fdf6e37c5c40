"""Miles's ``model_args_utils``: a model's Megatron shape flags from its ``scripts/models/<type>.py``.

A model script defines ``model_args(**kwargs) -> str`` (Miles's scripts/models/ layout; a script may do
``from model_args_utils import moe_layer_freq``). The scripts belong to the Miles checkout a launcher comes
from, so they are looked up, in order, in: the ``model_script_dir`` argument, ``$MILES_MODEL_SCRIPT_DIR``,
``models/`` beside the running launcher (a Miles checkout's ``scripts/models`` for ``scripts/run_*.py``), and
this repository's ``scripts/models``.

These flags only restate the model's shape: our Megatron backend builds the model from ``--hf-checkpoint``'s
``config.json`` (and checks any shape flag given against it). So ``shell_safe_model_args`` of a model type
whose script is found nowhere logs one line and adds no flags, and the job still starts.

``python -m miles.utils.external_utils.model_args_utils TYPE`` prints one model's flags.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType

from miles.utils.logging import get_logger

logger = get_logger("miles.launcher")

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_SCRIPT_DIR = REPO_ROOT / "scripts" / "models"
MODEL_SCRIPT_DIR_ENV = "MILES_MODEL_SCRIPT_DIR"


def _launcher_dir() -> Path | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else None)
    return Path(path).resolve().parent if path else None


def model_script_dirs(model_script_dir: Path | None = None) -> list[Path]:
    """Where a model script is looked for, in order (see the module docstring)."""
    dirs = [model_script_dir] if model_script_dir is not None else []
    if os.environ.get(MODEL_SCRIPT_DIR_ENV):
        dirs.append(Path(os.environ[MODEL_SCRIPT_DIR_ENV]))
    if (here := _launcher_dir()) is not None:
        dirs.append(here / "models")
    dirs.append(MODEL_SCRIPT_DIR)
    return list(dict.fromkeys(Path(d) for d in dirs))


def find_model_script(model_type: str, model_script_dir: Path | None = None) -> Path | None:
    """The first ``<dir>/<model_type>.py`` of ``model_script_dirs``, or None."""
    for d in model_script_dirs(model_script_dir):
        if (d / f"{model_type}.py").is_file():
            return d / f"{model_type}.py"
    return None


def load_model_args(model_type: str, model_script_dir: Path | None = None, **kwargs: object) -> str:
    """The flags of ``<model_type>.py``'s ``model_args(**kwargs)`` on one line; one error line if not found."""
    path = find_model_script(model_type, model_script_dir)
    if path is None:
        looked = ", ".join(str(d) for d in model_script_dirs(model_script_dir))
        raise FileNotFoundError(f"no model script {model_type}.py in {looked}; point ${MODEL_SCRIPT_DIR_ENV} at a "
                                "directory holding it (a Miles checkout's scripts/models)")
    sys.modules.setdefault("model_args_utils", sys.modules[__name__])
    module = import_module_from_path(path, "miles_model_args_" + path.stem.replace(".", "_").replace("-", "_"))
    if not callable(getattr(module, "model_args", None)):
        raise ValueError(f"{path} defines no model_args() function")
    args = " ".join(str(module.model_args(**kwargs)).split())
    if not args:
        raise ValueError(f"{path}: model_args() returned no flags")
    return args


def load_sibling_model_args(model_script: str, model_type: str, **kwargs: object) -> str:
    """The flags of ``model_type``'s script in the same directory as ``model_script`` (a variant's base)."""
    return load_model_args(model_type, model_script_dir=Path(model_script).resolve().parent, **kwargs)


def shell_safe_model_args(model_type: str | None) -> str:
    """``load_model_args`` with each token shell-quoted (``[1,1,0]`` is a glob); "" for None or no script."""
    if model_type is None:
        return ""
    if find_model_script(model_type) is None:
        logger.info("model args of %r: no %s.py in %s; adding no shape flags (the Megatron backend reads the "
                    "model's shape from --hf-checkpoint's config.json)", model_type, model_type,
                    ", ".join(str(d) for d in model_script_dirs()))
        return ""
    return " ".join(shlex.quote(token) for token in load_model_args(model_type).split())


def moe_layer_freq(*, nlayers: int, first_k_dense_replace: int) -> str:
    """Megatron's ``--moe-layer-freq`` list: the first ``first_k_dense_replace`` layers dense (0), the rest MoE (1)."""
    dense = max(0, min(first_k_dense_replace, nlayers))
    return "[" + ",".join("0" * dense + "1" * (nlayers - dense)) + "]"


def import_module_from_path(path: Path, module_name: str) -> ModuleType:
    """Import the Python file ``path`` as ``module_name`` (not left in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(module_name, None)
    return module


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m miles.utils.external_utils.model_args_utils MODEL_TYPE")
    try:
        print(load_model_args(sys.argv[1]))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
