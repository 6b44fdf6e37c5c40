"""--use-miles-dashboard: Miles's flags, the collector's files in Miles v0.1.0's format, and the viewer.

The expected field sets are Miles v0.1.0's readers' (``radixark/miles@v0.1.0:miles/dashboard/store.py``: the ``Record`` dataclasses
``MetricStore.load``/``from_dict`` build from each line, ``Meta``, ``lane_catalog.json`` as ``lane_index`` reads it,
the hourly partition names ``_hour_bounds`` parses), written here as data.
"""

from __future__ import annotations

import calendar
import http.server
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.dashboard import records
from miles.dashboard.collector import Collector
from miles.dashboard.sources import EngineScraper, GpuSampler, parse_prometheus

REPO = Path(__file__).resolve().parents[2]
BASE = ["--num-rollout", "2", "--rollout-batch-size", "4"]

# radixark/miles@v0.1.0:miles/dashboard/args.py add_dashboard_arguments: dest -> default
MILES_DEFAULTS = {"use_miles_dashboard": False, "dashboard_flush_interval": 5.0, "dashboard_gpu_sample_interval": 1.0,
                  "dashboard_sglang_scrape_interval": 2.0, "dashboard_sglang_scrape_mode": "auto",
                  "dashboard_sglang_metrics": None}
# radixark/miles@v0.1.0:miles/dashboard/store.py: the fields each reader's from_dict / Meta(**...) takes
META_KEYS = {"run_name", "start_ts", "args", "schema_version"}
STREAM_KEYS = {
    "metrics": {"ts", "step_key", "step", "metrics"},
    "phases": {"name", "t0", "t1", "node", "gpus", "rank", "role"},
    "topology": {"ts", "engines"},
    "gpu_util": {"ts", "node", "gpu", "util", "mem_mb", "power_w"},
    "engine_series": {"ts", "addr", "metric", "labels", "value"},
}
ENGINE_INFO_KEYS = {"addr", "worker_type", "engine_rank", "gpus", "gpu_uuids"}
PARTITIONED = {"phases", "gpu_util", "engine_series"}  # {stream}/{YYYYMMDD_HH}.jsonl; the others {stream}.jsonl
CATALOG_LANE_KEYS = {"ranks", "engine_addrs", "roles"}


def _cfg(tmp: Path, *extra: str):
    return parse_args(BASE + ["--use-miles-dashboard", "--dump-details", str(tmp / "dump"), *extra]).output.dashboard


def _hour_ts(h: int, m: int = 0, s: float = 0.0) -> float:
    return calendar.timegm((2026, 12, 1, h, m, 0, 0, 0, 0)) + s


# ---------------------------------------------------------------------------------------------------- flags
def test_flags_have_miles_names_and_defaults(tmp_path: Path):
    o = parse_args(BASE).output
    assert {k: getattr(o, k) for k in MILES_DEFAULTS} == MILES_DEFAULTS
    assert o.dashboard is None
    d = _cfg(tmp_path, "--dashboard-flush-interval", "0.5", "--dashboard-gpu-sample-interval", "0.25",
             "--dashboard-sglang-scrape-interval", "3", "--dashboard-sglang-scrape-mode", "router",
             "--dashboard-sglang-metrics", "sglang_num_running_reqs, sglang_gen_throughput")
    assert d.dashboard_dir == f"{tmp_path}/dump/dashboard"
    assert (d.flush_interval, d.gpu_sample_interval, d.scrape_interval, d.scrape_mode) == (0.5, 0.25, 3.0, "router")
    assert d.metrics == ("sglang_num_running_reqs", "sglang_gen_throughput")
    o = parse_args(BASE + ["--use-miles-dashboard", "--dump-details", "x", "--dashboard-sglang-metrics", "a, b"]).output
    assert o.dashboard_sglang_metrics == "a, b"  # kept as given; the parsed list is the section's


