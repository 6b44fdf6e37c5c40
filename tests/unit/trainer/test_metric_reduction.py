"""The end of ``train``: this rank's metric sums, the phase times and the token counts travel in one all-gather;
the group sums are the ranks' values summed in rank order. Checked here against the reductions they replace
(``MetricSums.reduce``'s all-reduce per optimizer step, a group sum for the extra metrics): on rows of several
ranks the means are the same numbers. Two ranks against one: tests/multiprocess/test_fsdp.py."""

from __future__ import annotations

import random

import pytest
import torch

from miles.trainer.metrics import MetricSums, extra_metrics, step_means


def test_step_means_and_extra_metrics_from_gathered_rows_equal_the_per_step_reductions() -> None:
    rng = random.Random(0)
    keys, world, steps = ["a", "b", "pg_loss"], 3, 2
    ranks = []                                          # per rank: one MetricSums per optimizer step
    for r in range(world):
        per_step = []
        for _ in range(steps):
            m = MetricSums()
            m.add({k: torch.tensor(rng.uniform(-2, 2)) for k in keys if not (r == 1 and k == "b")})  # a missing key
            per_step.append(m)
        ranks.append(per_step)
    rows = [[v for s in per_step for v in s.values(keys)] for per_step in ranks]
    tot = [sum(r[j] for r in rows) for j in range(len(rows[0]))]
    got = step_means(keys, tot, steps)
    # the old path: per step, each key summed over ranks (what the all-reduce computes), then the mean over steps
    ref = {k: sum(sum(float(ranks[r][j].sums[k]) if k in ranks[r][j].sums else 0.0 for r in range(world))
                  for j in range(steps)) / steps for k in keys}
    assert got.keys() == ref.keys()
    for k in keys:
        assert got[k] == pytest.approx(ref[k], rel=1e-15, abs=1e-15)
    # extra metrics: token means and the reward mean from the summed [token sum, mask sum, ..., reward sum, samples]
    extra = extra_metrics(["advantages", "kl"], [3.0, 6.0, -1.0, 0.0, 5.0, 8.0], samples=[object()])
    assert extra == {"advantages_mean": 0.5, "kl_mean": -1.0, "reward_mean": 5.0 / 8.0}
    assert "reward_mean" not in extra_metrics(["kl"], [1.0, 2.0, 0.0, 0.0], samples=None)
