"""Weight updates into a real engine process from this test process acting as the trainer.

The trainer side is built exactly as SGLang-compatible trainers do it: ``TCPStore(is_master=True)`` hosted
here, ``PrefixStore(group_name, store)`` and ``_new_process_group_helper`` (gloo), rank 0 of a world of 2,
while the engine joins through ``/init_weights_update_group``. Then per-tensor and flattened-bucket
broadcasts, disk versions (full and delta, corrupted delta rolled back), and group teardown.
"""

from __future__ import annotations

import datetime
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from miles.engine.testing import EngineProc, build_engine_model
from miles.utils.net import find_free_port

pytestmark = pytest.mark.multiprocess


class Trainer:
    """Rank 0 of a weight-update group outside any torch world."""

    def __init__(self, group_name: str, world_size: int = 2, timeout: float = 60.0):
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

        self.port = find_free_port()
        self.group_name = group_name
        td = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore("127.0.0.1", self.port, world_size, True, td, wait_for_workers=False)
        self._args = (world_size, _new_process_group_helper, PrefixStore, Backend, _world, td)

    def join(self) -> None:
        world_size, helper, PrefixStore, Backend, _world, td = self._args
        opt = "backend_options" if "backend_options" in inspect.signature(helper).parameters else "pg_options"
        self.pg, _ = helper(world_size, 0, [], Backend("gloo"), PrefixStore(self.group_name, self.store),
                            group_name=self.group_name, timeout=td, **{opt: None})
        _world.pg_group_ranks[self.pg] = {i: i for i in range(world_size)}

    def broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self.pg)

    def destroy(self) -> None:
        dist.destroy_process_group(self.pg)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_engine_model(tmp_path_factory.mktemp("wmodel"), seed=3)


@pytest.fixture(scope="module")
def eng(model, tmp_path_factory):
    e = EngineProc(model, "--max-running-requests", "2", "--max-context-len", "128", "--weight-update-timeout", "8",
                   log=tmp_path_factory.mktemp("wlog") / "engine.log")
    yield e
    e.stop()


def weight(eng, name: str, n: int = 1000) -> torch.Tensor:
    r = eng.post("/get_weights_by_name", {"name": name, "truncate_size": n})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def join_group(eng, name: str) -> Trainer:
    tr = Trainer(name)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(eng.post, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": tr.port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"})
        tr.join()
        r = fut.result(60)
    assert r.status_code == 200 and r.json()["success"], r.text
    return tr


