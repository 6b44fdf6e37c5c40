"""--offload-train-target disk on both trainer backends, 2 real gloo ranks (torchrun, CPU): three rollouts, each
through the run's own Worker (onload_train, the trainer's train, offload_train, then a checkpoint while paused,
which reads the state back for it and frees it again). While paused every spilled storage is empty (the disk target
spills on CPU too: it frees host memory), each rank's files are under <dir>/rank_<rank>/, the weight export a sync
reads (``resident(weights_only=True)``) equals the weights before the pause; after onload every weight and AdamW
tensor is bitwise what it was, in the same objects. The same run with the CPU target (a no-op on CPU) gives the
same losses, the same final weights and the same checkpoints (every tensor), bit for bit; the files are gone when the ranks exit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from _torchrun import torchrun_self

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
ROLLOUTS = 3


def _digest(tensors: dict) -> dict[str, str]:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in sorted(tensors.items())}


def _worker(model_dir: str, out: str, backend: str, target: str) -> None:
    import torch
    import torch.distributed as dist
    from trainer_harness import build, export_by_name, random_samples

    from miles.run.worker import Worker
    from miles.trainer.disk_offload import storage_bytes, tensors_of

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spill = Path(out) / "spill"
    disk = ["--offload-train-target", "disk", "--offload-train-disk-dir", str(spill),
            "--offload-train-disk-chunk-mb", "1"] if target == "disk" else []
    tr = build(model_dir, ["--train-backend", backend, "--rollout-batch-size", "4", "--num-rollout", str(ROLLOUTS),
                           "--lr", "1e-2", "--offload-train", "--save", f"{out}/ckpt_{target}", "--save-interval", "1",
                           *disk])
    worker = Worker(None, None, timeout=120, trainer=tr)      # the run's trainer-rank commands
    res: dict = {"loss": [], "freed": [], "export_same": [], "restored": [], "files": [], "paused_after_save": []}
    for rid in range(ROLLOUTS):
        worker.onload_train()
        samples = random_samples(2, 2, seed=10 * rid + rank, vocab=tr.vocab_size, first_group=2 * rank)
        res["loss"].append(tr.train(samples, rollout_id=rid)["loss"])
        groups = tensors_of(*tr._offload_parts())
        locals_ = [getattr(t, "_local_tensor", t) for k in groups for t in groups[k]]
        before = [t.detach().clone() for t in locals_]
        exported = export_by_name(tr, 1 << 20) if target == "disk" else {}
        worker.offload_train()
        if target == "disk":
            res["freed"].append(all(storage_bytes(t) == 0 for t in locals_))
            res["files"] = sorted(p.name for p in tr._disk.dir.iterdir())
            res["dir"] = str(tr._disk.dir)
            with tr.resident(weights_only=True):            # what Worker.sync_weights does around the sender
                during = export_by_name(tr, 1 << 20)
            res["export_same"].append(_digest(during) == _digest(exported))
        worker.save(rid, {"rollout_id": rid})               # the checkpoint of a paused trainer
        res["paused_after_save"].append(tr._disk.spilled if tr._disk is not None else None)
        worker.onload_train()
        after = [getattr(t, "_local_tensor", t) for k in groups for t in groups[k]]
        res["restored"].append(all(a is b and torch.equal(a, c) for a, b, c in zip(after, locals_, before)))
        worker.offload_train()
    worker.onload_train()
    res["final"] = _digest(export_by_name(tr, 1 << 20))
    Path(out, f"{target}_rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _flat(x, pre: str = "") -> dict:
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flat(val, f"{pre}{key}/").items()}
    if isinstance(x, (list, tuple)):
        return {k: v for i, val in enumerate(x) for k, v in _flat(val, f"{pre}{i}/").items()}
    return {pre: x}


def _checkpoint_contents(path: Path, tmp: Path) -> dict[str, str]:
    """Every value of every checkpoint under ``path`` (its DCP directories read back through
    ``dcp_to_torch_save``; FSDP's rng/*.pt files), by key, as bytes digests; Python's and numpy's RNG states left out
    (each launch's own: the trainer seeds torch only)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out: dict[str, str] = {}
    for meta in sorted(path.rglob(".metadata")):
        dump = tmp / "dcp.pt"
        dcp_to_torch_save(meta.parent, dump)
        for k, v in _flat(torch.load(dump, weights_only=False)).items():
            if "random_rng_state" in k or "np_rng_state" in k:
                continue
            raw = v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v)
            out[f"{meta.parent.relative_to(path)}:{k}"] = hashlib.sha256(raw if isinstance(raw, bytes)
                                                                         else raw.encode()).hexdigest()
    for f in sorted(path.rglob("rng/*.pt")):
        out[str(f.relative_to(path))] = hashlib.sha256(torch.load(f, weights_only=False)["torch"].numpy()
                                                       .tobytes()).hexdigest()
    return out


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_disk_offload_on_both_backends(tiny_model_dir: Path, tmp_path: Path, free_port: int, backend: str) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    res = {}
    for target in ("disk", "cpu"):
        proc = torchrun_self(HERE, 2, free_port, str(tiny_model_dir), str(tmp_path), backend, target, timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:]
        res[target] = [json.loads((tmp_path / f"{target}_rank{r}.json").read_text()) for r in range(2)]
    for rank, (disk, cpu) in enumerate(zip(res["disk"], res["cpu"])):
        assert disk["dir"] == str(tmp_path / "spill" / f"rank_{rank}"), disk["dir"]
        assert disk["files"] == ["optimizer.bin", "weights.bin"], disk["files"]
        assert disk["freed"] == [True] * ROLLOUTS and disk["export_same"] == [True] * ROLLOUTS
        assert disk["restored"] == [True] * ROLLOUTS and disk["paused_after_save"] == [True] * ROLLOUTS
        assert disk["loss"] == cpu["loss"] and disk["final"] == cpu["final"]
    assert not (tmp_path / "spill" / "rank_0").exists() and not (tmp_path / "spill" / "rank_1").exists()
    ckpt = {t: _checkpoint_contents(tmp_path / f"ckpt_{t}", tmp_path) for t in ("disk", "cpu")}
    assert len(ckpt["disk"]) > 10 and ckpt["disk"] == ckpt["cpu"]


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
