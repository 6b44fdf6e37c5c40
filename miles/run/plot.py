"""A PNG of a run: mean reward (and evaluation reward) per rollout above the phase timings.

    plot_metrics(records, "outputs/run/metrics.png")      # records as in metrics.jsonl

Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

TIMING_KEYS = (("perf/rollout_time", "generate"), ("perf/train_time", "train"),
               ("perf/update_weights_time", "weight sync"), ("perf/step_time", "step"))


def _series(records: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if v is not None and math.isfinite(v) and "rollout_id" in r:
            xs.append(r["rollout_id"])
            ys.append(v)
    return xs, ys


def plot_metrics(records: list[dict[str, float]], path: str | os.PathLike, title: str = "miles") -> Path:
    """Write the plot and return its path; raises ValueError when no record has a rollout_id."""
    if not any("rollout_id" in r for r in records):
        raise ValueError("plot_metrics: no record has a rollout_id")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    xs, ys = _series(records, "rollout/raw_reward")
    ax_r.plot(xs, ys, marker="o", ms=3, label="reward (rollout mean)")
    for key in sorted({k for r in records for k in r if k.startswith("eval/") and k.count("/") == 1}):
        ex, ey = _series(records, key)
        ax_r.plot(ex, ey, marker="s", ms=4, ls="--", label=key)
    ax_r.set_ylabel("reward")
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="lower right", fontsize=8)
    ax_r.set_title(title)
    for key, label in TIMING_KEYS:
        tx, ty = _series(records, key)
        if tx:
            ax_t.plot(tx, ty, marker=".", label=label)
    ax_t.set_xlabel("rollout")
    ax_t.set_ylabel("seconds")
    ax_t.grid(alpha=0.3)
    ax_t.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
