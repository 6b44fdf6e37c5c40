"""``collectives.bounded_all_gather_object`` over a real 2-rank gloo group: every rank's object (of different
pickled sizes) reaches every rank in rank order, and a rank that never joins stops the other after the
helper's timeout (not the process group's) with one line, a TimeoutError. ``bounded_union_of_names`` gives the
union of the object gather with one collective when every rank has the same names, and the union when not."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from trainer_harness import gloo_rank, put_timed

TIMEOUT = 2.0


def _worker(rank: int, port: int, scenario: str, q) -> None:
    with gloo_rank(rank, port, q):
        from miles.trainer.collectives import bounded_all_gather_object

        obj = {"rank": rank, "payload": list(range(3 + 100 * rank)), "t": torch.tensor([rank + 0.5])}

        def gather():
            got = bounded_all_gather_object(obj, None, TIMEOUT, torch.device("cpu"), "gathering test objects")
            return [(g["rank"], len(g["payload"]), float(g["t"])) for g in got]

        # "silent": rank 1 alive, never gathering: rank 0 must time out
        put_timed(q, rank, gather, silent_for=4 * TIMEOUT if scenario == "silent" and rank == 1 else 0.0)


@pytest.mark.multiprocess
def test_every_rank_gets_every_object_in_rank_order(two_ranks) -> None:
    out = two_ranks(_worker, "both")
    expect = [(0, 3, 0.5), (1, 103, 1.5)]
    assert out[0][0] == expect and out[1][0] == expect, out


@pytest.mark.multiprocess
def test_a_silent_rank_stops_the_gather_after_the_timeout(two_ranks) -> None:
    out = two_ranks(_worker, "silent")
    message, seconds = out[0]
    assert message.startswith("TimeoutError: gathering test objects over group 'default' (2 ranks)"), out
    assert "\n" not in message
    assert 0.8 * TIMEOUT < seconds < 2 * TIMEOUT, out


NAMES = {"same": ({"loss", "pg_loss", "entropy"}, {"entropy", "loss", "pg_loss"}),
         "differ": ({"loss", "pg_loss"}, {"loss", "kl_loss"}),
         "one_empty": ({"loss", "pg_loss"}, set()),
         "empty_name": ({"a"}, {"a", ""})}


def _names_worker(rank: int, port: int, scenario: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    from miles.trainer.collectives import bounded_union_of_names

    calls = []
    real = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast")}

    def counting(name):
        def call(*a, **kw):
            calls.append(name)
            return real[name](*a, **kw)
        return call

    for name in real:
        setattr(dist, name, counting(name))
    try:
        got = bounded_union_of_names(NAMES[scenario][rank], None, TIMEOUT, torch.device("cpu"), "gathering names")
        q.put((rank, (got, calls), 0.0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, (f"{type(e).__name__}: {e}", calls), 0.0))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", list(NAMES))
def test_union_of_names_is_one_collective_when_every_rank_agrees(two_ranks, scenario: str) -> None:
    out = two_ranks(_names_worker, scenario)
    union = sorted(NAMES[scenario][0] | NAMES[scenario][1])
    for rank in (0, 1):
        got, calls = out[rank][0]
        assert got == union, out
        # the digest gather; the names' own 2 gathers (sizes, bytes) only when the ranks' names differ
        assert calls == (["all_gather_into_tensor"] if scenario == "same"
                         else ["all_gather_into_tensor", "all_gather", "all_gather"]), (scenario, calls)