def test_distributed_updates_per_tensor_and_flattened(eng):
    from miles.weight_sync.buckets import dtype_to_str, pack_bucket

    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    olds = [weight(eng, n) for n in names]
    tr = join_group(eng, "g1")
    assert eng.post("/begin_weight_update", {"selector": "all"}).json()["success"]

    # per tensor: one broadcast per name, in order; the HTTP call returns after the last one
    new = [torch.randn(o.shape) for o in olds]
    body = {"names": names, "dtypes": [dtype_to_str(t.dtype) for t in new], "shapes": [list(t.shape) for t in new],
            "group_name": "g1", "weight_version": "1"}
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(eng.post, "/update_weights_from_distributed", body)
        for t in new:
            tr.broadcast(t)
        r = fut.result(60)
    assert r.status_code == 200 and r.json()["success"], r.text
    for n, t in zip(names, new):
        assert torch.equal(weight(eng, n), t)
    assert eng.get("/get_model_info").json()["weight_version"] == "1"

    # flattened bucket: ONE uint8 broadcast, mixed dtypes (bf16 arrives and is cast to the engine's fp32)
    bucket = [(names[0], torch.randn(olds[0].shape).bfloat16()), (names[2], torch.full(olds[2].shape, 0.5))]
    flat, meta = pack_bucket(bucket)
    body = {"names": [m["name"] for m in meta], "dtypes": [m["dtype"] for m in meta], "shapes": [m["shape"] for m in meta],
            "group_name": "g1", "load_format": "flattened_bucket", "weight_version": "2"}
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(eng.post, "/update_weights_from_distributed", body)
        tr.broadcast(flat)
        r = fut.result(60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert torch.equal(weight(eng, names[0]), bucket[0][1].float())
    assert torch.equal(weight(eng, names[2]), bucket[1][1])
    assert torch.equal(weight(eng, names[1]), new[1])  # untouched by the bucket
    assert eng.post("/end_weight_update", {}).json()["success"]

    # a name the model does not have: the broadcast still completes (the trainer never hangs), then 400
    body = {"names": ["no.such.weight"], "dtypes": ["float32"], "shapes": [[3]], "group_name": "g1"}
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(eng.post, "/update_weights_from_distributed", body)
        tr.broadcast(torch.zeros(3))
        r = fut.result(60)
    assert r.status_code == 400 and "no.such.weight" in r.json()["message"]
    # generation still works with the new weights, and the group can be destroyed and re-formed
    out = eng.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert out["meta_info"]["weight_version"] == "2"
    assert eng.post("/destroy_weights_update_group", {"group_name": "g1"}).json()["success"]
    tr.destroy()
    assert eng.post("/update_weights_from_distributed", {**body, "group_name": "g1"}).status_code == 400
    tr2 = join_group(eng, "g2")
    t = torch.randn(olds[1].shape)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(eng.post, "/update_weights_from_distributed", {
            "names": [names[1]], "dtypes": ["float32"], "shapes": [list(t.shape)], "group_name": "g2"})
        tr2.broadcast(t)
        assert fut.result(60).status_code == 200
    assert torch.equal(weight(eng, names[1]), t)
    assert eng.post("/destroy_weights_update_group", {"group_name": "g2"}).json()["success"]
    tr2.destroy()


def test_buckets_of_one_sync_load_in_index_order_whatever_their_arrival(eng):
    """Two same-layout buckets whose requests arrive reversed (separate connections give no order): the engine
    takes them by ``miles_bucket``, so each broadcast lands in its own tensors, not its twin's."""
    import time

    from miles.weight_sync.buckets import pack_bucket

    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    shape = weight(eng, names[0]).shape
    tr = join_group(eng, "ordered")
    flats, bodies = [], []
    for i, n in enumerate(names):
        flat, meta = pack_bucket([(n, torch.full(shape, float(i + 1)))])
        flats.append(flat)
        bodies.append({"names": [n], "dtypes": [meta[0]["dtype"]], "shapes": [meta[0]["shape"]], "group_name": "ordered",
                       "load_format": "flattened_bucket"})
    with ThreadPoolExecutor(2) as ex:
        second = ex.submit(eng.post, "/update_weights_from_distributed", bodies[1],
                           params={"miles_sync": "s1", "miles_bucket": "1"})
        time.sleep(0.5)  # bucket 1's request is in first
        first = ex.submit(eng.post, "/update_weights_from_distributed", bodies[0],
                          params={"miles_sync": "s1", "miles_bucket": "0"})
        for f in flats:
            tr.broadcast(f)
        for f in (first, second):
            r = f.result(60)
            assert r.status_code == 200 and r.json()["success"], r.text
    assert torch.equal(weight(eng, names[0]), torch.full(shape, 1.0))
    assert torch.equal(weight(eng, names[1]), torch.full(shape, 2.0))
    # a bucket whose predecessor never comes fails within --weight-update-timeout (8 s here), naming it
    t0 = time.monotonic()
    r = eng.post("/update_weights_from_distributed", bodies[0], params={"miles_sync": "s2", "miles_bucket": "3"})
    assert r.status_code == 400 and "bucket 2 was not done" in r.json()["message"], r.text
    assert time.monotonic() - t0 < 20
    bad = eng.post("/update_weights_from_distributed", bodies[0], params={"miles_sync": "s2"})
    assert bad.status_code == 400 and "miles_bucket" in bad.json()["message"]
    assert eng.post("/destroy_weights_update_group", {"group_name": "ordered"}).json()["success"]
    tr.destroy()


def test_init_group_times_out_cleanly_when_no_trainer(eng):
    store = dist.TCPStore("127.0.0.1", find_free_port(), 2, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    r = eng.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1,
                                                "world_size": 2, "group_name": "lonely", "backend": "gloo"}, timeout=60)
    assert r.status_code == 400 and "lonely" in r.json()["message"]  # bounded by --weight-update-timeout
    assert eng.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})["meta_info"]["completion_tokens"] == 2
    r = eng.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                "world_size": 2, "group_name": "x", "backend": "nccl"})
    assert r.status_code == 400 and "nccl" in r.json()["message"]


def test_disk_versions_full_delta_and_corrupted_delta(eng, model, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.weight_sync import disk_delta as dd

    hf = AutoModelForCausalLM.from_pretrained(model)
    v1 = {n: p.detach().clone() for n, p in hf.named_parameters()}
    full = dd.write_version(tmp_path, 1, v1.items(), baseline=None, model_dir=model)
    r = eng.post("/update_weights_from_disk", {"model_path": str(full), "weight_version": "1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(weight(eng, name), v1[name])

    v2 = {n: (t + 0.25 if "layers.1" in n else t) for n, t in v1.items()}
    delta = dd.write_version(tmp_path, 2, v2.items(), baseline=v1)
    r = eng.post("/update_weights_from_disk", {"model_path": str(delta), "weight_version": "2"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert torch.equal(weight(eng, name), v2[name])
    assert eng.get("/get_model_info").json()["weight_version"] == "2"

    v3 = {n: t * 2 for n, t in v2.items()}
    bad = dd.write_version(tmp_path, 3, v3.items(), baseline=v2)
    victim = next(p for p in sorted((bad / "deltas").iterdir()))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = eng.post("/update_weights_from_disk", {"model_path": str(bad), "weight_version": "3"})
    assert r.status_code == 400 and "corrupted" in r.json()["message"]
    assert torch.equal(weight(eng, name), v2[name])  # old weights kept
    assert eng.get("/get_model_info").json()["weight_version"] == "2"


def test_concurrent_generation_during_update(eng):
    """Requests in flight while weights change are never corrupted or lost: they finish (new weights apply
    between two decode steps)."""
    stop = threading.Event()
    results = []

    def load():
        while not stop.is_set():
            results.append(eng.generate({"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}))

    th = threading.Thread(target=load)
    th.start()
    try:
        tr = join_group(eng, "g3")
        for i in range(3):
            t = torch.randn(64)
            with ThreadPoolExecutor(1) as ex:
                fut = ex.submit(eng.post, "/update_weights_from_distributed", {
                    "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "g3",
                    "weight_version": f"c{i}"})
                tr.broadcast(t)
                assert fut.result(60).status_code == 200
        eng.post("/destroy_weights_update_group", {"group_name": "g3"})
        tr.destroy()
    finally:
        stop.set()
        th.join(60)
    assert results and all(r["meta_info"]["completion_tokens"] == 20 for r in results)
