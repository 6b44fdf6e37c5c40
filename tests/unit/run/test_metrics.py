"""The metrics sink: metrics.jsonl records, TensorBoard events, W&B offline, the summary line, the null sink."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from miles.config import parse_args
from miles.run.metrics import (
    OTHER_KEY,
    REQUIRED_KEYS,
    STEP_PHASES,
    MetricsSink,
    NullSink,
    add_residuals,
    build_sink,
    default_output_dir,
    phase_breakdown,
    read_metrics,
    reward_windows,
    run_summary_line,
    summary_line,
)


def _output(*extra: str):
    return parse_args(["--num-rollout", "2", "--rollout-batch-size", "1", *extra]).output


def _record(i: int) -> dict:
    return {"rollout/raw_reward": 0.1 * i, "rollout/response_len": 2.0, "perf/rollout_time": 1.0, "perf/train_time": 0.5,
            "perf/update_weights_time": 0.1, "perf/step_time": 1.7, "train/kl_loss": 0.01}


def test_jsonl_tensorboard_and_plot(tmp_path: Path, caplog):
    sink = MetricsSink(_output("--use-tensorboard"), tmp_path, num_rollout=3)
    with caplog.at_level("INFO", logger="miles"):
        for i in range(3):
            sink.log(i, {**_record(i), "eval/quickstart": float("nan"), "not_a_number": "x"})
    sink.close()
    sink.close()  # idempotent
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["eval/quickstart"] is None  # NaN is not JSON: null
        assert "not_a_number" not in r
    assert recs[2]["rollout/raw_reward"] == pytest.approx(0.2)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout ")]
    assert lines[1].startswith("rollout 1/3 | reward 0.100 | resp_len 2.0 | kl 0.0100")


def test_tensorboard_scalars_readable(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(_output("--use-tensorboard"), tmp_path)
    for i in range(2):
        sink.log(i, _record(i))
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("rollout/raw_reward")] == pytest.approx([0.0, 0.1])


def test_no_tensorboard_flag(tmp_path: Path):
    sink = MetricsSink(_output("--no-tensorboard"), tmp_path)
    sink.log(0, _record(0))
    sink.close()
    assert not (tmp_path / "tensorboard").exists()


def test_resume_appends(tmp_path: Path):
    sink = MetricsSink(_output(), tmp_path)
    sink.log(0, _record(0))
    sink.close()
    again = MetricsSink(_output(), tmp_path, start_rollout_id=1)
    again.log(1, _record(1))
    again.close()
    assert [r["rollout_id"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.0, 1.0]
    assert not (tmp_path / "metrics.superseded.jsonl").exists()


def test_resume_moves_records_written_after_the_checkpoint(tmp_path: Path):
    """--save-interval 3, killed during rollout 5: the checkpoint holds rollout 2, records 3-4 are redone."""
    first = MetricsSink(_output(), tmp_path)
    for i in range(5):
        first.log(i, _record(i))
    first._file.write('{"rollout_id": 5, "rollo')  # the crash tore the last line
    first._file.close()
    old_lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    again = MetricsSink(_output(), tmp_path, start_rollout_id=3)
    assert [r["rollout_id"] for r in again.records] == [0.0, 1.0, 2.0]
    for i in range(3, 6):
        again.log(i, _record(i + 10))
    again.close()
    assert [r["rollout_id"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert (tmp_path / "metrics.superseded.jsonl").read_text().splitlines() == old_lines[3:5]  # line for line
    # a relaunch before any checkpoint starts at 0: every earlier record is superseded, none is dropped
    third = MetricsSink(_output(), tmp_path, start_rollout_id=0)
    third.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    assert len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 2 + 6


def test_resume_restores_the_record_a_checkpoint_kept(tmp_path: Path, caplog):
    """Killed after rollout 1's checkpoint but before its record was written: the checkpoint's copy of the
    record (RLLoop.maybe_save) comes back on resume, once, and a record already there is not doubled."""
    first = MetricsSink(_output(), tmp_path)
    first.log(0, _record(0))
    first.close()
    kept = {**_record(1), "rollout_id": 1.0}
    again = MetricsSink(_output(), tmp_path, start_rollout_id=2, restore=kept)
    again.log(2, _record(2))
    again.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout_id"] for r in recs] == [0.0, 1.0, 2.0]
    assert recs[1]["restored_from_checkpoint"] == 1 and recs[1]["rollout/raw_reward"] == kept["rollout/raw_reward"]
    assert "restored the one the checkpoint kept" in caplog.text
    third = MetricsSink(_output(), tmp_path, start_rollout_id=3, restore={**_record(2), "rollout_id": 2.0})
    third.close()
    assert [r["rollout_id"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.0, 1.0, 2.0]
    # resumed into a new output directory: a new file, the checkpoint's record is not carried over
    fresh = MetricsSink(_output(), tmp_path / "new", start_rollout_id=3, restore={**_record(2), "rollout_id": 2.0})
    fresh.close()
    assert read_metrics(tmp_path / "new" / "metrics.jsonl") == []


def test_loop_checkpoints_carry_the_rollout_record():
    """The driver's checkpoint extra holds the rollout's record so far, as plain floats."""
    from miles.run.build import _restorable_record

    extra = {"rollout_id": 4, "metrics_record": {"rollout/raw_reward": 0.5, "perf/train_time": 0.1}}
    assert _restorable_record(extra) == {"rollout/raw_reward": 0.5, "perf/train_time": 0.1, "rollout_id": 4.0}
    assert _restorable_record({"rollout_id": 4}) is None and _restorable_record(None) is None


def test_resume_refuses_a_file_that_is_not_metrics(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text('{"rollout_id": 0}\n["not", "a record"]\n{"rollout_id": 1}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a metrics record"):
        MetricsSink(_output(), tmp_path, start_rollout_id=1)


def test_read_metrics_skips_torn_last_line(tmp_path: Path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"rollout_id": 0, "rollout/raw_reward": null}\n{"rollout_id": 1, "rollo')
    recs = read_metrics(p)
    assert len(recs) == 1 and math.isnan(recs[0]["rollout/raw_reward"])
    p.write_text('{"rollout_id": 0}\nnot json\n{"rollout_id": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(p)


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``): a 7-byte ``:W&B`` header, then
    LevelDB-log framing (32 KiB blocks; each chunk: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def test_wandb_offline_logs_every_finite_metric_per_rollout(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(_output("--use-wandb", "--wandb-project", "miles-test"), tmp_path, config={"a": 1})
    for i in range(2):
        sink.log(i, {**_record(i), "eval/quickstart": float("nan")})
    sink.close()
    [run_file] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _wandb_records(run_file)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert sorted(history) == [0, 1], history  # one W&B step per rollout, at the rollout id
    for i in range(2):
        assert history[i] == pytest.approx({**_record(i), "rollout_id": i}), history[i]  # NaN eval not sent
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {c.key: json.loads(c.value_json) for c in run.config.update}
    assert config["a"] == 1, config
    assert run.project == "miles-test"


def test_null_sink_and_build(tmp_path: Path):
    assert isinstance(build_sink(_output(), tmp_path, enabled=False), NullSink)
    NullSink().log(0, {"x": 1.0})
    NullSink().close()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert isinstance(build_sink(_output(), tmp_path, enabled=True), MetricsSink)


def test_default_output_dir():
    import time

    now = time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    assert default_output_dir(_output("--run-name", "demo"), now=now) == Path("outputs/demo-20260102-030405")
    assert default_output_dir(_output("--output-dir", "/x/y")) == Path("/x/y")


def test_summary_line_missing_values():
    line = summary_line(4, {"rollout/raw_reward": float("nan")})
    assert line.startswith("rollout 4 | reward - | resp_len - | kl -")


def test_residuals_make_the_phases_add_up():
    m = {"perf/rollout_time": 1.0, "perf/train_time": 0.5, "perf/update_weights_time": 0.2, "perf/step_time": 1.9,
         "perf/train/fwd_bwd_time": 0.3, "perf/train/optimizer_time": 0.1, "perf/train/fwd_bwd_time_max": 0.45,
         "weight_sync/control_s": 0.15}
    add_residuals(m)
    assert m[OTHER_KEY] == pytest.approx(0.2)
    assert sum(m.get(k, 0.0) for k in STEP_PHASES) + m[OTHER_KEY] == pytest.approx(m["perf/step_time"])
    assert m["perf/train/other_time"] == pytest.approx(0.1)         # the slowest rank's time is not a part
    assert m["perf/update_weights/other_time"] == pytest.approx(0.05)
    rows = phase_breakdown(m)
    assert [k for k, _, d in rows if d == 0] == ["perf/rollout_time", "perf/train_time", "perf/update_weights_time",
                                                  OTHER_KEY]
    assert [k for k, _, d in rows if d == 1][:3] == ["perf/train/fwd_bwd_time", "perf/train/optimizer_time",
                                                     "perf/train/other_time"]
    no_parts = add_residuals({"perf/train_time": 0.5, "perf/step_time": 0.5})
    assert no_parts[OTHER_KEY] == 0.0 and "perf/train/other_time" not in no_parts


def test_reward_windows_first_and_best():
    rewards = [0.1, 0.2, 0.3, 0.9, 0.8, 0.4]
    recs = [{"rollout_id": float(i), "rollout/raw_reward": r, "perf/step_time": 0.5} for i, r in enumerate(rewards)]
    recs.insert(0, {"rollout_id": -1.0, "eval/x": 0.1})                 # an eval point before training: skipped
    w = reward_windows(recs, 2)
    assert w["first"] == pytest.approx(0.15) and w["first_time"] == pytest.approx(1.0) and w["first_end"] == 1
    assert w["best"] == pytest.approx(0.85) and w["best_time"] == pytest.approx(2.5) and w["best_end"] == 4
    assert reward_windows(recs, 7) is None
    line = run_summary_line(recs, window=2)
    assert line == ("6 rollouts, 3.0s of training (0.500s/step) | reward over 2 rollouts: first 0.150 (rollouts 0-1, "
                    "at 1.0s), best 0.850 (rollouts 3-4, at 2.5s)")


def test_close_logs_the_run_summary(tmp_path: Path, caplog):
    sink = MetricsSink(_output(), tmp_path, num_rollout=8)
    for i in range(8):
        sink.log(i, {**_record(i), "perf/step_time": 0.25})
    with caplog.at_level("INFO", logger="miles"):
        sink.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary:")]
    # a quarter of the run: windows of 2; the reward rises, so the best window is the last one
    assert lines == ["run summary: 8 rollouts, 2.0s of training (0.250s/step) | reward over 2 rollouts: first 0.050 "
                     "(rollouts 0-1, at 0.5s), best 0.650 (rollouts 6-7, at 2.0s)"], lines
