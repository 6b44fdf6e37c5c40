"""Object collectives with a bounded wait.

``torch.distributed.all_gather_object`` has no bounded wait on NCCL: it reads the gathered sizes with a
host-blocking ``.item()``, so a silent peer hangs the caller for the process group's whole timeout (or for
ever). ``bounded_all_gather_object`` gathers the pickled sizes, then the bytes padded to the largest size,
each as async work waited on for at most ``timeout`` seconds; a peer that never joins ends the call in one
line, a ``TimeoutError`` naming what was being gathered, the group (its ``group_desc``, else its ranks), its size,
the bound and what to check (``miles.utils.process_groups.wait_timeout_message``, as every bounded wait words it).
``bounded_union_of_names``: the union of every rank's names (a step's metric names), in one gather of a
24-byte fingerprint (a 16-byte digest and the count) when every rank has the same names (the usual case: 1
collective, not the object gather's 2).
"""

from __future__ import annotations

import hashlib
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from miles.utils.process_groups import wait_timeout_message


def _wait(work: Any, what: str, size: int, timeout: float, group: dist.ProcessGroup | None = None) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as e:                       # gloo raises on a timeout, NCCL may return False
        raise TimeoutError(wait_timeout_message(what, group, timeout, size=size, error=e)) from e
    if ok is False:
        raise TimeoutError(wait_timeout_message(what, group, timeout, size=size))


def bounded_all_gather_object(obj: Any, group: dist.ProcessGroup | None, timeout: float,
                              device: torch.device, what: str = "gathering objects") -> list[Any]:
    """Every rank's picklable ``obj`` in group-rank order, as ``dist.all_gather_object`` returns them, each of
    the two gathers (sizes, bytes; tensors on ``device``, which must suit the group's backend) waited on for at
    most ``timeout`` seconds. Collective on ``group``."""
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(size)]
    _wait(dist.all_gather(sizes, mine, group=group, async_op=True), what, size, timeout, group)
    lengths = [int(n) for n in torch.cat(sizes).cpu().tolist()]
    longest = max(lengths)
    send = torch.zeros(longest, dtype=torch.uint8, device=device)
    send[:payload.numel()] = payload
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    _wait(dist.all_gather(bufs, send, group=group, async_op=True), what, size, timeout, group)
    return [pickle.loads(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]


def bounded_union_of_names(names: set[str] | list[str], group: dist.ProcessGroup | None, timeout: float,
                           device: torch.device, what: str = "gathering names") -> list[str]:
    """The sorted union of every rank's ``names``, as ``bounded_all_gather_object`` of the sorted names would give
    it: one all-gather of a blake2b digest of the names; only when the digests differ (some rank has other
    names) the names themselves are gathered. Collective on ``group``; every wait bounded by ``timeout``."""
    mine = sorted(names)
    size = dist.get_world_size(group)
    if size == 1:
        return mine
    digest = hashlib.blake2b("\0".join(mine).encode(), digest_size=16, person=b"miles-names").digest()
    local = torch.frombuffer(bytearray(digest + len(mine).to_bytes(8, "little")), dtype=torch.int64).to(device)
    out = torch.empty(size * local.numel(), dtype=torch.int64, device=device)
    _wait(dist.all_gather_into_tensor(out, local, group=group, async_op=True), what, size, timeout, group)
    if bool((out.view(size, -1) == local).all()):
        return mine
    return sorted(set().union(*bounded_all_gather_object(mine, group, timeout, device, what)))
