"""One rank of the wire-format scatter test (run by test_wire.py as 3 real gloo processes).

Rank 0 is a driver that does not train; ranks 1-2 are "trainer" ranks. Writes what it saw as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from miles.run.wire import (
    INLINE_BYTES,
    SampleWireError,
    broadcast_bytes,
    decode_samples,
    encode_samples,
    scatter_samples,
    split_for_dp,
)
from miles.types import Sample, SampleStatus


def make_groups(num_groups: int = 6, n: int = 3) -> list[list[Sample]]:
    groups = []
    for g in range(num_groups):
        grp = []
        for i in range(n):
            resp = (g * 7 + i * 3) % 11 + 1
            grp.append(Sample(group_index=g, index=g * n + i, rollout_id=4, prompt=f"prompt ✓ {g}",
                              tokens=list(range(5 + g)) + [100 + k for k in range(resp)], response=f"r{i}",
                              response_length=resp, loss_mask=[1] * resp, rollout_log_probs=[-0.5] * resp,
                              reward=float(i % 2), weight_version=3, status=SampleStatus.COMPLETED,
                              metadata={"g": g, "名": "値"}, label=str(g)))
        groups.append(grp)
    return groups


def summary(samples: list[Sample]) -> list[list]:
    return [[s.group_index, s.index, len(s.tokens), s.prompt, s.metadata] for s in samples]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=60))
    result: dict = {}
    # 1. driver (rank 0, not a trainer) -> trainer ranks 1 and 2 over the default group
    per_rank = None
    if a.rank == 0:
        per_rank = [[], *split_for_dp(make_groups(), 2)]
    got = scatter_samples(per_rank, None, src=0, timeout=30)
    result["scatter_default"] = summary(got)
    result["roundtrip_equal"] = got == ([s for s in split_for_dp(make_groups(), 2)[a.rank - 1]] if a.rank else [])
    # 2. a subgroup [1, 2] with the source given as a GLOBAL rank (2)
    sub = dist.new_group([1, 2], timeout=timedelta(seconds=30))
    if a.rank in (1, 2):
        per_rank = [make_groups(2)[0], make_groups(2)[1]] if a.rank == 2 else None
        got = scatter_samples(per_rank, sub, src=2, timeout=30)
        result["scatter_sub"] = summary(got)
        if a.rank == 2:  # the source's own share is returned as given (not sent, not re-decoded)
            result["src_own_as_given"] = len(got) == 3 and all(x is y for x, y in zip(got, per_rank[1]))
    # 3. a corrupted payload: every receiver gets SampleWireError
    data = None
    if a.rank == 0:
        buf = bytearray(encode_samples(make_groups(1)[0]))
        buf[len(buf) // 2] ^= 0xFF
        data = bytes(buf)
    raw = broadcast_bytes(data, None, src=0, timeout=30)
    try:
        decode_samples(raw)
        result["corrupt"] = "decoded"
    except SampleWireError as e:
        result["corrupt"] = str(e)
    # 3b. payloads around the inline head (one broadcast up to INLINE_BYTES, a second for the rest): same bytes
    sizes = [0, 1, INLINE_BYTES - 1, INLINE_BYTES, INLINE_BYTES + 1, 3 * INLINE_BYTES + 7]
    payloads = [bytes((i * 31 + n) % 256 for i in range(n)) for n in sizes]
    result["sizes_equal"] = [broadcast_bytes(p if a.rank == 0 else None, None, src=0, timeout=30) == p for p in payloads]
    # 4. the source never sends: receivers time out (bounded), with a message naming the group
    dist.barrier()
    if a.rank != 0:
        t0 = time.monotonic()
        try:
            broadcast_bytes(None, None, src=0, timeout=1.5)
            result["timeout"] = "returned"
        except TimeoutError as e:
            result["timeout"] = str(e)
        result["timeout_s"] = time.monotonic() - t0
    else:
        time.sleep(3)  # alive but silent, so the receivers see a timeout rather than a closed socket
    with open(a.out, "w") as f:
        json.dump(result, f, ensure_ascii=False)
    sys.stdout.flush()
    os._exit(0)  # the group is unusable after the deliberate timeout


if __name__ == "__main__":
    main()
