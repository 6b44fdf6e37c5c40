"""One rank of the weight-sync end-to-end job (run by torchrun, 2 ranks, gloo, CPU).

Real parts only: the FSDP2 trainer (``miles.trainer.fsdp.FSDPTrainer``) on 2 ranks, two embedded engine
servers (``python -m miles.engine``) started and restarted by rank 0 through ``EngineSupervisor``, and
every sender of ``miles.weight_sync``. Each scenario perturbs every shard of the trainer (a stand-in for
an optimizer step) and syncs; around the sync rank 0 takes a sha256 digest of every tensor of every engine
(through ``/get_weights_by_name``) and of the trainer's full tensors, so the results say, per engine, how
many tensors changed and how many equal the trainer's (``content``), besides ``--check-weight-update-equal``
(``checked``). A sync that moved nothing, or the wrong bytes, shows in both. Rank 0 writes the results as
JSON to ``--out``.

    torchrun --nproc-per-node 2 tests/multiprocess/weight_sync_worker.py --model DIR --work W --out R.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from miles.fleet.client import SyncEngineControl
from miles.spmd.supervisor import EngineSupervisor, scrubbed_env
from miles.utils.net import find_free_port
from miles.weight_sync import detached as bc_mod
from miles.weight_sync import disk_delta as dd
from miles.weight_sync.base import EngineTarget, WeightSyncError, build_weight_sender


def perturb(trainer, step: int, rank: int) -> None:
    """Change every local shard deterministically (a stand-in for an optimizer step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    with torch.no_grad():
        for p in trainer.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.01 * torch.randn(local.shape, generator=g, dtype=torch.float32).to(local.dtype))


def start_engine(model: str, log: Path, max_restarts: int = 0) -> tuple[EngineSupervisor, EngineTarget]:
    port = find_free_port()
    argv = [sys.executable, "-m", "miles.engine", "--hf-checkpoint", model, "--port", str(port), "--device", "cpu",
            "--max-running-requests", "4", "--weight-update-timeout", "30", "--log-level", "WARNING"]
    sup = EngineSupervisor(argv, env=scrubbed_env(extra={"OMP_NUM_THREADS": "1"}), name=f"engine-{port}", log_path=log,
                           max_restarts=max_restarts, restart_backoff=0.2).start()
    return sup, EngineTarget(url=f"http://127.0.0.1:{port}")


def call(target: EngineTarget, method: str, *args, **kwargs):
    ctl = SyncEngineControl(target.url, timeout=30)
    try:
        return getattr(ctl, method)(*args, **kwargs)
    finally:
        ctl.close()


