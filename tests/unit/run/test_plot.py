"""The end-of-run plot: a real PNG from records, with evaluation series, and a clear error with no data."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.run.plot import plot_metrics


def test_plot_writes_png(tmp_path: Path):
    records = [{"rollout_id": float(i), "rollout/raw_reward": i / 10, "perf/rollout_time": 1.0, "perf/train_time": 0.5,
                "perf/update_weights_time": 0.1, "perf/step_time": 1.6, **({"eval/q": 0.5} if i % 2 else {})}
               for i in range(5)]
    out = plot_metrics(records, tmp_path / "sub" / "m.png", title="t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_without_rollouts(tmp_path: Path):
    with pytest.raises(ValueError, match="rollout_id"):
        plot_metrics([{"perf/step_time": 1.0}], tmp_path / "m.png")
