"""Weight-sync benchmark: per mode and model size, where a sync's time goes, against a raw broadcast.

CPU (2 trainer ranks under torchrun, FSDP2 on gloo, the real ``FSDPTrainer``; 2 embedded engines)::

    python benchmarks/weight_sync.py cpu --sizes tiny,25m,100m --modes broadcast,p2p,tensor,disk-delta

(``p2p``: every trainer rank sends its own shard to the engines, so its "gather" column is packing only.)

GPU (2 GPUs: an FSDP2-sharded Qwen3-8B-shaped model, bf16, random init, trainer on cuda:0; the torch-only
engine of ``benchmarks/weight_sync_engine.py`` on cuda:1 (broadcast, NCCL) and another on cuda:0
(same-device CUDA-IPC hand-off))::

    python benchmarks/weight_sync.py gpu --bucket-mib 512,1024,2048 [--p2p]

Printed per row: gather (trainer: FSDP2 all-gather + packing), transfer (bytes on the wire / handles),
load (engine: received -> in its parameters), control (pause/begin/end/version/flush/continue), total
(gather to engine-ready, wall), effective GB/s = bytes / total, and the raw broadcast rate of the same
bytes measured in the same run (``raw``), with total/raw as the overhead factor.

Every configuration syncs weights its engine does not hold yet (every element of every shard changes
before it) and is verified afterwards on every tensor: CPU through ``--check-weight-update-equal``
(whole tensors through ``/get_weights_by_name``), GPU by sha256 digests of every tensor on both sides
(each must have changed and equal the trainer's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "benchmarks"))

SIZES = {  # name -> build_tiny_model kwargs (char-level vocab, so parameters sit in the layers)
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    "25m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4),
    "100m": dict(hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=6),
}
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False)
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _row(mode: str, size: str, r: dict, raw_gbps: float | None) -> str:
    gbps = r["bytes"] / r["total_s"] / 1e9 if r["total_s"] else 0.0
    raw = f"{raw_gbps:9.2f}" if raw_gbps else "        -"
    over = f"{(r['bytes'] / raw_gbps / 1e9) / r['total_s'] * 100:5.0f}%" if raw_gbps else "     -"
    return (f"{mode:<22}{size:<10}{r['bytes'] / 1e6:10.1f}{r['gather_s'] * 1e3:10.1f}{r['transfer_s'] * 1e3:10.1f}"
            f"{r['load_s'] * 1e3:10.1f}{r['control_s'] * 1e3:10.1f}{r['total_s'] * 1e3:10.1f}{gbps:8.2f}{raw} {over}")


HEADER = (f"{'mode':<22}{'size':<10}{'MB':>10}{'gather ms':>10}{'xfer ms':>10}{'load ms':>10}{'ctrl ms':>10}"
          f"{'total ms':>10}{'GB/s':>8}{'raw GB/s':>9} raw/total")


def _median(results: list) -> dict:
    keys = ("gather_s", "transfer_s", "load_s", "control_s", "total_s")
    out = {k: statistics.median(getattr(r, k) for r in results) for k in keys}
    out["bytes"] = results[0].bytes
    out["buckets"] = results[0].num_buckets
    return out


def _start_torch_engine(spec: list, device: str, work: Path, name: str, env: dict | None = None):
    from miles.spmd.supervisor import EngineSupervisor, scrubbed_env
    from miles.utils.net import find_free_port
    from miles.weight_sync.base import EngineTarget

    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    port = find_free_port()
    argv = [sys.executable, str(REPO / "benchmarks" / "weight_sync_engine.py"), "--spec", str(spec_path), "--device", device,
            "--port", str(port)]
    sup = EngineSupervisor(argv, env=scrubbed_env(extra={"PYTHONPATH": str(REPO), **(env or {})}), name=name,
                           log_path=work / f"{name}.log", max_restarts=0).start()
    return sup, EngineTarget(url=f"http://127.0.0.1:{port}")


def _start_embedded_engine(model_dir: str, log: Path):
    """``python -m miles.engine`` on CPU, supervised (scrubbed launcher env), one thread."""
    from miles.spmd.supervisor import EngineSupervisor, scrubbed_env
    from miles.utils.net import find_free_port
    from miles.weight_sync.base import EngineTarget

    port = find_free_port()
    argv = [sys.executable, "-m", "miles.engine", "--hf-checkpoint", model_dir, "--port", str(port), "--device", "cpu",
            "--max-running-requests", "4", "--weight-update-timeout", "600", "--log-level", "WARNING"]
    sup = EngineSupervisor(argv, env=scrubbed_env(extra={"OMP_NUM_THREADS": "1"}), name=f"engine-{port}", log_path=log,
                           max_restarts=0).start()
    return sup, EngineTarget(url=f"http://127.0.0.1:{port}")


def _wait_healthy(target, timeout: float = 300.0) -> None:
    from miles.fleet.client import SyncEngineControl

    ctl = SyncEngineControl(target.url, timeout=10)
    deadline = time.monotonic() + timeout
    try:
        while not ctl.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {target.url} not healthy after {timeout:.0f}s")
            time.sleep(0.5)
    finally:
        ctl.close()


def _raw_broadcast(sender, engines, nbytes: int, chunk: int) -> float:
    """Seconds for a raw broadcast of ``nbytes`` (``chunk`` at a time) on the sender's own group."""
    import torch

    from miles.weight_sync.base import Deadline

    group = sender._group
    dev = sender.device or torch.device("cpu")
    buf = torch.empty(chunk, dtype=torch.uint8, device=dev)
    deadline = Deadline(300, "raw broadcast")
    futs = sender.submit_all(engines, lambda c: c._post("/bench_raw_broadcast", {"group_name": group.name, "nbytes": nbytes,
                                                                                   "chunk_bytes": chunk}, 300))
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(chunk, left)
        group.broadcast(buf[:n])
        left -= n
    sender.wait_all(engines, futs, deadline, "raw broadcast")
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------- CPU
def cpu_launch(a: argparse.Namespace) -> None:
    from miles.utils.net import find_free_port
    from miles.utils.tiny_model import build_tiny_model

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    for size in a.sizes.split(","):
        if not (work / size / "config.json").is_file():
            build_tiny_model(work / size, **SIZES[size])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(find_free_port()),
           __file__, "_cpu_worker", "--work", str(work), "--sizes", a.sizes, "--modes", a.modes, "--repeats", str(a.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "MILES_LOG_LEVEL": "WARNING"}
    subprocess.run(cmd, check=True, env=env)


