"""Transport pieces with real processes: the weight group (gloo, dead member), the shared-memory hand-off,
the bitwise check, and the sender factory's errors."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch

from miles.config import parse_args
from miles.config.base import ConfigError
from miles.weight_sync.base import WeightSyncError, build_weight_sender
from miles.weight_sync.check import compare
from miles.weight_sync.group import WeightGroup, WeightGroupError, host_store
from miles.weight_sync.tensor import pack_shared, serialize_bucket


def _engine_member(port: int, rank: int, die_after_first: bool, q) -> None:
    from miles.engine.weights import WeightGroups

    groups = WeightGroups(torch.device("cpu"))
    groups.init_group("127.0.0.1", port, rank, 3, "wg", "gloo", 20)
    got = groups.receive("wg", ["a", "b"], ["float32", "bfloat16"], [[2, 3], [5]], "flattened_bucket")
    q.put((rank, [(n, t.float().sum().item()) for n, t in got]))
    q.close()
    q.join_thread()  # flush before dying
    if die_after_first:
        os._exit(1)
    try:
        groups.receive("wg", ["c"], ["uint8"], [[1 << 20]], None)
    except Exception:  # noqa: BLE001 - the trainer aborts the group after the other member died
        pass


def test_weight_group_broadcasts_to_engine_side_and_a_dead_member_fails_fast() -> None:
    from miles.weight_sync.buckets import pack_bucket

    store = host_store(0, 20)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_engine_member, args=(store.port, r, r == 2, q)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        group = WeightGroup("wg", store, 0, 3, "gloo", timeout_s=20)
        a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(5, dtype=torch.bfloat16)
        flat, _ = pack_bucket([("a", a), ("b", b)])
        group.broadcast(flat)
        got = dict(q.get(timeout=30) for _ in range(2))
        assert got[1] == got[2] == [("a", 15.0), ("b", 5.0)]
        procs[1].join(20)
        t0 = time.monotonic()
        with pytest.raises(WeightGroupError, match="'wg'.*failed"):
            group.broadcast(torch.zeros(1 << 20, dtype=torch.uint8))
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


def test_shared_memory_hand_off_reaches_another_process() -> None:
    bucket = [("w", torch.randn(3, 4)), ("h", torch.randn(7).to(torch.bfloat16)), ("i", torch.arange(3))]
    flat, meta = pack_shared(bucket)
    payload = serialize_bucket(flat, meta)
    code = (
        "import sys, torch\n"
        "from miles.engine.weights import deserialize_named_tensors\n"
        "named = deserialize_named_tensors(sys.stdin.read(), 'flattened_bucket')\n"
        "torch.save({n: t.clone() for n, t in named}, sys.argv[1])\n"
    )
    out = f"/tmp/miles_ws_handoff_{os.getpid()}.pt"
    try:
        subprocess.run([sys.executable, "-c", code, out], input=payload, text=True, check=True, timeout=120)
        got = torch.load(out)
    finally:
        if os.path.exists(out):
            os.unlink(out)
    for name, t in bucket:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_compare_is_bitwise_and_names_the_tensor() -> None:
    t = torch.randn(4, 3).to(torch.bfloat16)
    compare("x", t, t.float().tolist(), "http://e0")
    bad = t.float().clone()
    bad[1, 2] = torch.nextafter(bad[1, 2].to(torch.bfloat16).float(), torch.tensor(1e9)).item() + 0.5
    with pytest.raises(WeightSyncError, match=r"http://e0 tensor 'x' differs.*1/12 elements"):
        compare("x", t, bad.tolist(), "http://e0")
    with pytest.raises(WeightSyncError, match="has 3 elements"):
        compare("x", t, [1.0, 2.0, 3.0], "http://e0")
    neg_zero = torch.tensor([0.0, -0.0])
    with pytest.raises(WeightSyncError, match="differs"):
        compare("z", neg_zero, [0.0, 0.0], "http://e0")


def test_factory_resolves_modes_and_rejects_bad_ones() -> None:
    cfg = parse_args(["--hf-checkpoint", "x"], validate=False).weights
    assert build_weight_sender(cfg, None, colocate=False, is_source=True).mode == "broadcast"
    assert build_weight_sender(cfg, None, colocate=True, is_source=True).mode == "tensor"
    with pytest.raises(ConfigError, match="--update-weight-disk-dir"):
        build_weight_sender(dataclasses.replace(cfg, update_weight_transfer_mode="disk-delta"), None, is_source=True)
    with pytest.raises(ConfigError, match="'rdma' is not one of"):
        build_weight_sender(dataclasses.replace(cfg, update_weight_transfer_mode="rdma"), None, is_source=True)


class _RecordingGroup:
    """A weight group stand-in: records what was broadcast (bytes) and on which thread."""

    name = "g-test"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, str]] = []

    def broadcast(self, tensor, src=0, timeout_s=None, what=""):
        import threading

        self.sent.append((tensor.numpy().tobytes(), threading.current_thread().name))


class _RecordingControl:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name, **kw):
        import threading

        self.calls.append((names, dtypes, shapes, group_name, {k: v for k, v in kw.items() if k != "timeout"},
                           threading.current_thread().name))
        return {"success": True}

    async def close(self):
        pass


@pytest.mark.parametrize("whole", [None, "retract"])
def test_a_whole_sync_posts_and_broadcasts_on_the_calling_thread_the_same_request_and_bytes(whole) -> None:
    """One bucket with ``whole`` (the embedded engine's one-request sync) skips the sender thread; the request
    (names, dtypes, shapes, version, pause mode) and the broadcast bytes are those of the threaded path."""
    import threading

    from miles.weight_sync.base import Deadline, EngineTarget, SyncResult
    from miles.weight_sync.buckets import pack_bucket

    cfg = parse_args(["--hf-checkpoint", "x", "--update-weight-timeout", "30"], validate=False).weights
    calls: list = []
    sender = build_weight_sender(cfg, object(), is_source=True, engines=[EngineTarget("http://e0")],
                                 control_factory=lambda e, timeout: _RecordingControl(calls))
    g = torch.Generator().manual_seed(0)
    bucket = [("a.weight", torch.randn(4, 3, generator=g)), ("b.bias", torch.randn(5, generator=g).double())]
    group, result = _RecordingGroup(), SyncResult("broadcast", 3, num_engines=1)
    try:
        sender._send_all(group, [EngineTarget("http://e0")], 3, Deadline(30, "test"), result, iter([bucket]), whole)
    finally:
        sender.close()
    (sent, thread), = group.sent
    assert sent == pack_bucket(bucket)[0].numpy().tobytes()
    assert (thread == threading.current_thread().name) == (whole is not None)
    assert thread != "miles-weight-broadcast" or whole is None
    (names, dtypes, shapes, name, kw, _), = calls
    assert (names, dtypes, shapes, name) == (["a.weight", "b.bias"], ["float32", "float64"], [[4, 3], [5]], "g-test")
    assert kw["weight_version"] == "3" and kw["load_format"] == "flattened_bucket" and kw["flush_cache"] is False
    assert kw.get("whole_sync") == whole and "bucket_order" not in kw
    assert (result.num_buckets, result.num_tensors, result.bytes) == (1, 2, 4 * 12 + 8 * 5)
