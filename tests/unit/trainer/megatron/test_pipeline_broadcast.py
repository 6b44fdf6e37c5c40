"""``pipeline.broadcast_object_from_last`` over a real 2-rank gloo group (a two-stage pipeline): the last
stage's object reaches the first, and a last stage that never joins stops the first after the stage's
timeout (not the process group's) with the pipeline's one-line TimeoutError."""

from __future__ import annotations

import pytest
import torch
from trainer_harness import gloo_rank, put_timed

STAGE_TIMEOUT = 2.0


def _worker(rank: int, port: int, scenario: str, q) -> None:
    with gloo_rank(rank, port, q):
        from miles.trainer.megatron.pipeline import Stage, broadcast_object_from_last

        stage = Stage(group=None, rank=rank, size=2, prev=0, next=1, first_rank=0, last_rank=1, timeout=STAGE_TIMEOUT)
        obj = (["kl", "loss"], torch.tensor([0.25, -1.5], dtype=torch.float64)) if rank == 1 else None

        def broadcast():
            got = broadcast_object_from_last(stage, obj, torch.device("cpu"))
            return got[0], got[1].tolist()

        # "silent_last": the last stage alive, never broadcasting: the first stage must time out
        put_timed(q, rank, broadcast, silent_for=4 * STAGE_TIMEOUT if scenario == "silent_last" and rank == 1 else 0.0)


@pytest.mark.multiprocess
def test_object_from_the_last_stage_reaches_every_stage(two_ranks) -> None:
    out = two_ranks(_worker, "both")
    expect = (["kl", "loss"], [0.25, -1.5])
    assert out[0][0] == expect and out[1][0] == expect, out


@pytest.mark.multiprocess
def test_a_silent_last_stage_stops_the_first_after_the_stage_timeout(two_ranks) -> None:
    out = two_ranks(_worker, "silent_last")
    message, seconds = out[0]
    assert message.startswith("TimeoutError: pipeline stage 0 of 2: broadcasting the last stage's results"), out
    assert "\n" not in message
    assert 0.8 * STAGE_TIMEOUT < seconds < 2 * STAGE_TIMEOUT, out
