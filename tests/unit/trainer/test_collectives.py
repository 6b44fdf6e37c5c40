"""``collectives.bounded_all_gather_object`` over a real 2-rank gloo group: every rank's object (of different
pickled sizes) reaches every rank in rank order, and a rank that never joins stops the other after the
helper's timeout (not the process group's) with one line, a TimeoutError."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

TIMEOUT = 2.0


def _worker(rank: int, port: int, scenario: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    from miles.trainer.collectives import bounded_all_gather_object

    obj = {"rank": rank, "payload": list(range(3 + 100 * rank)), "t": torch.tensor([rank + 0.5])}
    try:
        if scenario == "silent" and rank == 1:
            time.sleep(4 * TIMEOUT)                 # alive, never gathering: rank 0 must time out
            q.put((rank, "slept", 0.0))
        else:
            start = time.monotonic()
            try:
                got = bounded_all_gather_object(obj, None, TIMEOUT, torch.device("cpu"), "gathering test objects")
                q.put((rank, [(g["rank"], len(g["payload"]), float(g["t"])) for g in got], time.monotonic() - start))
            except Exception as e:  # noqa: BLE001 - reported to the test
                q.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - start))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)                                 # skip process-group teardown (the silent case leaves one open)


@pytest.mark.multiprocess
def test_every_rank_gets_every_object_in_rank_order(two_ranks) -> None:
    out = two_ranks(_worker, "both")
    expect = [(0, 3, 0.5), (1, 103, 1.5)]
    assert out[0][0] == expect and out[1][0] == expect, out


@pytest.mark.multiprocess
def test_a_silent_rank_stops_the_gather_after_the_timeout(two_ranks) -> None:
    out = two_ranks(_worker, "silent")
    message, seconds = out[0]
    assert message.startswith("TimeoutError: gathering test objects over a group of 2 ranks"), out
    assert "\n" not in message
    assert 0.8 * TIMEOUT < seconds < 2 * TIMEOUT, out
