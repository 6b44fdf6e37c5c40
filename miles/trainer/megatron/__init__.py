"""The megatron-core trainer backend (``--train-backend megatron``); see ``trainer.py`` and docs/trainer.md.

Importing this package needs no megatron-core; ``miles.trainer.build.build_trainer`` raises one line naming the
install command when it is missing (``require_megatron_core``).
"""

from __future__ import annotations

import importlib.util
import warnings

from miles.trainer.megatron import lean_import
from miles.utils.errors import MilesError

# megatron-core 0.16 warns at import, once per module and rank, that its optional fused kernels are absent
# (apex, transformer-engine): torch's implementations are used, which is what this backend runs on CPU.
# Exactly these messages are filtered (installed before any megatron import: this package comes first);
# ``optional_kernels_line`` says once what is absent.
OPTIONAL_KERNEL_WARNINGS = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
)
for _message in OPTIONAL_KERNEL_WARNINGS:
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=r"megatron\.core")

# megatron-core's first import without torch's compiler and wandb, which it imports and this backend does not use
# until a fused function is called (lean_import.py)
lean_import.install()


def optional_kernels_line() -> str | None:
    """One line naming the optional kernel packages that are not installed (None when both are)."""
    absent = [name for name, module in (("apex", "apex"), ("transformer-engine", "transformer_engine"))
              if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return (f"megatron-core optional kernels absent ({', '.join(absent)} not installed): torch's implementations "
            "are used (optimizer, norms, gradient clipping).")


INSTALL_HINT = "pip install 'miles[megatron]' (megatron-core 0.16.1), or train with --train-backend fsdp"


def megatron_available() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:            # a broken or foreign ``megatron`` package
        return False


def require_megatron_core() -> None:
    """One line naming the install command and the other backend when megatron-core is missing (the preflight
    and ``--dry-run`` call this too, so a run that names no backend learns it before starting anything)."""
    if not megatron_available():
        raise MilesError("--train-backend megatron (the default, as in Miles) needs megatron-core, which is not "
                         f"installed: {INSTALL_HINT}.")

