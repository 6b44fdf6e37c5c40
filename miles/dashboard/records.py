"""The on-disk format of ``{dump-details}/dashboard/``, as ``radixark/miles@v0.1.0:miles/dashboard/store.py`` writes it.

    meta.json                       {"run_name", "start_ts", "args", "schema_version": 1}
    metrics.jsonl                   {"ts", "step_key", "step", "metrics"}            (step_key "rollout/step")
    topology.jsonl                  {"ts", "engines": [{"addr", "worker_type", "engine_rank", "gpus", "gpu_uuids"}]}
    data_buffer.jsonl               {"ts", "length"}
    phases/YYYYMMDD_HH.jsonl        {"name", "t0", "t1", "node", "gpus", "rank", "role"}  (keyed by the END hour)
    gpu_util/YYYYMMDD_HH.jsonl      {"ts", "node", "gpu", "util", "mem_mb", "power_w"}
    engine_series/YYYYMMDD_HH.jsonl {"ts", "addr", "metric", "labels", "value"}
    gpu_processes/, trajectories/   (hourly too; not written here)
    lane_catalog.json               {"version": 1, "lanes": {"node:gpu": {"ranks", "engine_addrs", "roles"}}}

Every stream is append-only, one compact JSON object per line (UTC hours). Records are plain dicts built by the
functions below, so the field sets are in one place.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
META_FILE = "meta.json"
CATALOG_FILE = "lane_catalog.json"
SPOOL_DIR = "spool"  # other ranks' records, merged into the streams by the driver's collector (not Miles's)

METRICS, PHASES, TOPOLOGY, GPU_UTIL, ENGINE_SERIES, DATA_BUFFER = (
    "metrics", "phases", "topology", "gpu_util", "engine_series", "data_buffer")
PARTITIONED = frozenset({PHASES, GPU_UTIL, ENGINE_SERIES, "trajectories", "gpu_processes"})
STREAMS = (METRICS, PHASES, TOPOLOGY, GPU_UTIL, ENGINE_SERIES, DATA_BUFFER)

ROLE_TRAIN, ROLE_ROLLOUT_MANAGER = "train", "rollout_manager"
OPEN_T1 = -1.0  # a phase still running when written; its closing event supersedes it
INITIALIZE = "initialize"  # what Miles's reader names [meta.start_ts, a lane's first event); never written

# the loop's phase names (miles.run.loop.PhaseTimer, worker commands) -> the names Miles's timeline colours
PHASE_NAMES = {"rollout": "rollout", "eval": "eval_rollout", "train": "actor_train", "sync_weights": "update_weights",
               "update_weights": "update_weights", "save": "save_model", "offload_train": "sleep",
               "onload_train": "wake_up", "train_wait": "train_wait"}


def meta(run_name: str, start_ts: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"run_name": run_name, "start_ts": float(start_ts), "args": args, "schema_version": SCHEMA_VERSION}


def phase_event(name: str, t0: float, t1: float, *, node: str, gpus: list[int], rank: int, role: str) -> dict[str, Any]:
    return {"name": name, "t0": float(t0), "t1": float(t1), "node": node, "gpus": list(gpus), "rank": int(rank),
            "role": role}


def gpu_sample(ts: float, *, node: str, gpu: int, util: int, mem_mb: int, power_w: int) -> dict[str, Any]:
    return {"ts": float(ts), "node": node, "gpu": int(gpu), "util": int(util), "mem_mb": int(mem_mb),
            "power_w": int(power_w)}


def engine_sample(ts: float, *, addr: str, metric: str, labels: dict[str, str], value: float) -> dict[str, Any]:
    return {"ts": float(ts), "addr": addr, "metric": metric, "labels": dict(labels), "value": float(value)}


def metrics_record(ts: float, step: int | None, metrics: dict[str, Any], step_key: str = "rollout/step") -> dict[str, Any]:
    return {"ts": float(ts), "step_key": step_key, "step": step, "metrics": metrics}


def engine_info(addr: str, engine_rank: int, gpus: list[tuple[str, int]], worker_type: str = "regular") -> dict[str, Any]:
    return {"addr": addr, "worker_type": worker_type, "engine_rank": int(engine_rank),
            "gpus": [[node, int(gpu)] for node, gpu in gpus], "gpu_uuids": [None] * len(gpus)}


def topology(ts: float, engines: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ts": float(ts), "engines": engines}


def hour_key(ts: float) -> str:
    return time.strftime("%Y%m%d_%H", time.gmtime(ts))


def record_ts(stream: str, record: dict[str, Any]) -> float:
    """The timestamp a record is partitioned by: a phase's end (its start while open), else ``ts``."""
    if stream == PHASES:
        return record["t0"] if record["t1"] == OPEN_T1 else record["t1"]
    return record["ts"]


def _lines(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in records).encode()


def append_lines(path: Path, records: list[dict[str, Any]]) -> None:
    """One ``write`` of whole lines to an O_APPEND file: a reader never sees a torn record of ours."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = _lines(records)
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def write_stream(root: Path, stream: str, records: list[dict[str, Any]]) -> None:
    """Append ``records`` of one stream: hourly partition files for the partitioned streams, else one file."""
    if not records:
        return
    if stream not in PARTITIONED:
        append_lines(root / f"{stream}.jsonl", records)
        return
    by_hour: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_hour.setdefault(hour_key(record_ts(stream, r)), []).append(r)
    (root / stream).mkdir(exist_ok=True)
    for key, group in sorted(by_hour.items()):
        append_lines(root / stream / f"{key}.jsonl", group)


def write_json_atomic(path: Path, obj: Any, indent: int | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent, default=str))
    os.replace(tmp, path)


def read_complete_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The records after byte ``offset`` up to the last newline (a line being written is left for later), and
    the new offset. A malformed complete line is skipped."""
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], offset
    out = []
    for line in chunk[:end + 1].splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out, offset + end + 1


def read_stream(root: Path, stream: str) -> list[dict[str, Any]]:
    """Every record of a stream (its flat file and its hourly partitions, oldest first)."""
    files = [root / f"{stream}.jsonl"] if (root / f"{stream}.jsonl").exists() else []
    if (root / stream).is_dir():
        files += sorted((root / stream).glob("*.jsonl"))
    out: list[dict[str, Any]] = []
    for path in files:
        out += read_complete_lines(path, 0)[0]
    return out
