"""One metrics sink per run (driver rank): a summary line, metrics.jsonl, TensorBoard, W&B, and a plot.

    sink = build_sink(cfg.output, out_dir, config=cfg.to_dict(), enabled=ctx.is_driver)
    sink.log(rollout_id, {"rollout/raw_reward": 0.5, "perf/rollout_time": 1.2, ...})
    sink.close()        # writes metrics.png, closes TensorBoard / W&B

Every ``log`` call writes one JSON object per rollout to ``<out_dir>/metrics.jsonl`` (keys sorted, with
``rollout_id``), the same scalars to TensorBoard (``<out_dir>/tensorboard``, with --use-tensorboard) and
to W&B (with --use-wandb; ``WANDB_MODE=offline`` works, the import is lazy and names the ``wandb``
extra), and logs one summary line: reward, response length, KL, timings. Ranks other than the driver
get :class:`NullSink`, which does nothing.
"""

from __future__ import annotations

import json
import math
import os
import random
import string
import time
from pathlib import Path
from typing import Any

from miles.config.logging import OutputConfig
from miles.utils.logging import get_logger
from miles.utils.optional import require

logger = get_logger(__name__)

# Keys every rollout's record carries (perf/* of phases that did not run are 0.0).
REQUIRED_KEYS = ("rollout_id", "rollout/raw_reward", "rollout/response_len", "perf/rollout_time",
                 "perf/train_time", "perf/update_weights_time", "perf/step_time")
METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"  # records of rollouts redone after a resume (see supersede_after_checkpoint)
PLOT_FILE = "metrics.png"

# The phases of one step of train.py, disjoint and in the order they run, timed on the driver's clock;
# ``perf/other_time`` is what none of them covers, so together they add up to ``perf/step_time`` exactly.
STEP_PHASES = ("perf/health_time", "perf/rollout_time", "perf/score_time", "perf/train_time", "perf/save_time",
               "perf/update_weights_time", "perf/eval_time")
OTHER_KEY = "perf/other_time"
# The parts of a phase, each with its own residual. train: the driver's scatter of the samples, then the
# trainer's phases (trainer rank 0's seconds; ``<part>_max`` is the slowest rank's). update_weights: the
# weight sender's gather, transfer, engine load and HTTP control calls.
PHASE_PARTS = {
    "perf/train_time": (tuple(f"perf/train/{p}_time" for p in ("scatter", "data", "logprobs", "advantages",
                                                              "fwd_bwd", "optimizer", "metrics")),
                        "perf/train/other_time"),
    "perf/update_weights_time": (("weight_sync/gather_s", "weight_sync/transfer_s", "weight_sync/load_s",
                                  "weight_sync/control_s"), "perf/update_weights/other_time"),
}


def add_residuals(metrics: dict[str, float], phases: tuple[str, ...] = STEP_PHASES) -> dict[str, float]:
    """Sets ``perf/other_time`` (``perf/step_time`` minus the phases present) and each phase's own residual
    (the phase minus its parts present, when it has any); returns ``metrics``."""
    if "perf/step_time" in metrics:
        metrics[OTHER_KEY] = metrics["perf/step_time"] - sum(metrics.get(k, 0.0) for k in phases)
    for phase, (parts, residual) in PHASE_PARTS.items():
        present = [k for k in parts if k in metrics]
        if phase in metrics and present:
            metrics[residual] = metrics[phase] - sum(metrics[k] for k in present)
    return metrics


def phase_breakdown(record: dict[str, float]) -> list[tuple[str, float, int]]:
    """(key, seconds, depth) of a record's step: each phase (depth 0) followed by its parts (depth 1)."""
    rows: list[tuple[str, float, int]] = []
    for phase in STEP_PHASES + (OTHER_KEY,):
        if phase not in record:
            continue
        rows.append((phase, record[phase], 0))
        parts, residual = PHASE_PARTS.get(phase, ((), None))
        rows += [(k, record[k], 1) for k in parts + ((residual,) if residual else ()) if k in record]
    return rows