@pytest.mark.parametrize("argv, first, mentions", [
    (["--use-miles-dashboard"], "--use-miles-dashboard:", ("--dump-details DIR",)),
    (["--use-miles-dashboard", "--dump-details", "d", "--dashboard-forward-prometheus"],
     "--dashboard-forward-prometheus:", ("--use-prometheus", "drop it")),
    (["--dashboard-flush-interval", "0"], "--dashboard-flush-interval must be a positive", ("got 0.0",)),
    (["--dashboard-gpu-sample-interval", "nan"], "--dashboard-gpu-sample-interval must be a positive", ("nan",)),
    (["--dashboard-sglang-metrics", " , "], "--dashboard-sglang-metrics ' , ' names no metric", ()),
    (["--dashboard-sglang-scrape-mode", "pull"], "train.py: argument --dashboard-sglang-scrape-mode", ("pull",)),
])
def test_bad_dashboard_flags_are_one_line(argv, first, mentions):
    with pytest.raises(ConfigError) as ei:
        parse_args(BASE + argv)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(first), msg
    assert all(m in msg for m in mentions), msg


def test_dashboard_checks_are_validation_not_parsing():
    """Like every section's checks, the dashboard's run in validation: parse_args(validate=False) (tools that only
    read a config) takes the values as given, and nothing is rewritten."""
    o = parse_args(BASE + ["--use-miles-dashboard", "--dashboard-flush-interval", "0"], validate=False).output
    assert o.use_miles_dashboard and o.dashboard_flush_interval == 0.0 and o.dump_details is None