def _perturb(model, step: int, rank: int) -> None:
    import torch

    g = torch.Generator().manual_seed(7919 * step + rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(1e-4 * torch.randn(local.shape, generator=g).to(local.dtype))


def cpu_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from miles.config import parse_args
    from miles.trainer.build import build_trainer
    from miles.weight_sync.base import build_weight_sender

    rank = int(os.environ["RANK"])
    work = Path(a.work)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",))
    raw_sups, raw_engines = [], []
    if rank == 0:
        for i in range(2):
            s, t = _start_torch_engine([], "cpu", work, f"raw{i}", env={"OMP_NUM_THREADS": "1"})
            raw_sups.append(s)
            raw_engines.append(t)
    lines = []
    for size in a.sizes.split(","):
        model_dir = str(work / size)
        cfg = parse_args(["--train-backend", "fsdp", "--hf-checkpoint", model_dir, "--update-weight-timeout", "600",
                          "--update-weight-disk-dir", str(work / f"versions-{size}")], validate=False)
        trainer = build_trainer(cfg.train, cfg.algo, cfg.checkpoint, mesh=mesh, group=group, device=torch.device("cpu"),
                                rollout_temperature=1.0, num_rollout=1, global_batch_size=2, num_steps_per_rollout=1,
                                timeout=600)
        sups, engines = [], []
        if rank == 0:
            for i in range(2):
                s, t = _start_embedded_engine(model_dir, work / f"engine-{size}-{i}.log")
                sups.append(s)
                engines.append(t)
            for t in engines + raw_engines:
                _wait_healthy(t, 600)
        raw_gbps = None
        step = 0
        for mode in a.modes.split(","):
            wcfg = dataclasses.replace(cfg.weights, update_weight_transfer_mode=mode)
            kw = {"model_dir": model_dir} if mode == "disk-delta" else {}
            sender = build_weight_sender(wcfg, trainer, is_source=rank == 0, engines=engines, status_group=group, **kw)
            results = []
            for i in range(a.repeats + 1):
                step += 1
                _perturb(trainer.model, step, rank)
                r = sender.sync()
                if i > 0 or mode == "disk-delta":  # disk-delta: the first (full) sync is its own row
                    results.append(r)
                if mode == "disk-delta" and i == 0 and rank == 0:
                    lines.append(_row("disk-delta (full)", size, _median([r]), raw_gbps))
                    results.clear()
            checked = sender.check()
            if rank == 0:
                med = _median(results)
                if mode == "broadcast" and raw_gbps is None:
                    rs = build_weight_sender(wcfg, trainer, is_source=True, engines=raw_engines)
                    rs.connect(raw_engines)
                    secs = min(_raw_broadcast(rs, raw_engines, med["bytes"], wcfg.update_weight_buffer_size) for _ in range(3))
                    raw_gbps = med["bytes"] / secs / 1e9
                    rs.close()
                label = f"delta-xor {results[-1].extra.get('written_bytes', 0) / 1e6:.0f}MB" if mode == "disk-delta" else mode
                lines.append(_row(label[:21], size, med, raw_gbps))
                print(f"[{size}] {mode}: {checked} tensors verified bitwise on {len(engines)} engines", flush=True)
            sender.close()
        if rank == 0:
            for s in sups:
                s.stop()
        del trainer
        dist.barrier()
    if rank == 0:
        for s in raw_sups:
            s.stop()
        print("\nCPU, 2 trainer ranks (FSDP2, gloo) -> 2 embedded engines, median of", a.repeats, "syncs")
        print(HEADER)
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- GPU
class _Source:
    """The trainer's gather (``miles.trainer.weights.iter_full_params``) over an FSDP2-sharded model."""

    def __init__(self, model, group, device) -> None:
        self.model, self.group, self.device = model, group, device

    def iter_weight_buckets(self, bucket_bytes, dtype):
        from miles.trainer.modeling import hf_name
        from miles.trainer.weights import iter_full_params

        return iter_full_params(self.model, group=self.group, device=self.device, bucket_bytes=bucket_bytes, dtype=dtype,
                                name_fn=hf_name, timeout=300)

    def iter_weight_shards(self, bucket_bytes, dtype):
        import torch.distributed as dist

        from miles.trainer.modeling import hf_name
        from miles.weight_sync.p2p import iter_local_shards

        return iter_local_shards(self.model, rank=dist.get_rank(self.group), world=dist.get_world_size(self.group),
                                 bucket_bytes=bucket_bytes, dtype=dtype, device=self.device, name_fn=hf_name)


def gpu_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles.config import parse_args
    from miles.trainer import modeling
    from miles.utils.net import find_free_port
    from miles.weight_sync.base import build_weight_sender

    os.environ.update(NCCL_SAFE)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    smoke = a.cpu_smoke  # the same flow on CPU with a small model (gloo), to check it before spending GPU time
    dev = torch.device("cpu") if smoke else torch.device("cuda:0")
    dev_engine_b, dev_engine_t = ("cpu", "cpu") if smoke else ("cuda:1", "cuda:0")
    store = dist.TCPStore("127.0.0.1", find_free_port(), 1, True)
    if smoke:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    else:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    group = dist.group.WORLD
    mesh = DeviceMesh.from_group(group, dev.type, mesh_dim_names=("dp",))
    t0 = time.perf_counter()
    cfg_hf = Qwen3Config(**(dict(QWEN3_8B, vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=36,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64) if smoke else QWEN3_8B))
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(cfg_hf).to(torch.bfloat16)
    model = modeling.PolicyModel(hf)
    modeling.shard_model(model, modeling.decoder_blocks(hf), mesh)
    model.to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=g)
    if not smoke:
        torch.cuda.synchronize()
    named = [(modeling.hf_name(n), p) for n, p in model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for _, p in named)
    spec = [[n, list(p.shape), "bfloat16"] for n, p in named]
    print(f"model: {len(named)} tensors, {nbytes / 1e9:.2f} GB bf16, built in {time.perf_counter() - t0:.1f}s", flush=True)
    sup_b, eng_b = _start_torch_engine(spec, dev_engine_b, work, "engine-b", env=NCCL_SAFE)
    sup_t, eng_t = _start_torch_engine(spec, dev_engine_t, work, "engine-t", env=NCCL_SAFE)
    for e in (eng_b, eng_t):
        _wait_healthy(e)
    source = _Source(model, group, dev)
    lines, summary = [], {}
    base = parse_args(["--update-weight-timeout", "300"], validate=False).weights
    raw_gbps = None
    step = 0
    try:
        for mib, window in [(int(x), int(w)) for x in a.bucket_mib.split(",") for w in a.in_flight.split(",")]:
            wcfg = dataclasses.replace(base, update_weight_buffer_size=mib << 20, update_weight_transfer_mode="broadcast")
            s = build_weight_sender(wcfg, source, is_source=True, engines=[eng_b], device=None if smoke else dev,
                                    master_addr="127.0.0.1", max_in_flight=window)
            s.connect([eng_b])
            step += 1
            _perturb_all(model, step)
            before = _engine_digests(s, eng_b)
            if raw_gbps is None:
                secs = min(_raw_broadcast(s, [eng_b], nbytes, 1 << 30) for _ in range(3))
                raw_gbps = nbytes / secs / 1e9
                summary["raw_broadcast_s"] = secs
                print(f"raw NCCL broadcast of {nbytes / 1e9:.2f} GB in 1 GiB chunks: {secs * 1e3:.1f} ms ({raw_gbps:.0f} GB/s)", flush=True)
            res = [s.sync() for _ in range(a.repeats + 1)][1:]
            med = _median(res)
            summary[f"broadcast_{mib}MiB_inflight{window}"] = med
            lines.append(_row(f"broadcast {mib}MiB w{window}", "qwen3-8b", med, raw_gbps))
            print(lines[-1], flush=True)
            _verify(s, source, eng_b, before)
            s.close()
        for mib in ([int(x) for x in a.bucket_mib.split(",")] if a.p2p else []):
            # p2p from the one trainer rank: every byte is its own shard; the rows show its path's overhead
            wcfg = dataclasses.replace(base, update_weight_buffer_size=mib << 20, update_weight_transfer_mode="p2p")
            s = build_weight_sender(wcfg, source, is_source=True, engines=[eng_b], device=None if smoke else dev,
                                    master_addr="127.0.0.1")
            step += 1
            _perturb_all(model, step)
            before = _engine_digests(s, eng_b)
            res = [s.sync() for _ in range(a.repeats + 1)][1:]
            med = _median(res)
            summary[f"p2p_{mib}MiB"] = med
            lines.append(_row(f"p2p {mib}MiB", "qwen3-8b", med, raw_gbps))
            print(lines[-1], flush=True)
            _verify(s, source, eng_b, before)
            s.close()
        wcfg = dataclasses.replace(base, update_weight_buffer_size=(int(a.bucket_mib.split(",")[0])) << 20,
                                   update_weight_transfer_mode="tensor")
        ts = build_weight_sender(wcfg, source, colocate=True, is_source=True, engines=[eng_t], device=None if smoke else dev)
        step += 1
        _perturb_all(model, step)
        before = _engine_digests(ts, eng_t)
        res = [ts.sync() for _ in range(a.repeats + 1)][1:]
        med = _median(res)
        summary["tensor"] = med
        lines.append(_row("tensor (CUDA IPC)", "qwen3-8b", med, None))
        print(lines[-1], flush=True)
        _verify(ts, source, eng_t, before)
        ts.close()
    finally:
        sup_b.stop()
        sup_t.stop()
    print(f"\nGPU: Qwen3-8B-shaped ({len(named)} tensors, {nbytes / 1e9:.2f} GB bf16), FSDP2 trainer cuda:0 -> torch-only engine; "
          f"median of {a.repeats} syncs")
    print(HEADER)
    print("\n".join(lines), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


def _perturb_all(model, step: int) -> None:
    """Change every element of every local shard (the next configuration syncs weights no engine holds yet)."""
    import torch

    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(104729 + step)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.01 * torch.randn(local.shape, generator=g, device=dev, dtype=local.dtype))


