"""A torch-only engine for the weight-sync benchmark: weights on a device and SGLang's weight endpoints.

It holds a parameter set (shapes and dtype from a JSON spec: ``[[name, shape, dtype], ...]``) on
``--device`` and answers the control and weight-update subset of SGLang's HTTP protocol with the
embedded engine's own receive code (``miles.engine.weights``: ``WeightGroups`` for broadcasts,
``deserialize_named_tensors`` for hand-offs, ``load_from_disk`` for disk versions) followed by an
in-place copy into the parameters, as ``ModelRunner.load_tensors`` does. No model, no generation:
used where the full engine cannot load (a 16 GB random-init model on the GPU machine). Each weight
answer carries ``recv_s`` and ``load_s`` so the benchmark can split transfer from engine load.

    python benchmarks/weight_sync_engine.py --spec spec.json --device cuda:1 --port 30000

``/bench_raw_broadcast {"group_name", "nbytes", "chunk_bytes"}`` receives a raw broadcast of ``nbytes``
into a scratch buffer (the rate baseline measured in the same run). ``/bench_weights_digest`` answers
``{name: sha256}`` of every parameter (``digests``; the benchmark compares them with the trainer's, every
tensor, after each configuration: JSON of 16 GB through ``/get_weights_by_name`` would take minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from aiohttp import web

from miles.engine.weights import WeightGroups, WeightUpdateError, deserialize_named_tensors, load_from_disk
from miles.weight_sync.buckets import dtype_from_str


class TorchEngine:
    def __init__(self, spec: list, device: str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.params = {n: torch.zeros([int(s) for s in shape], dtype=dtype_from_str(dt), device=self.device) for n, shape, dt in spec}
        self.groups = WeightGroups(self.device)
        self.version = "0"
        self.lock = asyncio.Lock()

    def load(self, named) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, t in named:
                p = self.params.get(name)
                if p is None or p.shape != t.shape or p.dtype != t.dtype:
                    raise WeightUpdateError(f"tensor {name!r} {tuple(t.shape)} {t.dtype} does not match this engine's parameter")
                p.copy_(t, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


def digests(named: Iterable[tuple[str, torch.Tensor]], threads: int = 8) -> dict[str, str]:
    """name -> sha256 of the tensor's dtype, shape and bytes (copied to the CPU; hashlib drops the GIL, so
    the hashing runs on ``threads`` cores)."""
    def one(t: torch.Tensor) -> str:
        t = t.detach().contiguous().cpu()
        h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return h.hexdigest()

    with ThreadPoolExecutor(threads) as pool:
        futs = {name: pool.submit(one, t) for name, t in named}
        return {name: f.result() for name, f in futs.items()}


def ok(**extra) -> web.Response:
    return web.json_response({"success": True, "message": "ok", **extra})


def build_app(eng: TorchEngine, timeout: float) -> web.Application:
    app = web.Application(client_max_size=1 << 30)

    async def health(_):
        return web.json_response({})

    async def noop(_):
        return ok()

    async def model_info(_):
        return web.json_response({"weight_version": eng.version})

    async def version(req):
        eng.version = (await req.json())["new_version"]
        return ok()

    async def init_group(req):
        b = await req.json()
        await asyncio.to_thread(eng.groups.init_group, b["master_address"], b["master_port"], b["rank_offset"], b["world_size"],
                                b["group_name"], b["backend"], timeout)
        return ok()

    async def destroy_group(req):
        await asyncio.to_thread(eng.groups.destroy_group, (await req.json())["group_name"])
        return ok()

    async def from_distributed(req):
        b = await req.json()
        async with eng.lock:
            def go():
                t0 = time.perf_counter()
                named = eng.groups.receive(b["group_name"], b["names"], b["dtypes"], b["shapes"], b.get("load_format"),
                                           b.get("p2p_ranges"))
                if eng.device.type == "cuda":
                    torch.cuda.synchronize(eng.device)
                return time.perf_counter() - t0, eng.load(named)
            recv_s, load_s = await asyncio.to_thread(go)
        if b.get("weight_version") is not None:
            eng.version = b["weight_version"]
        return ok(recv_s=recv_s, load_s=load_s)

    async def from_tensor(req):
        b = await req.json()
        async with eng.lock:
            def go():
                t0 = time.perf_counter()
                named = deserialize_named_tensors(b["serialized_named_tensors"][0], b.get("load_format"))
                return time.perf_counter() - t0, eng.load(named)
            recv_s, load_s = await asyncio.to_thread(go)
        if b.get("weight_version") is not None:
            eng.version = b["weight_version"]
        return ok(recv_s=recv_s, load_s=load_s)

    async def from_disk(req):
        b = await req.json()
        async with eng.lock:
            def go():
                t0 = time.perf_counter()
                state = load_from_disk(b["model_path"], eng.params)
                return time.perf_counter() - t0, eng.load(list(state.items()))
            try:
                recv_s, load_s = await asyncio.to_thread(go)
            except ValueError as e:
                return web.json_response({"success": False, "message": str(e)}, status=400)
        if b.get("weight_version") is not None:
            eng.version = b["weight_version"]
        return ok(recv_s=recv_s, load_s=load_s)

    async def weights_by_name(req):
        b = await req.json()
        t = eng.params[b["name"]]
        return web.json_response(t[: int(b.get("truncate_size", 100))].float().cpu().tolist())

    async def weights_digest(_):
        async with eng.lock:
            return web.json_response(await asyncio.to_thread(digests, eng.params.items()))

    async def raw(req):
        b = await req.json()

        def go():
            chunk = int(b["chunk_bytes"])
            buf = torch.empty(chunk, dtype=torch.uint8, device=eng.device)
            left = int(b["nbytes"])
            while left > 0:
                n = min(chunk, left)
                eng.groups._broadcast(b["group_name"], buf[:n], "raw")
                left -= n
            if eng.device.type == "cuda":
                torch.cuda.synchronize(eng.device)
        await asyncio.to_thread(go)
        return ok()

    r = app.router
    r.add_get("/health", health)
    r.add_get("/get_model_info", model_info)
    for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/begin_weight_update", "/end_weight_update"):
        r.add_post(path, noop)
    r.add_post("/update_weight_version", version)
    r.add_post("/init_weights_update_group", init_group)
    r.add_post("/destroy_weights_update_group", destroy_group)
    r.add_post("/update_weights_from_distributed", from_distributed)
    r.add_post("/update_weights_from_tensor", from_tensor)
    r.add_post("/update_weights_from_disk", from_disk)
    r.add_post("/get_weights_by_name", weights_by_name)
    r.add_post("/bench_raw_broadcast", raw)
    r.add_post("/bench_weights_digest", weights_digest)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    eng = TorchEngine(json.loads(open(a.spec).read()), a.device)
    web.run_app(build_app(eng, a.timeout), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