def test_no_dump_details_through_train_py_is_one_line(tmp_path: Path, tiny_model_dir: Path):
    r = subprocess.run([sys.executable, "train.py", "--hf-checkpoint", str(tiny_model_dir), *BASE,
                        "--use-miles-dashboard", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if "--use-miles-dashboard" in ln]
    assert r.returncode == 2 and len(lines) == 1 and "--dump-details" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------------- collector
def _files(root: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for stream in STREAM_KEYS:
        flat = root / f"{stream}.jsonl"
        out[stream] = [flat] if flat.exists() else sorted((root / stream).glob("*.jsonl"))
    return out


def test_collector_writes_miles_format(tmp_path: Path):
    d = _cfg(tmp_path)
    c = Collector(d, rank=0, primary=True, meta=records.meta("run-x", _hour_ts(10), {"colocate": True}))
    c.push(records.PHASES, records.phase_event("actor_train", _hour_ts(10, 59, 58.5), _hour_ts(11, 0, 1), node="node0",
                                               gpus=[3], rank=2, role="train"))
    c.push(records.PHASES, records.phase_event("rollout", _hour_ts(10, 59), records.OPEN_T1, node="node0", gpus=[],
                                               rank=0, role="rollout_manager"))
    c.push(records.GPU_UTIL, records.gpu_sample(_hour_ts(10, 1), node="node0", gpu=3, util=97, mem_mb=1000, power_w=300))
    c.push(records.ENGINE_SERIES, records.engine_sample(_hour_ts(10, 2), addr="http://h:1", metric="sglang_token_usage",
                                                        labels={"dp_rank": "0"}, value=0.5))
    c.push(records.METRICS, records.metrics_record(_hour_ts(10, 3), 0, {"rollout/step": 0, "perf/step_time": 1.5}))
    c.push(records.TOPOLOGY, records.topology(_hour_ts(10), [records.engine_info("http://h:1", 0, [("node0", 4)])]))
    c.flush()
    root = Path(d.dashboard_dir)
    meta = json.loads((root / "meta.json").read_text())
    assert set(meta) == META_KEYS and meta["schema_version"] == 1 and meta["args"] == {"colocate": True}
    files = _files(root)
    for stream, keys in STREAM_KEYS.items():
        assert files[stream], stream
        for path in files[stream]:
            if stream in PARTITIONED:
                assert path.parent.name == stream and re.fullmatch(r"\d{8}_\d{2}", path.stem), path
                time.strptime(path.stem, "%Y%m%d_%H")  # Miles's _hour_bounds parses the name
            else:
                assert path.name == f"{stream}.jsonl"
            raw = path.read_bytes()
            assert raw.endswith(b"\n")
            for line in raw.splitlines():
                rec = json.loads(line)
                assert set(rec) == keys, (stream, rec)
                if stream == "topology":
                    assert all(set(e) == ENGINE_INFO_KEYS for e in rec["engines"])
                    assert rec["engines"][0]["gpus"] == [["node0", 4]]
    # a phase is filed under its END hour, an open one under its start
    assert [p.stem for p in files["phases"]] == ["20261201_10", "20261201_11"]
    assert json.loads((root / "phases" / "20261201_11.jsonl").read_text())["name"] == "actor_train"
    assert json.loads((root / "phases" / "20261201_10.jsonl").read_text())["t1"] == -1.0
    lanes = json.loads((root / "lane_catalog.json").read_text())
    assert lanes["version"] == 1
    assert all(set(v) == CATALOG_LANE_KEYS for v in lanes["lanes"].values())
    assert lanes["lanes"]["node0:3"] == {"ranks": [2], "engine_addrs": [], "roles": ["train"]}
    assert lanes["lanes"]["node0:4"] == {"ranks": [], "engine_addrs": ["http://h:1"], "roles": ["rollout"]}
    c.flush()  # nothing new: nothing appended
    assert sum(len(p.read_text().splitlines()) for p in files["phases"]) == 2


def _wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_flush_thread_and_other_ranks_spool(tmp_path: Path):
    d = _cfg(tmp_path, "--dashboard-flush-interval", "0.2")
    driver = Collector(d, rank=0, primary=True)
    other = Collector(d, rank=1, primary=False)
    driver.start()
    other.start()
    try:
        now = time.time()
        other.push(records.PHASES, records.phase_event("actor_train", now - 1, now, node="node0", gpus=[], rank=1,
                                                       role="train"))
        driver.push(records.PHASES, records.phase_event("actor_train", now - 1, now, node="node0", gpus=[], rank=0,
                                                        role="train"))
        root = Path(d.dashboard_dir)
        assert _wait_for(lambda: {e["rank"] for e in records.read_stream(root, "phases")} == {0, 1})  # no flush() call
        assert (root / "spool" / "phases.rank1.jsonl").exists()
    finally:
        other.close()
        driver.close()
    assert len(records.read_stream(Path(d.dashboard_dir), "phases")) == 2  # each record merged once


def test_a_failing_collector_turns_itself_off(tmp_path: Path, caplog):
    d = _cfg(tmp_path, "--dashboard-flush-interval", "0.1")
    c = Collector(d, rank=0, primary=True)
    (Path(d.dashboard_dir) / "phases").write_text("not a directory")  # every flush of phases now fails
    c.start()
    c.push(records.PHASES, records.phase_event("rollout", 1.0, 2.0, node="n", gpus=[], rank=0, role="rollout_manager"))
    assert _wait_for(lambda: not c.enabled)
    c.push(records.PHASES, records.phase_event("rollout", 1.0, 2.0, node="n", gpus=[], rank=0, role="rollout_manager"))
    c.close()  # returns at once, raises nothing
    warnings = [r for r in caplog.records if "dashboard telemetry turned off" in r.getMessage()]
    assert len(warnings) == 1


class _FakeNvml:
    """NVML's call surface with fixed readings (the real one needs a GPU driver)."""

    class _U:
        gpu = 42

    class _M:
        used = 3 << 20

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return self._U()

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._M()

    def nvmlDeviceGetPowerUsage(self, h):
        return 250_000


def test_gpu_sampler_records_and_absence():
    s = GpuSampler("node0", nvml=_FakeNvml())
    assert s.available
    assert s.sample(5.0) == [records.gpu_sample(5.0, node="node0", gpu=g, util=42, mem_mb=3, power_w=250)
                             for g in range(2)]

    class NoDriver:
        def nvmlInit(self):
            raise OSError("NVML Shared Library Not Found")

    absent = GpuSampler("node0", nvml=NoDriver())
    assert not absent.available and absent.sample(1.0) == []


# ---------------------------------------------------------------------------------------------------- engines
PROM = """# HELP sglang:num_running_reqs running
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",dp_rank="1"} 3.0
sglang:gen_throughput{model_name="m"} 12.5
sglang:time_to_first_token_seconds_sum{model_name="m"} 4.5
sglang:not_in_whitelist{model_name="m"} 1
sglang:token_usage NaN
"""


class _PromEngine(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = PROM.encode() if self.path == "/metrics" else b"no"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _serve(handler) -> tuple[http.server.ThreadingHTTPServer, str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_prometheus_text_is_normalised_and_filtered():
    assert parse_prometheus('a_b{x="1",y="q\\"z"} 2e3 1700000000\n# c\nbad line\n') == [("a_b", {"x": "1", "y": 'q"z'},
                                                                                          2000.0)]
    srv, url = _serve(_PromEngine)
    try:
        got = EngineScraper("auto", lambda: [url + "/"], lambda: None).scrape(7.0)
    finally:
        srv.shutdown()
    assert {(r["metric"], r["value"]) for r in got} == {("sglang_num_running_reqs", 3.0),
                                                        ("sglang_gen_throughput", 12.5),
                                                        ("sglang_time_to_first_token_seconds_sum", 4.5)}
    running = next(r for r in got if r["metric"] == "sglang_num_running_reqs")
    assert running == records.engine_sample(7.0, addr=url, metric="sglang_num_running_reqs",
                                            labels={"engine_type": "unified", "dp_rank": "1"}, value=3.0)


def test_router_mode_reads_worker_addr_and_a_dead_engine_is_a_gap():
    text = 'sglang_num_queue_reqs{worker_addr="http://w:1"} 2\nsglang_num_queue_reqs 9\n'
    s = EngineScraper("router", lambda: [], lambda: "http://router:1", http_get=lambda url, t, k: text)
    assert [(r["addr"], r["value"]) for r in s.scrape(1.0)] == [("http://w:1", 2.0)]
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    t0 = time.monotonic()
    assert EngineScraper("direct", lambda: [dead], lambda: None, timeout=2.0).scrape(1.0) == []
    assert time.monotonic() - t0 < 5


@pytest.mark.multiprocess
def test_embedded_engine_has_no_metrics_route_so_get_load_is_scraped(tmp_path: Path, caplog):
    from miles.engine.testing import EngineProc, build_engine_model

    eng = EngineProc(build_engine_model(tmp_path / "m"), "--max-running-requests", "2", "--max-context-len", "64")
    try:
        assert eng.get("/metrics").status_code == 404
        s = EngineScraper("auto", lambda: [eng.url], lambda: None)
        first = s.scrape(1.0)
        s.scrape(2.0)
    finally:
        eng.stop()
    assert {r["metric"] for r in first} >= {"sglang_num_running_reqs", "sglang_num_queue_reqs"}
    assert all(r["addr"] == eng.url and r["labels"] == {} for r in first)
    assert len([r for r in caplog.records if "has no /metrics" in r.getMessage()]) == 1  # said once


# ---------------------------------------------------------------------------------------------------- a real run
def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:  # not listening yet
        return 0, ""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_rank_run_writes_per_rank_phases_and_the_viewer_serves_them(tmp_path: Path, tiny_model_dir: Path):
    """torchrun, 2 trainer ranks (SFT, no engines): every rank's phases reach phases/, the metrics stream has a
    record per rollout, and ``python -m miles.dashboard.serve`` serves the page over real HTTP."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+0=", "response": str(i)}) + "\n" for i in range(4)))
    out, dump = tmp_path / "out", tmp_path / "dump"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--debug-train-only",
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2",
           "--hf-checkpoint", str(tiny_model_dir), "--loss-type", "sft_loss", "--prompt-data", str(data),
           "--input-key", "input", "--label-key", "response", "--rollout-batch-size", "2", "--num-rollout", "2",
           "--lr", "1e-3", "--output-dir", str(out), "--no-progress", "--use-miles-dashboard", "--dump-details",
           str(dump), "--dashboard-flush-interval", "0.5", "--save", str(tmp_path / "ckpt")]
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), *cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=400,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    root = dump / "dashboard"
    phases = [e for e in records.read_stream(root, "phases") if e["t1"] != -1.0]
    by_rank = {rank: {e["name"] for e in phases if e["rank"] == rank and e["role"] == "train"} for rank in (0, 1)}
    assert by_rank[0] >= {"actor_train", "train_wait", "save_model"} and by_rank[1] >= {"actor_train", "train_wait", "save_model"}
    assert len([e for e in phases if e["rank"] == 1 and e["name"] == "actor_train"]) == 2
    assert {e["name"] for e in phases if e["role"] == "rollout_manager"} == {"rollout"}
    assert all(e["t0"] <= e["t1"] for e in phases)
    steps = [m for m in records.read_stream(root, "metrics") if m["step_key"] == "rollout/step"]
    assert [m["step"] for m in steps] == [0, 1] and all(m["metrics"]["rollout/step"] == m["step"] for m in steps)
    meta = json.loads((root / "meta.json").read_text())
    assert set(meta) == META_KEYS and meta["args"]["output_dir"] == str(out)

    port_sock = socket.socket()
    port_sock.bind(("127.0.0.1", 0))
    port = port_sock.getsockname()[1]
    port_sock.close()
    viewer = subprocess.Popen([sys.executable, "-m", "miles.dashboard.serve", "--dump-details", str(dump),
                               "--host", "127.0.0.1", "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_for(lambda: _get(f"http://127.0.0.1:{port}/api/meta")[0] == 200
                         if viewer.poll() is None else True, timeout=30), "viewer did not start"
        status, page = _get(f"http://127.0.0.1:{port}/")
        assert status == 200 and "<svg" in page and "rank 1 train" in page and 'data-name="actor_train"' in page
        assert page.count("<tr>") >= 3  # header + a row per rollout in the steps table
        status, body = _get(f"http://127.0.0.1:{port}/api/phases")
        assert status == 200 and {e["rank"] for e in json.loads(body)} == {0, 1}
        assert _get(f"http://127.0.0.1:{port}/nope")[0] == 404
    finally:
        viewer.terminate()
        viewer.wait(10)


# ---------------------------------------------------------------------------------------------------- viewer
def test_viewer_serves_a_collectors_output_over_http(tmp_path: Path):
    from miles.dashboard.serve import make_server

    d = _cfg(tmp_path)
    c = Collector(d, rank=0, primary=True, meta=records.meta("viewer-run", time.time() - 10, {"output_dir": "/nowhere"}))
    now = time.time()
    for rank, name in ((0, "actor_train"), (1, "actor_train"), (1, "train_wait")):
        c.push(records.PHASES, records.phase_event(name, now - 5, now - 1, node="node0", gpus=[rank], rank=rank,
                                                   role="train"))
    c.push(records.PHASES, records.phase_event("rollout", now - 9, now - 5, node="node0", gpus=[], rank=0,
                                               role="rollout_manager"))
    c.push(records.PHASES, records.phase_event("update_weights", now - 1, records.OPEN_T1, node="node0", gpus=[0],
                                               rank=0, role="train"))
    for step in range(3):
        c.push(records.METRICS, records.metrics_record(now, step, {"rollout/step": step, "rollout/raw_reward": step / 4}))
    c.close()
    srv = make_server(Path(d.dashboard_dir), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        status, page = _get(base + "/")
        assert status == 200
        assert page.count('class="phase"') == 5 + 3 and "rank 1 train" in page and "rank 0 rollout_manager" in page
        assert page.count('data-name="initialize"') == 3  # one a lane: from meta's start_ts to its first event
        assert "(running)" in page  # the open update_weights
        assert "<td>0.5</td>" in page and "viewer-run" in page  # step 2's reward; the run name
        metrics = json.loads(_get(base + "/api/metrics")[1])
        assert [m["step"] for m in metrics] == [0, 1, 2]
    finally:
        srv.shutdown()
        srv.server_close()


def test_viewer_falls_back_to_the_runs_metrics_jsonl_and_refuses_a_wrong_dir(tmp_path: Path):
    from miles.dashboard.serve import load_metrics, main

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"rollout_id": 0, "perf/step_time": 2.0}\n{"rollout_id": 1, "perf/step_time": 1.0}\n')
    d = _cfg(tmp_path)
    Collector(d, rank=0, primary=True, meta=records.meta("r", 1.0, {"output_dir": str(out)})).close()
    assert [(m["step"], m["perf/step_time"]) for m in load_metrics(Path(d.dashboard_dir), {"args": {"output_dir": str(out)}})] \
        == [(0, 2.0), (1, 1.0)]
    r = subprocess.run([sys.executable, "-m", "miles.dashboard.serve", "--dump-details", str(tmp_path / "none")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("--dump-details ")
    assert main(["--dir", d.dashboard_dir, "--port", "70000"]) == 2
