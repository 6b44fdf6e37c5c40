"""The process group every trainer benchmark opens: torchrun's variables, or a one-rank world by itself."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_bench_world(use_cuda: bool) -> tuple[torch.device, int, int, dist.ProcessGroup, object]:
    """Start the default group (NCCL on GPU, gloo on CPU); return device, rank, world size, group and its mesh."""
    from miles.utils.net import find_free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = use_cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    group = dist.new_group(list(range(dist.get_world_size())))
    mesh = torch.distributed.device_mesh.DeviceMesh.from_group(group, device_type=device.type)
    return device, dist.get_rank(), dist.get_world_size(), group, mesh