def wait_healthy(target: EngineTarget, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not call(target, "health"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine {target.url} not healthy after {timeout}s")
        time.sleep(0.3)


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trainer_tensors(trainer) -> dict[str, tuple[str, torch.dtype, list[int]]]:
    """name -> (digest, dtype, shape) of every HF tensor the trainer exports, as the senders send it (dtype
    None: the trainer's own). Collective on every trainer rank; the full tensors (and the answer) are rank 0's."""
    out = {}
    for bucket in trainer.iter_weight_buckets(1 << 20, None):
        if dist.get_rank() == 0:
            out.update({name: (digest(t), t.dtype, list(t.shape)) for name, t in bucket})
    return out


def engine_digests(targets: list[EngineTarget], specs: dict) -> list[dict[str, str]]:
    """Per engine, name -> digest of that tensor as the engine serves it (whole tensors through
    /get_weights_by_name; JSON float64 holds every bf16/fp16/fp32 value exactly, so the digest is the
    trainer's when the bytes are)."""
    out = []
    for t in targets:
        ctl = SyncEngineControl(t.url, timeout=30)
        try:
            d = {}
            for name, (_, dtype, shape) in specs.items():
                values = ctl.get_weights_by_name(name, truncate_size=1 << 30)
                d[name] = digest(torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype))
            out.append(d)
        finally:
            ctl.close()
    return out


def content(before: list[dict[str, str]], after: list[dict[str, str]], trainer: dict) -> dict:
    """Per engine: how many tensors changed in the sync and how many now equal the trainer's."""
    return {"tensors": len(trainer),
            "changed": [sum(b[k] != a[k] for k in trainer) for b, a in zip(before, after)],
            "equal": [sum(a[k] == trainer[k][0] for k in trainer) for a in after]}


def version_of(target: EngineTarget) -> str:
    return str(call(target, "get_model_info")["weight_version"])


class StallingSource:
    """The trainer, but rank 0 stops (SIGSTOP) an engine once ``at_bucket`` buckets were gathered."""

    def __init__(self, trainer, sup: EngineSupervisor | None, at_bucket: int) -> None:
        self.trainer, self.sup, self.at_bucket = trainer, sup, at_bucket

    def iter_weight_buckets(self, bucket_bytes, dtype):
        for i, bucket in enumerate(self.trainer.iter_weight_buckets(bucket_bytes, dtype)):
            if i == self.at_bucket and self.sup is not None:
                self.sup.kill(signal.SIGSTOP)
            yield bucket

    def iter_weight_shards(self, bucket_bytes, dtype):
        for i, bucket in enumerate(self.trainer.iter_weight_shards(bucket_bytes, dtype)):
            if i == self.at_bucket and self.sup is not None:
                self.sup.kill(signal.SIGSTOP)
            yield bucket


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    work = Path(a.work)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    group = dist.group.WORLD
    from trainer_harness import build_from_config, parse

    cfg = parse(a.model, ["--train-backend", "fsdp", "--update-weight-buffer-size", "64KiB", "--update-weight-timeout",
                          "30", "--update-weight-disk-dir", str(work / "versions"), "--pause-generation-mode", "retract"])
    trainer = build_from_config(cfg, group=group)
    sups, engines = [], []
    if rank == 0:
        for i in range(2):
            s, t = start_engine(a.model, work / f"engine{i}.log", max_restarts=1)
            sups.append(s)
            engines.append(t)
        for t in engines:
            wait_healthy(t)
    res: dict = {"scenarios": {}}

    def record(name: str, r, **extra) -> None:
        res["scenarios"][name] = {"version": r.version, "total_s": r.total_s, "buckets": r.num_buckets, "bytes": r.bytes,
                                  "gather_s": r.gather_s, "transfer_s": r.transfer_s, "load_s": r.load_s, **extra}

    def sender(mode: str, **kw):
        c = dataclasses.replace(cfg.weights, update_weight_transfer_mode=mode, **kw.pop("cfg", {}))
        return build_weight_sender(c, kw.pop("source", trainer), is_source=rank == 0, engines=engines, status_group=group,
                                   initial_version=kw.pop("initial_version", 0), **kw)

    specs = trainer_tensors(trainer)

    def verified(name: str, s, run=None, **extra):
        """Sync with ``s`` (or ``run()``), then check every engine against the trainer; collective."""
        before = engine_digests(engines, specs)
        r = s.sync() if run is None else run()
        checked = s.check()
        after, now = engine_digests(engines, specs), trainer_tensors(trainer)
        record(name, r, checked=checked, content=content(before, after, now), **extra)
        return r

    # 1. broadcast, flattened buckets, then the per-tensor path (SGLang's: one broadcast per tensor)
    perturb(trainer, 1, rank)
    bc = sender("broadcast")
    bc.connect(engines)
    r = verified("broadcast_flat", bc)
    bc.close()
    perturb(trainer, 12, rank)
    pt = sender("broadcast", flatten=False, initial_version=r.version)
    pt.connect(engines)
    r = verified("broadcast_per_tensor", pt)
    pt.close()
    version = r.version
    if rank == 0:
        res["versions_after_broadcast"] = [version_of(t) for t in engines]

    # 1a. a detached whole sync (train_async.py): the whole model in one bucket, one request per engine; sync returns
    #     once the weights are packed, the trainer steps on at once, and the engines still get the weights of the
    #     sync (landed later); a detached sync followed at once by another is landed by it
    perturb(trainer, 14, rank)
    wd = sender("broadcast", initial_version=version, cfg={"update_weight_buffer_size": 1 << 30})
    wd.connect(engines)
    before, sent = engine_digests(engines, specs), trainer_tensors(trainer)
    r = wd.sync(detach=True, rollout_id=14)
    in_flight = wd.detached_in_flight
    perturb(trainer, 15, rank)                   # the next optimizer step, while the engines may still be loading
    wd.land()
    landed = wd.take_landed()                    # what the thread measured (rank 0's; None elsewhere)
    after = engine_digests(engines, specs)
    record("broadcast_detached", r, content=content(before, after, sent), detached=r.extra.get("detached", 0.0),
           in_flight=in_flight, landed=not wd.detached_in_flight, versions=[version_of(t) for t in engines],
           metrics=r.as_metrics(), landed_metrics=landed.as_metrics() if landed is not None else None)
    wd.sync(detach=True)                          # (the weights of step 15)
    perturb(trainer, 16, rank)
    before = engine_digests(engines, specs)
    r = wd.sync()                                 # lands the detached one, then a plain sync of step 16's weights
    record("broadcast_after_detached", r, checked=wd.check(), detached=r.extra.get("detached", 0.0),
           content=content(before, engine_digests(engines, specs), trainer_tensors(trainer)))
    wd.close()
    version = r.version

    # 1a'. a detached sync of tensors the trainer changes in place right after sync returns (a source that hands
    #      over its own tensors, the same objects at every call, as a backend exporting its parameters without a
    #      copy would), the sender thread held at its start until they changed: the engines must get the values
    #      of the call, so the bucket is packed (copied) before sync returns
    class LiveSource:
        def __init__(self) -> None:
            self.buckets = list(trainer.iter_weight_buckets(1 << 30, None))  # collective: gathered once

        def iter_weight_buckets(self, bucket_bytes, dtype):
            return iter(self.buckets)

    class HeldThreading:  # detached.py's threading, the detached sync's thread held until release
        def __init__(self) -> None:
            self.release, self.held = threading.Event(), 0

        def __getattr__(self, name):
            return getattr(threading, name)

        def Thread(self, *args, target=None, name=None, **kwargs):  # noqa: N802 - threading.Thread's name
            if name == "miles-weight-detached":
                self.held += 1
                inner = target

                def target(*a, **k):
                    self.release.wait(60)
                    return inner(*a, **k)
            return threading.Thread(*args, target=target, name=name, **kwargs)

    perturb(trainer, 17, rank)
    live = LiveSource()
    live_specs = {n: (digest(t), t.dtype, list(t.shape)) for b in live.buckets for n, t in b}
    wl = sender("broadcast", initial_version=version, cfg={"update_weight_buffer_size": 1 << 30}, source=live)
    wl.connect(engines)
    before = engine_digests(engines, specs)
    held = HeldThreading()
    bc_mod.threading = held
    try:
        r = wl.sync(detach=True)
        with torch.no_grad():
            for b in live.buckets:
                for _, t in b:
                    t.add_(1.0)          # the next optimizer step, before the sender thread ran at all
        held.release.set()
        wl.land()
    finally:
        held.release.set()
        bc_mod.threading = threading
    after = engine_digests(engines, specs)
    mutated = {n: (digest(t), t.dtype, list(t.shape)) for b in live.buckets for n, t in b}
    record("broadcast_detached_live", r, detached=r.extra.get("detached", 0.0), held=held.held,
           content=content(before, after, live_specs), equal_to_mutated=content(before, after, mutated)["equal"])
    wl.close()
    version = r.version

    # 1b'. a detached sync the engines refuse (a tensor they do not have): sync returns, land raises naming the
    #      engines, and the sender's version goes back to what the engines hold
    class BogusSource:
        def iter_weight_buckets(self, bucket_bytes, dtype):
            for i, bucket in enumerate(trainer.iter_weight_buckets(bucket_bytes, dtype)):
                yield bucket + ([("no.such.weight", torch.zeros(3))] if i == 0 else [])

    bad = sender("broadcast", initial_version=version, cfg={"update_weight_buffer_size": 1 << 30}, source=BogusSource())
    bad.connect(engines)
    rb = bad.sync(detach=True)
    try:
        bad.land()
        refused = None
    except WeightSyncError as e:
        refused = str(e)
    res["detached_refused"] = {"detached": rb.extra.get("detached", 0.0), "version": rb.version, "error": refused,
                               "version_after": bad.weight_version, "urls": [t.url for t in engines]}
    bad.close()

    # 1b. p2p: each trainer rank sends its own FSDP2 rows straight to the engines (no gather), then a broadcast
    #     of the next state: each leaves every engine tensor changed and equal to the trainer's
    perturb(trainer, 7, rank)
    p2 = sender("p2p", initial_version=version)
    p2.connect(engines)
    r = verified("p2p", p2)
    sent = [None] * dist.get_world_size()
    dist.all_gather_object(sent, r.extra["sent_bytes"])
    res["scenarios"]["p2p"]["sent_per_rank"] = sent
    perturb(trainer, 13, rank)
    bc2 = sender("broadcast", initial_version=r.version)
    bc2.connect(engines)
    r = verified("broadcast_after_p2p", bc2)
    bc2.close()
    version = r.version
    if rank == 0:
        res["versions_after_p2p"] = [version_of(t) for t in engines]

    # 2. same-device hand-off (shared memory on CPU)
    perturb(trainer, 2, rank)
    ts = sender("tensor", initial_version=version)
    r = verified("tensor", ts)
    version = r.version
    ts.close()

    # 3. disk-delta: full, then xor delta, then a delta with a flipped byte -> refused -> full fallback
    dk = sender("disk-delta", initial_version=version, model_dir=a.model)
    perturb(trainer, 3, rank)
    verified("disk_full", dk)
    perturb(trainer, 4, rank)
    r = verified("disk_delta", dk)
    res["scenarios"]["disk_delta"].update(fallbacks=dk.fallbacks, written=r.extra.get("written_bytes"))
    real_write = dd.write_version

    def corrupting_write(*args, **kwargs):
        path = real_write(*args, **kwargs)
        if dd.is_delta_dir(path):
            m = json.loads((path / dd.DELTA_MANIFEST).read_text())
            f = path / next(e["file"] for e in m["tensors"] if e["file"])
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x40
            f.write_bytes(bytes(data))
        return path

    perturb(trainer, 5, rank)
    dd.write_version = corrupting_write
    try:
        r = verified("disk_corrupt_fallback", dk)
    finally:
        dd.write_version = real_write
    res["scenarios"]["disk_corrupt_fallback"]["fallbacks"] = dk.fallbacks
    version = r.version
    if rank == 0:  # a delta dir with a missing piece is refused by the engine itself, naming the file
        perturb_dir = sorted((work / "versions").glob("delta_v*"))[-1]
        m = json.loads((perturb_dir / dd.DELTA_MANIFEST).read_text())
        (perturb_dir / next(e["file"] for e in m["tensors"] if e["file"])).unlink()
        try:
            call(engines[0], "update_weights_from_disk", str(perturb_dir))
            res["missing_piece"] = "accepted"
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            res["missing_piece"] = str(e)
    dk.close()

    # 4. an engine stalls (SIGSTOP) in the middle of a broadcast: the sync fails within its timeout
    perturb(trainer, 6, rank)
    stall = sender("broadcast", initial_version=version, cfg={"update_weight_timeout": 8.0},
                   source=StallingSource(trainer, sups[1] if rank == 0 else None, at_bucket=2))
    stall.connect(engines)
    t0 = time.monotonic()
    try:
        stall.sync()
        res["stall"] = {"error": None}
    except WeightSyncError as e:
        res["stall"] = {"error": str(e), "elapsed_s": time.monotonic() - t0, "stalled_url": engines[1].url if engines else None}
    # 5. the stalled engine is killed and restarted by its supervisor; the group is re-formed with the
    #    live engines and a full sync brings everyone to the next version
    if rank == 0:
        sups[1].kill(signal.SIGKILL)
        sups[1].kill(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while sups[1].restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        wait_healthy(engines[1])
        res["restarts"] = sups[1].restarts
    stall.source = trainer
    stall.cfg = dataclasses.replace(stall.cfg, update_weight_timeout=30.0)
    stall.reconnect(engines)
    perturb(trainer, 14, rank)  # engine 0 may hold some buckets of the stalled sync's state: a new one
    r = verified("after_restart", stall)
    if rank == 0:
        res["versions_after_restart"] = [version_of(t) for t in engines]
        res["expected_version"] = str(stall.weight_version)
    # 6. a newcomer gets the current version before it is routed to (sync_one), nothing else moves
    if rank == 0:
        sups[0].kill(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while sups[0].restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        wait_healthy(engines[0])
        res["newcomer_version_before"] = version_of(engines[0])
    stall.reconnect(engines)
    # the trainer has not stepped (sync_one's contract): only the newcomer, restarted from the model dir, changes
    verified("sync_one", stall, run=lambda: stall.sync_one(engines[0] if rank == 0 else None))
    if rank == 0:
        res["versions_after_sync_one"] = [version_of(t) for t in engines]
    stall.close()
    # 7. p2p after both engines were restarted: its old group is gone on the engines; reconnect (source only,
    #    as miles.ft does) and the next sync forms a new group on every trainer rank
    perturb(trainer, 8, rank)
    if rank == 0:
        p2.reconnect(engines)
    p2.weight_version = stall.weight_version  # the run's current version (this sender sat out scenarios 2-6)
    verified("p2p_after_restart", p2)
    res["scenarios"]["p2p_after_restart"]["group"] = p2.group_name
    p2.close()
    # 7a. p2p from a trainer that exposes only full buckets (as the Megatron backend): each rank sends its
    #     dim-0 share of the gathered tensors
    class FullOnly:
        def iter_weight_buckets(self, bucket_bytes, dtype):
            return trainer.iter_weight_buckets(bucket_bytes, dtype)

    perturb(trainer, 11, rank)
    p2f = sender("p2p", initial_version=p2.weight_version, source=FullOnly())
    r = verified("p2p_full_buckets", p2f)
    sent = [None] * dist.get_world_size()
    dist.all_gather_object(sent, r.extra["sent_bytes"])
    res["scenarios"]["p2p_full_buckets"]["sent_per_rank"] = sent
    p2.weight_version = p2f.weight_version
    p2f.close()
    # 7b. p2p where the engines refuse a bucket (rank 1's ranges as the source posts them leave a gap): the
    #     refusal ends the sync on BOTH trainer ranks at once, not when rank 1's sends time out
    from miles.weight_sync import p2p as p2p_mod

    real_plan = p2p_mod.plan_bucket

    def gapped_plan(bucket, world):
        plan = real_plan(bucket, world)
        plan.ranges[1][0][0] += 1
        return plan

    if rank == 0:
        p2p_mod.plan_bucket = gapped_plan
    perturb(trainer, 10, rank)
    p2r = sender("p2p", initial_version=p2.weight_version)
    t0 = time.monotonic()
    try:
        p2r.sync()
        outcome = {"error": None}
    except WeightSyncError as e:
        outcome = {"error": str(e), "elapsed_s": time.monotonic() - t0}
    finally:
        p2p_mod.plan_bucket = real_plan
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    res["p2p_refused"] = outcomes
    p2r.close()
    # 8. p2p with an engine that stalls (SIGSTOP) mid-sync: every trainer rank fails within the timeout
    perturb(trainer, 9, rank)
    p2s = sender("p2p", initial_version=p2.weight_version, cfg={"update_weight_timeout": 8.0},
                 source=StallingSource(trainer, sups[0] if rank == 0 else None, at_bucket=2))
    t0 = time.monotonic()
    try:
        p2s.sync()
        outcome = {"error": None}
    except WeightSyncError as e:
        outcome = {"error": str(e), "elapsed_s": time.monotonic() - t0}
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    res["p2p_stall"] = {"per_rank": outcomes, "stalled_url": engines[0].url if engines else None}
    if rank == 0:
        sups[0].kill(signal.SIGKILL)
        sups[0].kill(signal.SIGCONT)
    p2s.close()
    if rank == 0:
        for s in sups:
            s.stop()
        Path(a.out).write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