def reward_windows(records: list[dict[str, float]], window: int) -> dict[str, float] | None:
    """Mean reward over ``window`` consecutive rollouts: the first window and the best one, each with the
    training time (sum of ``perf/step_time``, start-up excluded) at which it was complete. None when fewer
    than ``window`` rollouts have a reward."""
    rows = [(r.get("rollout/raw_reward"), r.get("perf/step_time", 0.0), r.get("rollout_id"))
            for r in records if "rollout_id" in r and r.get("perf/step_time") is not None]
    rows = [(v, t, rid) for v, t, rid in rows if v is not None and math.isfinite(v)]
    if window < 1 or len(rows) < window:
        return None
    elapsed, means = 0.0, []
    for i, (_, t, _) in enumerate(rows):
        elapsed += t if math.isfinite(t) else 0.0
        if i + 1 >= window:
            means.append((sum(v for v, _, _ in rows[i + 1 - window:i + 1]) / window, elapsed, rows[i][2]))
    best = max(range(len(means)), key=lambda i: (means[i][0], -i))
    return {"window": float(window), "first": means[0][0], "first_time": means[0][1], "first_end": means[0][2],
            "best": means[best][0], "best_time": means[best][1], "best_end": means[best][2],
            "train_time": elapsed, "rollouts": float(len(rows))}


