"""A small read-only viewer of a run's dashboard telemetry: one HTML page, no JavaScript.

    python -m miles.dashboard.serve --dump-details DUMP_DETAILS [--port 7788] [--host 0.0.0.0]
    python -m miles.dashboard.serve --dir DUMP_DETAILS/dashboard

The page shows the run (meta.json), one row per rollout of the step metrics (the dashboard's metrics stream, or
the run's OUTPUT_DIR/metrics.jsonl), the phase timeline of every rank as an SVG (one lane per rank and role),
each rank's seconds per phase, GPU utilisation per lane and the latest engine metrics. Files are re-read on
every request, so a running job's page is current on reload (Miles's ``--follow`` is accepted and changes
nothing). ``/api/meta``, ``/api/metrics`` and ``/api/phases`` serve the same data as JSON. Standard library only.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from miles.dashboard import records

METRIC_KEYS = ("rollout/raw_reward", "rollout/response_len", "train/loss", "perf/step_time", "perf/rollout_time",
               "perf/train_time", "perf/update_weights_time", "perf/save_time", "perf/eval_time")
COLOURS = {"initialize": "#bbbbbb", "rollout": "#f28e2b", "eval_rollout": "#edc948", "actor_train": "#4e79a7",
           "train_wait": "#d7dde5", "update_weights": "#59a14f", "save_model": "#b07aa1", "sleep": "#9c755f",
           "wake_up": "#76b7b2"}
LANE_H, LEFT, WIDTH = 22, 170, 1100


def load_meta(root: Path) -> dict[str, Any]:
    path = root / records.META_FILE
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def load_metrics(root: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """(step, metrics) rows: the dashboard's ``rollout/step`` records, else the run's metrics.jsonl."""
    rows = [{"step": r.get("step"), **r.get("metrics", {})} for r in records.read_stream(root, records.METRICS)
            if r.get("step_key") == "rollout/step"]
    if rows:
        return rows
    out_dir = (meta.get("args") or {}).get("output_dir")
    path = Path(out_dir) / "metrics.jsonl" if out_dir else None
    if path is None or not path.exists():
        return []
    return [{"step": r.get("rollout_id"), **r} for r in records.read_complete_lines(path, 0)[0]]


def load_phases(root: Path) -> list[dict[str, Any]]:
    """Phase events with an open event dropped once its closing event is there."""
    events = records.read_stream(root, records.PHASES)
    closed = {(e["rank"], e["role"], e["name"], e["t0"]) for e in events if e["t1"] != records.OPEN_T1}
    return [e for e in events if e["t1"] != records.OPEN_T1 or (e["rank"], e["role"], e["name"], e["t0"]) not in closed]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v)) if v is not None else ""


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def timeline_svg(phases: list[dict[str, Any]], start_ts: float | None) -> str:
    if not phases:
        return "<p>no phase events yet</p>"
    now = time.time()
    lanes = sorted({(e["role"], e["rank"]) for e in phases}, key=lambda k: (k[0] != records.ROLE_ROLLOUT_MANAGER, k[1]))
    if start_ts:  # Miles's read side draws [start_ts, first event) of each lane as "initialize"
        first = {lane: min(e["t0"] for e in phases if (e["role"], e["rank"]) == lane) for lane in lanes}
        phases = [{"name": records.INITIALIZE, "t0": start_ts, "t1": t, "role": role, "rank": rank}
                  for (role, rank), t in first.items() if t > start_ts] + phases
    t0 = min([e["t0"] for e in phases] + ([start_ts] if start_ts else []))
    t1 = max(max(e["t0"], e["t1"]) for e in phases)
    t1 = max(t1, max((now for e in phases if e["t1"] == records.OPEN_T1), default=t1))
    span = max(t1 - t0, 1e-6)
    scale = (WIDTH - LEFT - 10) / span
    parts = []
    for i, (role, rank) in enumerate(lanes):
        y = 20 + i * LANE_H
        parts.append(f'<text x="4" y="{y + 15}" font-size="12">rank {rank} {html.escape(role)}</text>')
    for e in phases:
        i = lanes.index((e["role"], e["rank"]))
        end = now if e["t1"] == records.OPEN_T1 else e["t1"]
        x, w = LEFT + (e["t0"] - t0) * scale, max((end - e["t0"]) * scale, 1.0)
        colour = COLOURS.get(e["name"], "#999999")
        title = html.escape(f"{e['name']} rank {e['rank']}: {end - e['t0']:.3f} s"
                            f"{' (running)' if e['t1'] == records.OPEN_T1 else ''}")
        parts.append(f'<rect class="phase" data-name="{html.escape(e["name"])}" x="{x:.1f}" y="{22 + i * LANE_H}" '
                     f'width="{w:.1f}" height="{LANE_H - 6}" fill="{colour}"><title>{title}</title></rect>')
    axis_y = 24 + len(lanes) * LANE_H
    parts.append(f'<text x="{LEFT}" y="{axis_y + 12}" font-size="11">0 s</text>'
                 f'<text x="{WIDTH - 60}" y="{axis_y + 12}" font-size="11">{span:.1f} s</text>')
    legend = " ".join(f'<span style="background:{c};padding:0 6px">{n}</span>' for n, c in COLOURS.items())
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{axis_y + 20}">{"".join(parts)}</svg>'
            f"<p>{legend}</p>")


def render_page(root: Path) -> str:
    meta = load_meta(root)
    metrics = load_metrics(root, meta)
    phases = load_phases(root)
    keys = [k for k in METRIC_KEYS if any(k in r for r in metrics)]
    metric_rows = [[r.get("step")] + [r.get(k) for k in keys] for r in metrics]
    totals: dict[tuple[int, str], dict[str, float]] = {}
    for e in phases:
        if e["t1"] != records.OPEN_T1:
            lane = totals.setdefault((e["rank"], e["role"]), {})
            lane[e["name"]] = lane.get(e["name"], 0.0) + e["t1"] - e["t0"]
    names = sorted({n for lane in totals.values() for n in lane})
    total_rows = [[rank, role] + [lane.get(n) for n in names] for (rank, role), lane in sorted(totals.items())]
    gpu: dict[str, list[int]] = {}
    for s in records.read_stream(root, records.GPU_UTIL):
        gpu.setdefault(f"{s['node']}:{s['gpu']}", []).append(s["util"])
    gpu_rows = [[lane, len(u), sum(u) / len(u), max(u)] for lane, u in sorted(gpu.items())]
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for s in records.read_stream(root, records.ENGINE_SERIES):
        latest[(s["addr"], s["metric"] + (json.dumps(s["labels"], sort_keys=True) if s["labels"] else ""))] = s
    engine_rows = [[addr, metric, s["value"]] for (addr, metric), s in sorted(latest.items())]
    start = meta.get("start_ts")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)) if start else "?"
    args_rows = [[k, v] for k, v in sorted((meta.get("args") or {}).items())]
    return "".join([
        "<!doctype html><html><head><meta charset='utf-8'><title>miles dashboard</title><style>"
        "body{font-family:sans-serif;margin:16px}table{border-collapse:collapse;margin-bottom:16px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px;text-align:right}th{background:#eee}"
        "</style></head><body>",
        f"<h1>{html.escape(str(meta.get('run_name', 'miles run')))}</h1><p>started {started}; {html.escape(str(root))}</p>",
        "<h2>Steps</h2>", _table(["step"] + keys, metric_rows) if metric_rows else "<p>no step metrics yet</p>",
        "<h2>Phase timeline</h2>", timeline_svg(phases, start),
        "<h2>Seconds per phase</h2>", _table(["rank", "role"] + names, total_rows) if total_rows else "",
        "<h2>GPU utilisation</h2>", _table(["lane", "samples", "mean %", "max %"], gpu_rows) if gpu_rows else
        "<p>no GPU samples (no NVML on this run's nodes)</p>",
        "<h2>Engine metrics (latest)</h2>", _table(["engine", "metric", "value"], engine_rows) if engine_rows else
        "<p>no engine metrics</p>",
        "<h2>Run arguments</h2>", _table(["arg", "value"], args_rows), "</body></html>"])


def make_server(root: Path, host: str = "0.0.0.0", port: int = 7788) -> ThreadingHTTPServer:
    """The viewer's server over ``root`` (a ``{dump-details}/dashboard`` directory); ``port`` 0 picks a free one."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            meta = load_meta(root)
            routes = {"/api/meta": lambda: meta, "/api/metrics": lambda: load_metrics(root, meta),
                      "/api/phases": lambda: load_phases(root)}
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", render_page(root))
            elif path in routes:
                self._send(200, "application/json", json.dumps(routes[path](), default=str))
            else:
                self._send(404, "text/plain", f"not found: {path}\n")

        def _send(self, code: int, ctype: str, text: str) -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.dashboard.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--dump-details", help="the run's --dump-details directory (telemetry in DIR/dashboard/)")
    where.add_argument("--dir", help="the telemetry directory itself (DUMP_DETAILS/dashboard)")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0, as Miles)")
    p.add_argument("--port", type=int, default=7788, help="listen port (default 7788)")
    p.add_argument("--follow", action="store_true", help="accepted for Miles's command line: files are always re-read")
    args = p.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(args.dump_details) / "dashboard"
    flag = "--dir" if args.dir else "--dump-details"
    if not (root / records.META_FILE).is_file():
        print(f"{flag} {args.dir or args.dump_details}: no {root / records.META_FILE} (a run with --use-miles-dashboard "
              "writes it): give the run's --dump-details directory.", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"--port {args.port} is not a TCP port: give 1..65535 (0: any free port).", file=sys.stderr)
        return 2
    try:
        server = make_server(root, args.host, args.port)
    except OSError as e:
        print(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({e.strerror}): pick another --port.",
              file=sys.stderr)
        return 2
    print(f"miles dashboard of {root}: http://{args.host}:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
