"""Megatron flags that need a GPU kernel package: accepted where the package imports (and its kernels are wired),
else refused in one line.

megatron-core 0.16.1 runs these only through a package of its own kernels (no torch path it could fall back to):

| flag | package | what megatron-core runs with it |
|---|---|---|
| ``--moe-grouped-gemm`` | transformer_engine | ``TEGroupedMLP`` (TE's grouped GEMM; the local ``GroupedMLP`` needs the ``grouped_gemm`` package, whose fused weight layout miles does not convert) |
| ``--moe-permute-fusion`` | transformer_engine | TE's fused token permutation |
| ``--attention-backend fused`` | transformer_engine | TE's cuDNN fused attention |
| ``--moe-enable-deepep``, ``--moe-token-dispatcher-type flex`` | deep_ep | DeepEP's fused all-to-all (``MoEFlexTokenDispatcher``) |
| ``--dsa-attention-backend tilelang`` | tilelang | Miles's fused TileLang DSA kernels (SparseMLA, lightning indexer): not wired here, refused even where tilelang imports |

``check_kernel_flags(cfg.megatron)`` is called by the Megatron backend's start-up checks (``--dry-run`` included,
``miles.trainer.megatron.spec``): a flag given while its package does not import is one line naming the flag, the
package, how to install it and what to pass instead; a row with ``unwired`` set (kernels miles has not wired:
Miles's own TileLang DSA kernels, not megatron-core's) is refused where its package imports too, in one line saying
so. Run the dry run where the trainer runs (a GPU node), as for ``--rollout-engine auto``. ``importable`` is the one
place the packages are probed.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.config.base import ConfigError

TE_INSTALL = "pip install --no-build-isolation 'transformer_engine[pytorch]' on the GPU nodes"
DEEPEP_INSTALL = "build DeepEP (https://github.com/deepseek-ai/DeepEP, Python package deep_ep) on the GPU nodes"
TILELANG_INSTALL = "pip install tilelang on the GPU nodes"


@dataclass(frozen=True)
class KernelFlag:
    flag: str                            # as shown in the error ("--attention-backend fused")
    dest: str                            # MegatronConfig field
    given: Callable[[Any], bool]         # the field's value -> does this flag need the package
    module: str                          # the package's import name
    package: str                         # its name for people (pip / project)
    install: str
    instead: str                         # what to pass without the package
    unwired: str = ""                    # set: miles has no kernels of this package wired (why), refused anyway


KERNEL_FLAGS: tuple[KernelFlag, ...] = (
    KernelFlag("--moe-grouped-gemm", "moe_grouped_gemm", bool, "transformer_engine", "transformer-engine", TE_INSTALL,
               "drop it (the experts then run one GEMM each, megatron-core's SequentialMLP: the same math)"),
    KernelFlag("--moe-permute-fusion", "moe_permute_fusion", bool, "transformer_engine", "transformer-engine",
               TE_INSTALL, "drop it (tokens are then permuted unfused: the same result)"),
    KernelFlag("--attention-backend fused", "attention_backend", lambda v: v == "fused", "transformer_engine",
               "transformer-engine", TE_INSTALL, "use --attention-backend auto or flash (torch SDPA)"),
    KernelFlag("--moe-enable-deepep", "moe_enable_deepep", bool, "deep_ep", "DeepEP", DEEPEP_INSTALL,
               "drop it and use --moe-token-dispatcher-type alltoall"),
    KernelFlag("--moe-token-dispatcher-type flex", "moe_token_dispatcher_type", lambda v: v == "flex", "deep_ep",
               "DeepEP", DEEPEP_INSTALL, "use --moe-token-dispatcher-type alltoall"),
    # radixark/miles@v0.1.0:miles/utils/arguments.py --dsa-attention-backend (default tilelang there; its GLM-5.1/5.2
    # LoRA recipes pass it): the fused SparseMLA + lightning-indexer kernels
    KernelFlag("--dsa-attention-backend tilelang", "dsa_attention_backend", lambda v: v == "tilelang", "tilelang",
               "TileLang", TILELANG_INSTALL,
               "use --dsa-attention-backend megatron (DeepSeek sparse attention and its indexer in torch: the same "
               "math, unfused)",
               unwired="miles's Megatron backend has no TileLang kernels wired (it runs DeepSeek sparse attention and "
                       "its indexer in torch)"),
)


def importable(module: str) -> bool:
    """True when ``module`` imports here (a package that is installed but fails to load, e.g. without its CUDA
    libraries, counts as absent)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001 - any failure to load the extension means the kernels cannot run here
        return False


def kernel_flags_given(m) -> list[KernelFlag]:
    """The rows of ``KERNEL_FLAGS`` the Megatron section ``m`` gives."""
    if m is None:
        return []
    return [k for k in KERNEL_FLAGS if k.given(getattr(m, k.dest, None))]


def check_kernel_flags(m, importable: Callable[[str], bool] = importable) -> None:
    """One ``ConfigError`` line for the first flag of ``m`` whose kernel package does not import, or whose kernels
    miles has not wired (``unwired``)."""
    for k in kernel_flags_given(m):
        if not importable(k.module) and k.unwired:      # installing it would not help: say both, then the fix
            raise ConfigError(f"{k.flag} needs {k.package} (Python package {k.module}), which does not import here, "
                              f"and {k.unwired}; {k.instead}.")
        if not importable(k.module):
            raise ConfigError(f"{k.flag} needs {k.package} (Python package {k.module}), which does not import here: "
                              f"{k.install}, or {k.instead}.")
        if k.unwired:
            raise ConfigError(f"{k.flag}: {k.package} (Python package {k.module}) imports here, but {k.unwired}; "
                              f"{k.instead}.")


def flag_docs() -> list[str]:
    """The docs/flags.md section for ``KERNEL_FLAGS`` (tools/gen_flag_docs.py)."""
    lines = ["## Flags that need a GPU kernel package", "",
             "Accepted where the package imports (unless said below); otherwise refused in one line naming it "
             "(`--dry-run` too: run it "
             "where the trainer runs).", "", "| flag | package (import name) | install | without it |", "|---|---|---|---|"]
    lines += [f"| `{k.flag}` | {k.package} (`{k.module}`) | {'not wired (below)' if k.unwired else k.install} | "
              f"{k.instead} |" for k in KERNEL_FLAGS]
    unwired = [f"`{k.flag}` is refused where {k.package} imports too: {k.unwired}." for k in KERNEL_FLAGS if k.unwired]
    return lines + [""] + (unwired + [""] if unwired else [])