def run_summary_line(records: list[dict[str, float]], window: int | None = None) -> str | None:
    """``40 rollouts, 9.8s of training (0.25s/step) | reward over 10 rollouts: first 0.412 (rollouts 0-9, at
    2.5s), best 0.731 (rollouts 28-37, at 9.3s)``; ``window`` defaults to a quarter of the run (1 to 10)."""
    w = window or max(1, min(10, len([r for r in records if "rollout_id" in r]) // 4))
    s = reward_windows(records, w)
    if s is None:
        return None
    n, w = int(s["rollouts"]), int(s["window"])

    def span(end: float) -> str:
        return f"rollout {int(end)}" if w == 1 else f"rollouts {int(end) - w + 1}-{int(end)}"

    return (f"{n} rollouts, {s['train_time']:.1f}s of training ({s['train_time'] / max(n, 1):.3f}s/step) | reward "
            f"over {w} rollout{'s' if w > 1 else ''}: first {s['first']:.3f} ({span(s['first_end'])}, at "
            f"{s['first_time']:.1f}s), best {s['best']:.3f} ({span(s['best_end'])}, at {s['best_time']:.1f}s)")


def default_output_dir(output: OutputConfig, now: float | None = None) -> Path:
    """``--output-dir``, else ``outputs/<run-name>-<YYYYmmdd-HHMMSS>``."""
    if output.output_dir:
        return Path(output.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("outputs") / f"{output.run_name}-{stamp}"


def wandb_run_name(output: OutputConfig, rng: random.Random | None = None) -> str:
    """--run-name, plus ``_`` and 6 random characters unless --disable-wandb-random-suffix (as Miles)."""
    if not output.wandb_random_suffix:
        return output.run_name
    rng = rng or random.Random()
    return output.run_name + "_" + "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(6))


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    if hasattr(v, "item"):  # 0-d tensors / numpy scalars
        try:
            return float(v.item())
        except (TypeError, ValueError):
            return None
    return None


def _json_value(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no NaN/inf: null


def _fmt(metrics: dict[str, float], key: str, spec: str = ".3f") -> str:
    v = metrics.get(key)
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


def is_eval_headline(key: str) -> bool:
    """``eval/<name>`` (a dataset's mean reward, or a top-level eval metric), not Miles's ``eval/<name>-<ratio>``."""
    return key.startswith("eval/") and key.count("/") == 1 and not key.endswith(("-none_reward_ratio",
                                                                                 "-truncated_ratio"))


def summary_line(rollout_id: int, metrics: dict[str, float], num_rollout: int | None = None) -> str:
    """``rollout 3/30 | reward 0.512 | resp_len 2.0 | kl 0.0000 | gen 1.2s train 0.4s sync 0.1s step 1.9s``."""
    of = f"/{num_rollout}" if num_rollout else ""
    kl = next((k for k in ("train/kl_loss", "train/reward_kl", "train/ppo_kl") if k in metrics), None)
    parts = [f"rollout {rollout_id}{of}", f"reward {_fmt(metrics, 'rollout/raw_reward')}",
             f"resp_len {_fmt(metrics, 'rollout/response_len', '.1f')}",
             f"kl {_fmt(metrics, kl, '.4f') if kl else '-'}"]
    if "train/loss" in metrics:
        parts.append(f"loss {_fmt(metrics, 'train/loss', '.4f')}")
    evals = [k for k in metrics if is_eval_headline(k)]
    parts += [f"{k} {_fmt(metrics, k)}" for k in sorted(evals)]
    parts.append(f"gen {_fmt(metrics, 'perf/rollout_time', '.2f')}s train {_fmt(metrics, 'perf/train_time', '.2f')}s "
                 f"sync {_fmt(metrics, 'perf/update_weights_time', '.2f')}s step {_fmt(metrics, 'perf/step_time', '.2f')}s")
    return " | ".join(parts)


class NullSink:
    """The sink of ranks that do not report (every method is a no-op)."""

    out_dir: Path | None = None
    records: list[dict[str, float]] = []

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        pass

    def log_eval(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsSink:
    """The driver's sink; see the module docstring."""

    def __init__(self, output: OutputConfig, out_dir: str | os.PathLike, *, config: dict[str, Any] | None = None,
                 num_rollout: int | None = None, start_rollout_id: int = 0,
                 restore: dict[str, float] | None = None) -> None:
        self.output = output
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.num_rollout = num_rollout
        self.records: list[dict[str, float]] = []
        self.path = self.out_dir / METRICS_FILE
        continued = self.path.exists()
        if continued:  # a resumed run (or a relaunch before the first checkpoint): keep what is current
            self.records = supersede_after_checkpoint(self.path, start_rollout_id)
        self._file = self.path.open("a")
        if restore and continued:  # (a resume into a new --output-dir starts a new file)
            self._restore(restore)
        self._tb = None
        if output.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        self._wandb = None
        if output.use_wandb:
            wandb = require("wandb", "--use-wandb")
            if output.wandb_key or output.wandb_host:
                wandb.login(key=output.wandb_key, host=output.wandb_host, relogin=bool(output.wandb_key))
            self._wandb = wandb.init(project=output.wandb_project, entity=output.wandb_team, group=output.wandb_group,
                                     name=wandb_run_name(output), dir=str(self.out_dir), config=config or {}, reinit=True)
        self._closed = False

    def _restore(self, record: dict[str, float]) -> None:
        """The checkpointed rollout's record as the checkpoint kept it, when the run was killed after the save
        but before the full record was written (it lacks that rollout's weight-sync and eval metrics)."""
        rid = int(record.get("rollout_id", -1))
        if rid < 0 or any(int(r.get("rollout_id", -1)) == rid for r in self.records):
            return
        rec = {k: (int(v) if k == "rollout_id" else _json_value(v)) for k, v in sorted(record.items())}
        rec["restored_from_checkpoint"] = 1
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        self.records.append(_as_floats(rec))
        logger.warning("%s had no record of rollout %d, whose checkpoint this run resumes: restored the one the "
                       "checkpoint kept (without that rollout's weight-sync and eval metrics)", self.path, rid)

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """Record one rollout (or one evaluation) and print its summary line."""
        scalars = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
        scalars["rollout_id"] = float(rollout_id)
        record = {k: (int(v) if k == "rollout_id" else _json_value(v)) for k, v in sorted(scalars.items())}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.records.append(scalars)
        for k, v in scalars.items():
            if k != "rollout_id" and math.isfinite(v):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, rollout_id)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=rollout_id)
        logger.info("%s", summary_line(rollout_id, scalars, self.num_rollout))

    def log_eval(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """Evaluation before training (no rollout record): TensorBoard/W&B and a log line only."""
        scalars = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None and math.isfinite(v)}
        if scalars:  # plotted as the point before the first rollout (not a metrics.jsonl record)
            self.records.append({**scalars, "rollout_id": float(rollout_id - 1)})
        for k, v in scalars.items():
            if self._tb is not None:
                self._tb.add_scalar(k, v, rollout_id)
        if self._wandb is not None:
            self._wandb.log(scalars, step=rollout_id)
        logger.info("eval before rollout %d: %s", rollout_id,
                    ", ".join(f"{k} {v:.3f}" for k, v in sorted(scalars.items()) if is_eval_headline(k)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        line = run_summary_line(self.records)
        if line is not None:
            logger.info("run summary: %s", line)
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self.records:
            from miles.run.plot import plot_metrics

            try:
                png = plot_metrics(self.records, self.out_dir / PLOT_FILE, title=self.output.run_name)
                logger.info("wrote %s and %s", self.path, png)
            except (OSError, ValueError) as e:
                logger.warning("could not write the metrics plot: %s", e)


def _records(path: str | os.PathLike) -> list[tuple[int, str, Any]]:
    """(line number, raw line, parsed JSON) of each non-blank line; a torn last line (a crash mid-write)
    is skipped with a warning, any other line that is not JSON is an error naming it."""
    out = []
    lines = Path(path).read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append((i + 1, line, json.loads(line)))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                logger.warning("%s: ignoring a torn last line", path)
                continue
            raise ValueError(f"{path}:{i + 1}: not JSON ({e.msg})") from e
    return out


def _as_floats(rec: dict[str, Any]) -> dict[str, float]:
    return {k: (float("nan") if v is None else float(v)) for k, v in rec.items()}


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """The records of a metrics.jsonl (nulls become NaN); a torn last line (a crash mid-write) is skipped."""
    return [_as_floats(rec) for _, _, rec in _records(path)]


def supersede_after_checkpoint(path: Path, resume_at: int) -> list[dict[str, float]]:
    """A run that starts at rollout ``resume_at`` (the checkpoint's next rollout; 0 without one) continues
    an existing ``metrics.jsonl``.

    Records of rollouts at or after it were written by an interrupted run after its last checkpoint (with
    ``--save-interval`` N > 1, up to N - 1 of them), or by an earlier run in the same ``--output-dir``; this
    run redoes those rollouts. They move, line for line, to ``metrics.superseded.jsonl`` (appended, so
    nothing is lost over several restarts) and ``metrics.jsonl`` is rewritten atomically without them, so
    it holds each rollout id once, in order. Returns the records kept."""
    keep: list[str] = []
    kept: list[dict[str, float]] = []
    moved: list[str] = []
    for lineno, line, rec in _records(path):
        try:
            rid = int(rec["rollout_id"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{lineno}: not a metrics record; move the file away to start a fresh one") from None
        if rid < resume_at:
            keep.append(line)
            kept.append(_as_floats(rec))
        else:
            moved.append(line)
    if moved:
        with (path.parent / SUPERSEDED_FILE).open("a") as f:
            f.write("".join(line + "\n" for line in moved))
        logger.warning("%s held %d record(s) of rollouts at or after %d, written after the last checkpoint; those "
                       "rollouts are redone, their old records moved to %s", path, len(moved), resume_at,
                       SUPERSEDED_FILE)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return kept


def build_sink(output: OutputConfig, out_dir: Path | None, *, enabled: bool, config: dict[str, Any] | None = None,
               num_rollout: int | None = None, start_rollout_id: int = 0,
               restore: dict[str, float] | None = None) -> MetricsSink | NullSink:
    """``start_rollout_id``: this run's first rollout (> 0 when resumed from a checkpoint); ``restore``: the
    checkpoint's record of its rollout (``MetricsSink._restore``)."""
    if not enabled or out_dir is None:
        return NullSink()
    return MetricsSink(output, out_dir, config=config, num_rollout=num_rollout, start_rollout_id=start_rollout_id,
                       restore=restore)
