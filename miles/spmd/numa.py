"""Bind a GPU rank to the CPUs (and, where libnuma exists, the memory) of its GPU's NUMA node.

NVML (``nvidia-ml-py``, module ``pynvml``) reports each GPU's CPU affinity; we intersect it with the
CPUs this process may use (cgroups, the launcher's own binding) and pin the process there, so host
buffers of the data loader, the collectives and pinned copies stay on the GPU's socket. Without a GPU,
without NVML, or with ``MILES_NUMA_BIND=0`` it does nothing and says why once.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.utils.logging import get_logger, warn_once
from miles.utils.optional import MissingDependencyError, require

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)


@dataclass(frozen=True)
class NumaBinding:
    gpu_index: int
    cpus: tuple[int, ...]
    numa_node: int | None
    memory_bound: bool


def cpus_from_masks(masks: list[int], word_bits: int = 64) -> set[int]:
    """NVML's affinity words (word 0 = CPUs 0..63) as a set of CPU ids."""
    return {i * word_bits + b for i, word in enumerate(masks) for b in range(word_bits) if (int(word) >> b) & 1}


def _nvml_handle(pynvml: Any, index: int) -> Any:
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass
    if hasattr(props, "pci_bus_id"):
        bus = f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    # No UUID or PCI id from torch: map through CUDA_VISIBLE_DEVICES (integers only).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = int(visible.split(",")[index]) if visible and visible.split(",")[index].strip().isdigit() else index
    return pynvml.nvmlDeviceGetHandleByIndex(physical)


def _numa_node(pynvml: Any, handle: Any) -> int | None:
    try:
        node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
        return node if node >= 0 else None
    except (pynvml.NVMLError, AttributeError):
        pass
    try:
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        with open(f"/sys/bus/pci/devices/{bus.lower()[-12:]}/numa_node") as f:
            node = int(f.read().strip())
        return node if node >= 0 else None
    except (OSError, ValueError, pynvml.NVMLError):
        return None


def _prefer_memory_node(node: int) -> bool:
    """numa_set_preferred(node) through libnuma, when the library is installed."""
    try:
        libnuma = ctypes.CDLL("libnuma.so.1")
    except OSError:
        return False
    if libnuma.numa_available() < 0:
        return False
    libnuma.numa_set_preferred(ctypes.c_int(node))
    return True


def bind_to_gpu(device: torch.device) -> NumaBinding | None:
    """Pin this process to its GPU's CPUs (and preferred memory node). Returns what was done, or None."""
    if device.type != "cuda":
        return None
    if os.environ.get("MILES_NUMA_BIND", "1") == "0":
        logger.info("NUMA binding off (MILES_NUMA_BIND=0)")
        return None
    try:
        pynvml = require("pynvml", "NUMA/CPU binding of GPU ranks")
    except MissingDependencyError as e:
        warn_once(logger, f"no NUMA binding: {e}")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        warn_once(logger, f"no NUMA binding: NVML is not usable here ({e})")
        return None
    try:
        index = device.index if device.index is not None else 0
        handle = _nvml_handle(pynvml, index)
        words = ((os.cpu_count() or 64) + 63) // 64
        gpu_cpus = cpus_from_masks(list(pynvml.nvmlDeviceGetCpuAffinity(handle, words)))
        allowed = os.sched_getaffinity(0)
        target = gpu_cpus & allowed
        if not target:
            warn_once(logger, f"no NUMA binding: GPU {index}'s CPUs {sorted(gpu_cpus)[:8]}... are outside this "
                              "process's allowed CPUs (the launcher already bound it elsewhere)")
            return None
        os.sched_setaffinity(0, target)
        node = _numa_node(pynvml, handle)
        memory = _prefer_memory_node(node) if node is not None else False
        binding = NumaBinding(index, tuple(sorted(target)), node, memory)
        logger.info("bound to GPU %d's NUMA node %s: %d CPUs (%d..%d), memory preferred: %s", index, node,
                    len(target), min(target), max(target), memory)
        return binding
    except pynvml.NVMLError as e:
        warn_once(logger, f"no NUMA binding: NVML query failed ({e})")
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