def _engine_digests(sender, engine) -> dict[str, str]:
    from miles.weight_sync.base import Deadline

    return sender.call_all([engine], lambda c: c._post("/bench_weights_digest", {}, 600), Deadline(600, "digest"),
                           "bench_weights_digest")[0]


def _verify(sender, source, engine, before: dict[str, str]) -> None:
    """Every tensor of ``engine``: changed since ``before`` (its digests before this configuration's syncs) and
    equal to the trainer's, bitwise (sha256 of each tensor's bytes on both sides)."""
    import torch
    from weight_sync_engine import digests

    trainer = {}
    for bucket in source.iter_weight_buckets(1 << 30, torch.bfloat16):
        trainer.update(digests(bucket))
    got = _engine_digests(sender, engine)
    unchanged = [n for n in trainer if got.get(n) == before.get(n)]
    differ = [n for n in trainer if got.get(n) != trainer[n]]
    if sorted(got) != sorted(trainer) or unchanged or differ:
        raise SystemExit(f"verify {engine.url}: {len(differ)} of {len(trainer)} tensors differ from the trainer's "
                         f"({differ[:3]}), {len(unchanged)} unchanged by the sync ({unchanged[:3]}), "
                         f"names equal: {sorted(got) == sorted(trainer)}")
    print(f"verified all {len(trainer)} tensors bitwise (sha256) on {engine.url}: every one changed by this "
          f"configuration's syncs and equal to the trainer's", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("cpu", "_cpu_worker"):
        p = sub.add_parser(name)
        p.add_argument("--sizes", default="tiny,25m,100m")
        p.add_argument("--modes", default="broadcast,p2p,tensor,disk-delta")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--work", default="/tmp/miles_bench_weight_sync")
    g = sub.add_parser("gpu")
    g.add_argument("--bucket-mib", default="512,1024,2048")
    g.add_argument("--repeats", type=int, default=5)
    g.add_argument("--in-flight", default="1,2", help="Buckets awaiting the engine's answer (BroadcastSender max_in_flight).")
    g.add_argument("--work", default="/tmp/miles_bench_weight_sync_gpu")
    g.add_argument("--json", default=None)
    g.add_argument("--p2p", action="store_true", help="Also time --update-weight-transfer-mode p2p at each bucket size.")
    g.add_argument("--cpu-smoke", action="store_true", help="Run the GPU flow on CPU with a small model (a dry run).")
    a = ap.parse_args()
    {"cpu": cpu_launch, "_cpu_worker": cpu_worker, "gpu": gpu_main}[a.cmd](a)


if __name__ == "__main__":
    main()
