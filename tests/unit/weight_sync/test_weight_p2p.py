"""``--update-weight-transfer-mode p2p`` pieces with real processes: two trainer ranks each send only their own
rows over a gloo weight group, the engine side (``miles.engine.weights.WeightGroups``) assembles the bucket
byte for byte as ``broadcast`` would deliver it, and refuses ranges that do not tile the bucket. Also the
mode names and defaults as Miles has them."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import pytest
import torch

from miles.config import parse_args
from miles.config.base import ConfigError
from miles.weight_sync.base import build_weight_sender
from miles.weight_sync.buckets import pack_bucket
from miles.weight_sync.p2p import LocalShard, P2PSender, _splits, pack_local, plan_bucket

WORLD = 2  # trainer ranks


def _full() -> list[tuple[str, torch.Tensor, bool]]:
    """(name, full tensor, dim-0 sharded?) -- odd row counts, an empty shard, mixed dtypes, a 0-dim tensor."""
    g = torch.Generator().manual_seed(7)
    return [("w", torch.randn(5, 3, generator=g), True),
            ("norm", torch.randn(7, generator=g).to(torch.bfloat16), False),
            ("one_row", torch.randn(1, 4, generator=g), True),   # rank 1 holds no row of it
            ("step", torch.tensor(11, dtype=torch.int64), False),
            ("emb", torch.randn(9, 2, generator=g).to(torch.bfloat16), True)]


def _shards(rank: int) -> list[LocalShard]:
    out = []
    for name, t, sharded in _full():
        splits = _splits(t.shape[0] if t.dim() else 1, WORLD, sharded)
        a, b = splits[rank]
        data = t[a:b] if t.dim() else (t if rank == 0 else t.reshape(-1)[:0])
        out.append(LocalShard(name, tuple(t.shape), t.dtype, splits, data.contiguous()))
    return out


def _trainer_rank(port: int, rank: int, q) -> None:
    import torch.distributed as dist

    from miles.weight_sync.group import WeightGroup, connect_store

    group = WeightGroup("p2p", connect_store("127.0.0.1", port, 20), rank, WORLD + 1, "gloo", timeout_s=20)
    shards = _shards(rank)
    plan = plan_bucket(shards, WORLD)
    buf = pack_local(shards, torch.device("cpu"))
    dist.isend(buf, group_dst=WORLD, group=group.pg).wait()
    q.put((rank, plan.ranges, buf.numel()))
    group.destroy()


def test_two_trainer_ranks_send_their_rows_and_the_engine_assembles_the_broadcast_bytes() -> None:
    from miles.engine.weights import WeightGroups, WeightUpdateError
    from miles.weight_sync.group import host_store

    store = host_store(0, 20)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_trainer_rank, args=(store.port, r, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        engine = WeightGroups(torch.device("cpu"))
        engine.init_group("127.0.0.1", store.port, WORLD, WORLD + 1, "p2p", "gloo", 20)
        full = [(n, t) for n, t, _ in _full()]
        names, dtypes, shapes = [n for n, _ in full], [str(t.dtype) for _, t in full], [list(t.shape) for _, t in full]
        ranges = plan_bucket(_shards(0), WORLD).ranges
        expected, _ = pack_bucket(full)
        assert sorted(x for rs in ranges for x in map(tuple, rs))[-1][1] == expected.numel()
        assert ranges[0] and ranges[1]  # both ranks send part of the bucket
        # ranges that do not tile the bucket are refused before anything is received
        gap = [ranges[0], [[ranges[1][0][0] + 1, ranges[1][0][1]]] + ranges[1][1:]]
        with pytest.raises(WeightUpdateError, match="do not tile"):
            engine.receive("p2p", names, dtypes, shapes, "flattened_bucket", gap)
        overlap = [ranges[0] + [ranges[1][0]], ranges[1]]
        with pytest.raises(WeightUpdateError, match="do not tile"):
            engine.receive("p2p", names, dtypes, shapes, "flattened_bucket", overlap)
        with pytest.raises(WeightUpdateError, match="sending rank"):
            engine.receive("p2p", names, dtypes, shapes, "flattened_bucket", ranges + [[]])
        got = engine.receive("p2p", names, dtypes, shapes, "flattened_bucket", ranges)
        sent = {r: (rs, n) for r, rs, n in (q.get(timeout=30) for _ in range(WORLD))}
        assert sent[0][0] == sent[1][0] == ranges  # every rank computed the same plan
        assert sent[0][1] + sent[1][1] == expected.numel() and 0 < sent[1][1] < expected.numel()
        got_flat, _ = pack_bucket(got)
        assert torch.equal(got_flat, expected)  # byte for byte the broadcast bucket
        for (n, t), (gn, gt) in zip(full, got):
            assert n == gn and gt.dtype == t.dtype and torch.equal(gt, t)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)


def test_plan_merges_contiguous_pieces_and_covers_each_byte_once() -> None:
    plan = plan_bucket(_shards(1), WORLD)
    covered = sorted((a, b) for rs in plan.ranges for a, b in rs)
    assert covered[0][0] == 0 and covered[-1][1] == plan.total
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    # rank 0: w rows 0-2, norm, one_row, step are contiguous -> one range, then its emb rows
    assert len(plan.ranges[0]) == 2 and len(plan.ranges[1]) == 2


def test_modes_and_defaults_are_miles() -> None:
    cfg = parse_args(["--hf-checkpoint", "x"], validate=False).weights
    assert cfg.update_weight_transfer_mode == "broadcast"  # Miles v0.1.0's default
    assert build_weight_sender(cfg, None, colocate=False, is_source=True).mode == "broadcast"
    assert build_weight_sender(cfg, None, colocate=True, is_source=True).mode == "tensor"  # same-device hand-off
    p2p = dataclasses.replace(cfg, update_weight_transfer_mode="p2p")
    sender = build_weight_sender(p2p, None, colocate=False, is_source=True)
    assert isinstance(sender, P2PSender) and sender.num_sources == 1
    with pytest.raises(ConfigError, match="p2p.*--colocate"):
        build_weight_sender(p2p, None, colocate=True, is_source=True)
    with pytest.raises(ConfigError, match="'auto' is not one of"):
        build_weight_sender(dataclasses.replace(cfg, update_weight_transfer_mode="auto"), None, is_source=True)
    for mode in ("broadcast", "p2p", "disk-delta", "tensor"):
        assert parse_args(["--hf-checkpoint", "x", "--update-weight-transfer-mode", mode],
                          validate=False).weights.update_weight_transfer_mode == mode


def test_p2p_with_colocate_is_one_line_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--update-weight-transfer-mode p2p .*--colocate"):
        parse_args(["--hf-checkpoint", "x", "--num-rollout", "1", "--rollout-batch-size", "4", "--colocate", "--update-weight-transfer-mode", "p2p"])
