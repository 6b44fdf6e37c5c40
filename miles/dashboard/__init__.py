"""Miles's dashboard telemetry (``--use-miles-dashboard``): files in Miles v0.1.0's format and a small viewer.

    records.py    the on-disk format of {dump-details}/dashboard/ (meta.json, JSONL streams, hourly partitions)
    collector.py  the driver's collector (buffers, flush thread, rank spools) and other ranks' spool writers
    sources.py    GPU samples (NVML, lazily imported) and engine metrics scraped from /metrics (or /get_load)
    hooks.py      what the run calls: start, one context manager per phase, metrics, engines, close
    serve.py      ``python -m miles.dashboard.serve --dump-details DIR``: one read-only HTML page

Telemetry never stops or slows training: every hook is bounded and a failure logs one warning and turns the
dashboard off for the rest of the run.
"""
