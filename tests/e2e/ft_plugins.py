"""Fault injection for the fault-tolerance end-to-end tests and the soak benchmark (test code, not miles).

``--custom-generate-function-path tests.e2e.ft_plugins.long_generate`` loads this module into the driver.
It generates as the default function does, with ``ignore_eos`` (every sample takes
``--rollout-max-response-len`` decode steps, so faults land while requests are in flight), and:

- ``MILES_FT_RECORD=FILE``: appends one JSON line per finished sample (pid, rollout id, group, index,
  prompt, status) and one per injected fault (wall time, engine, where), so a test can check that no
  sample was lost or repeated and measure recovery per fault.
- ``MILES_FT_FAULTS='[...]'``: faults to inject, each ``{"signal": "KILL"|"STOP", "engine": E, ...}`` plus
  either ``"rollout": R, "after_s": S`` (S seconds after the first request of rollout R, or of the first
  later rollout that starts with that engine in rotation: its requests are in flight),
  ``"rollout": R, "after_requests": N`` (as the N-th request of rollout R, or of the first later rollout
  that starts with the engine in rotation, is issued: N-1 of its requests are in flight, whatever the
  machine's speed), ``"rollout": R, "after_samples": N`` (once N samples of rollout R finished), or
  ``"again_after": K, "after_s": S`` (the engine that fault K hit, S seconds into the first rollout that
  starts once it is back in rotation: a second kill in a row), or
  ``"sync_version": V, "after_buckets": B`` (inside the weight sync to
  version V, after B buckets were gathered: the sync is under way). The engine process is found by the
  port of its URL among this machine's ``python -m miles.engine`` processes (this run's, by port).
- ``MILES_FT_HOLD='{"rollout": R, "seconds": S}'``: in the job's first attempt (``TORCHELASTIC_RESTART_COUNT``
  0), every sample of rollout R returns S seconds after it is recorded, so rollout R stays in generation for S
  seconds after its first sample shows in the record: a test acting "while rollout R is generated" is not
  racing a step that takes a few milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from miles.rollout.generate import generate

_FAULTS: list[dict] = json.loads(os.environ.get("MILES_FT_FAULTS", "[]"))
_HOLD: dict = json.loads(os.environ.get("MILES_FT_HOLD", "{}"))
_done: set[int] = set()
_finished: dict[int, int] = {}
_started: dict[int, int] = {}  # rollout id -> generate calls begun (in flight = started - finished)
_killed_pid: dict[int, int] = {}  # fault index -> pid it signalled
_client: list = []  # the rollout client, once seen (for retry counts from the sync hook)


def _record(entry: dict) -> None:
    path = os.environ.get("MILES_FT_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **entry}) + "\n")


def engine_pid(url: str) -> int | None:
    """The pid of the embedded engine serving ``url`` on this machine (matched by its --port)."""
    port = str(urlparse(url).port)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "miles.engine" in args and "--port" in args and args[args.index("--port") + 1] == port:
            return int(proc.name)
    return None


def _inject(i: int, fault: dict, url: str, where: str, retries: int | None = None) -> None:
    _done.add(i)
    pid = engine_pid(url)
    if pid is None:
        _record({"fault": fault, "index": i, "url": url, "where": where, "error": "engine process not found"})
        return
    os.kill(pid, getattr(signal, "SIG" + fault.get("signal", "KILL")))
    _killed_pid[i] = pid
    _record({"fault": fault, "index": i, "url": url, "engine_pid": pid, "where": where, "t": time.time(),
             "retries": retries})


def _inject_timed(i: int, fault: dict, url: str, rollout_id: int, client) -> None:
    """A timed fault fires only while rollout ``rollout_id`` still has requests in flight; a timer that fired
    late (a loaded machine: the rollout is already over) re-arms the fault for the next rollout instead of
    hitting the engine between rollouts."""
    if _started.get(rollout_id, 0) <= _finished.get(rollout_id, 0):
        _done.discard(i)
        return
    _inject(i, fault, url, f"rollout {rollout_id}", _retries(client))


def _engine_urls(client) -> list[str]:
    for obj in (client, getattr(client, "inner", None), getattr(getattr(client, "inner", None), "inner", None)):
        urls = getattr(obj, "engine_urls", None)
        if urls:
            return list(urls)
    raise RuntimeError("ft_plugins: the rollout client does not list its engine URLs")


def _retries(client) -> int | None:
    for obj in (client, getattr(client, "inner", None), getattr(getattr(client, "inner", None), "inner", None)):
        stats = getattr(obj, "stats", None)
        if isinstance(stats, dict):
            return int(stats.get("retries", 0))
    return None


def _in_rotation(client, url: str) -> bool:
    for obj in (client, getattr(client, "inner", None)):
        ctl = getattr(obj, "controller", None)
        if ctl is not None:
            return url.rstrip("/") in ctl.healthy_engine_urls()
    return True


def _due(f: dict, sample, client) -> bool:
    """Is timed fault ``f`` due at this rollout: at or after its ``rollout``, with its engine in rotation (and, for
    ``again_after: k``, a new process: the engine fault k hit is back)."""
    url = _engine_urls(client)[f["engine"]]
    if sample.rollout_id < f.get("rollout", 0) or not _in_rotation(client, url):
        return False
    if "again_after" in f:
        k = f["again_after"]
        return k in _killed_pid and engine_pid(url) not in (None, _killed_pid[k])
    return True


async def long_generate(args, sample, sampling_params):
    if not _client:
        _client.append(args.client)
    for i, f in enumerate(_FAULTS):  # timed faults: ``after_s`` seconds after the rollout's first request
        if i not in _done and "after_s" in f and _due(f, sample, args.client):
            _done.add(i)
            url, client, r = _engine_urls(args.client)[f["engine"]], args.client, sample.rollout_id
            # a thread timer, not loop.call_later: the driver's event loop is busy (training, weight sync)
            # between rollouts, and a late callback would hit the next rollout instead of this one
            timer = threading.Timer(f["after_s"], _inject_timed, (i, f, url, r, client))
            timer.daemon = True
            timer.start()
    _started[sample.rollout_id] = _started.get(sample.rollout_id, 0) + 1
    for i, f in enumerate(_FAULTS):  # request-count faults: synchronous, so they land while requests run
        if (i not in _done and "after_requests" in f and _started[sample.rollout_id] >= f["after_requests"]
                and _due(f, sample, args.client)):
            _inject(i, f, _engine_urls(args.client)[f["engine"]], f"rollout {sample.rollout_id}",
                    _retries(args.client))
    out = await generate(args.client, sample, {**sampling_params, "ignore_eos": True})
    prompt = sample.prompt if isinstance(sample.prompt, str) else json.dumps(sample.prompt)
    _record({"rollout_id": sample.rollout_id, "group": sample.group_index, "index": sample.index, "prompt": prompt,
             "status": str(out.status.value), "response_length": out.response_length, "t": time.time()})
    n = _finished[sample.rollout_id] = _finished.get(sample.rollout_id, 0) + 1
    if (_HOLD.get("rollout") == sample.rollout_id
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        await asyncio.sleep(float(_HOLD["seconds"]))
    for i, f in enumerate(_FAULTS):
        if (i not in _done and f.get("rollout") == sample.rollout_id and "after_samples" in f
                and n >= f["after_samples"]):
            _inject(i, f, _engine_urls(args.client)[f["engine"]], f"rollout {sample.rollout_id}",
                    _retries(args.client))
    return out


def _install_sync_hook() -> None:
    """Wrap the weight senders: inject the sync faults mid-transfer of the sync to ``sync_version`` (not in its
    ``--check-weight-update-equal`` pass, nor in a catch-up from the driver's cache)."""
    if not any("sync_version" in f for f in _FAULTS):
        return
    from miles.weight_sync.base import WeightSender
    from miles.weight_sync.broadcast import BroadcastSender
    from miles.weight_sync.disk_delta_sender import DiskDeltaSender
    from miles.weight_sync.tensor import TensorSender

    for cls in (BroadcastSender, DiskDeltaSender, TensorSender):
        def _sync(self, engines, version, _orig=cls._sync):
            self._ft_syncing = version
            try:
                return _orig(self, engines, version)
            finally:
                self._ft_syncing = None
        cls._sync = _sync

    original = WeightSender.iter_buckets

    def iter_buckets(self, *, full: bool = False):
        version = getattr(self, "_ft_syncing", None)
        catch_up = type(self.source).__name__ == "_CachedSource"
        for k, bucket in enumerate(original(self, full=full)):
            for i, f in enumerate(_FAULTS):
                if (i not in _done and version is not None and not catch_up and self.is_source
                        and f.get("sync_version") == version and k >= f.get("after_buckets", 1)):
                    target = next((e for e in self.engines if e.engine_id == f["engine"]), None)
                    if target is not None:
                        _inject(i, f, target.url, f"weight sync v{version} bucket {k}",
                                _retries(_client[0]) if _client else None)
            yield bucket

    WeightSender.iter_buckets = iter_buckets


_install_sync_hook()
