"""Liveness counters name the rank that went silent after a collective timed out (real c10d TCPStore)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from miles.run.liveness import Liveness, name_silent_ranks
from miles.spmd.errors import CollectiveTimeoutError


def test_silent_rank_is_named(free_port):
    store = dist.TCPStore("127.0.0.1", free_port, 1, is_master=True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    beats = [Liveness(store, r, 3, period_s=0.05) for r in range(3)]
    for b in beats[:2]:  # rank 2 never beats: stopped
        b._thread.start()
    try:
        assert beats[0].silent_ranks() == [2]
        err = name_silent_ranks(CollectiveTimeoutError("collective on group 'trainer' timed out."), beats[0])
        assert isinstance(err, CollectiveTimeoutError) and "rank 2 stopped responding" in str(err)
        assert "trainer" in str(name_silent_ranks(TimeoutError("broadcast over group 'trainer'"), beats[0]))
        gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv")
        assert "rank 2 stopped responding" in str(name_silent_ranks(gloo, beats[0]))
        other = RuntimeError("HTTP request timed out")  # not a collective: unchanged
        assert name_silent_ranks(other, beats[0]) is other
        beats[2]._thread.start()
        assert "every other rank is alive" in str(name_silent_ranks(CollectiveTimeoutError("x"), beats[0]))
    finally:
        for b in beats:
            b.close()
