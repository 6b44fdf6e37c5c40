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
