"""--offload-train-target disk (miles/trainer/disk_offload.py) on CPU, with real tensors and real files: a model and
its AdamW state spilled to the rank's files (their memory freed: every storage 0 bytes), read back bit for bit into
the same Parameter objects, views and optimizer state, and training goes on exactly as without the spill; readers
get the weights back while the rest stays on disk; file errors are one line naming the path and the flag. Then the
FSDP trainer's own offload()/onload() on one gloo rank (the disk target spills on CPU too: it frees host memory)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from trainer_harness import build, flags, random_samples

from miles.trainer.disk_offload import DiskOffload, filesystem_type, storage_bytes, tensors_of
from miles.utils import exit_cleanup
from miles.utils.errors import MilesError

CHUNK = 1000          # bytes: smaller than most tensors here and dividing none of them (every chunk boundary runs)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 24))
    m.register_buffer("scale", torch.linspace(0.5, 1.5, 24))
    return m


def _step(m: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 24, generator=g)
    opt.zero_grad(set_to_none=False)             # gradients stay allocated: they are spilled too
    ((m(x) * m.scale) ** 2).mean().backward()
    opt.step()


def _trained(steps: int = 2):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    for s in range(steps):
        _step(m, opt, s)
    return m, opt


def _snapshot(m, opt) -> list[torch.Tensor]:
    groups = tensors_of([m], [opt])
    return [t.detach().clone() for k in ("weights", "optimizer") for t in groups[k]]


def _storages(m, opt) -> list[int]:
    groups = tensors_of([m], [opt])
    return [storage_bytes(t) for k in ("weights", "optimizer") for t in groups[k]]


def test_spill_frees_the_memory_and_restores_bitwise_into_the_same_objects(tmp_path):
    m, opt = _trained()
    params = list(m.parameters())
    view = m[0].weight[3]                                   # a view made before the spill
    state_keys = list(opt.state)
    state_tensors = [v for st in opt.state.values() for v in st.values()]
    before = _snapshot(m, opt)
    disk = DiskOffload(tmp_path / "spill", rank=3, chunk_bytes=CHUNK, device="cpu")
    assert disk.dir == tmp_path / "spill" / "rank_3" and disk.dir.is_dir()

    written = disk.offload(tensors_of([m], [opt]))
    params_bytes = sum(p.numel() * 4 for p in params) + 24 * 4           # parameters + the buffer
    adam_bytes = sum(p.numel() * 4 * 3 for p in params) + 4 * len(params)  # grads, two moments, step scalars
    assert written == params_bytes + adam_bytes
    assert disk.path("weights").stat().st_size == params_bytes
    assert disk.path("optimizer").stat().st_size == adam_bytes
    assert disk.spilled and all(n == 0 for n in _storages(m, opt))         # the memory is gone

    assert disk.onload() == written and not disk.spilled
    after = _snapshot(m, opt)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, after))
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    assert list(opt.state) == state_keys and all(k is p for k, p in zip(opt.state, params))
    assert all(a is b for a, b in zip([v for st in opt.state.values() for v in st.values()], state_tensors))
    assert torch.equal(view, m[0].weight[3])                 # the view sees the restored memory
    m[0].weight.data[3, 0] = 7.0
    assert view[0].item() == 7.0
    disk.close()
    assert not disk.dir.exists()


def test_training_after_the_spill_equals_training_without_it(tmp_path):
    a, opt_a = _trained()
    b, opt_b = _trained()                                    # the same run, never spilled
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(a, opt_a), _snapshot(b, opt_b)))
    disk = DiskOffload(tmp_path, rank=0, chunk_bytes=CHUNK, device="cpu")
    for s in range(2, 5):                                    # spill and restore before each further step
        disk.offload(tensors_of([a], [opt_a]))
        disk.onload()
        _step(a, opt_a, s)
        _step(b, opt_b, s)
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(a, opt_a), _snapshot(b, opt_b)))
    assert not torch.equal(a[0].weight, _trained()[0][0].weight)    # it did train
    disk.close()


def test_a_reader_gets_the_weights_back_and_they_are_freed_again_unwritten(tmp_path):
    m, opt = _trained()
    before = _snapshot(m, opt)
    disk = DiskOffload(tmp_path, rank=0, chunk_bytes=CHUNK, device="cpu")
    disk.offload(tensors_of([m], [opt]))
    stamp = {k: disk.path(k).stat().st_mtime_ns for k in ("weights", "optimizer")}
    with disk.resident(("weights",)):
        assert torch.equal(m[2].weight, before[4])               # readable: the weights are back
        assert all(v.untyped_storage().nbytes() == 0 for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))                # the optimizer state is still on disk only
    assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())
    assert {k: disk.path(k).stat().st_mtime_ns for k in stamp} == stamp   # nothing was written
    disk.onload()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(m, opt)))
    disk.close()


def test_file_errors_are_one_line_naming_the_path_and_the_flag(tmp_path):
    m, opt = _trained()
    before = _snapshot(m, opt)
    disk = DiskOffload(tmp_path / "d", rank=0, chunk_bytes=CHUNK, device="cpu")
    disk.path("weights").mkdir()                             # a directory where the file goes: the write fails
    with pytest.raises(MilesError, match=r"^--offload-train-disk-dir .*/d: cannot write the trainer's spill file "
                                         r".*/d/rank_0/weights\.bin \(.*\); free space"):
        disk.offload(tensors_of([m], [opt]))
    assert not disk.spilled and all(torch.equal(x, y) for x, y in zip(before, _snapshot(m, opt)))  # nothing freed
    disk.path("weights").rmdir()
    disk.offload(tensors_of([m], [opt]))
    with open(disk.path("optimizer"), "r+b") as f:           # cut short behind the trainer's back
        f.truncate(100)
    with pytest.raises(MilesError, match=r"^--offload-train-disk-dir .*: cannot read the trainer's spill file "
                                         r".*/optimizer\.bin back \(the file ends at byte 100, .*\); the trainer state"):
        disk.onload()
    assert "\n" not in str(pytest.raises(MilesError, DiskOffload, tmp_path / "d" / "rank_0" / "weights.bin",
                                         rank=0, chunk_bytes=CHUNK, device="cpu").value)


def test_the_directory_is_emptied_at_start_and_removed_at_exit(tmp_path):
    stale = tmp_path / "rank_1" / "weights.bin"
    stale.parent.mkdir()
    stale.write_bytes(b"left by a killed start")
    disk = DiskOffload(tmp_path, rank=1, chunk_bytes=CHUNK, device="cpu")
    assert disk.dir.is_dir() and not stale.exists()
    with pytest.raises(RuntimeError, match="already the spill directory of another trainer"):
        DiskOffload(tmp_path, rank=1, chunk_bytes=CHUNK, device="cpu")
    m, opt = _trained(1)
    disk.offload(tensors_of([m], [opt]))
    exit_cleanup.run()                                       # what atexit and miles.spmd.errors' exits run
    assert not disk.dir.exists()
    assert filesystem_type("/proc") == "proc"                # the tmpfs warning's lookup reads /proc/mounts


def _spill_flags(tmp_path, extra=()) -> list[str]:
    return flags("fsdp", ["--lr", "1e-2", "--offload-train", *extra],
                 ["--offload-train-target", "disk", "--offload-train-disk-dir", str(tmp_path),
                  "--offload-train-disk-chunk-mb", "1"])


def test_fsdp_trainer_offloads_to_disk_on_cpu(tiny_model_dir, one_rank_group, tmp_path):
    """The trainer's own offload()/onload(): PPO (so the critic and its AdamW spill too), one gloo rank, CPU."""
    samples = random_samples(2, 2, seed=0, vocab=90)
    ppo = ["--advantage-estimator", "ppo"]
    ref = build(tiny_model_dir, flags("fsdp", ["--lr", "1e-2", *ppo]), group=one_rank_group)
    tr = build(tiny_model_dir, _spill_flags(tmp_path, ppo), group=one_rank_group)
    assert tr._disk is not None and tr._disk.dir == tmp_path / "rank_0"
    ref.train(samples, 0)
    tr.train(samples, 0)
    before = tr.state_dict_for_check()
    tr.offload()
    modules, optimizers = tr._offload_parts()
    assert tr.critic.model in modules and tr.critic.optimizer in optimizers
    spilled = tensors_of(modules, optimizers)
    dtensors = sum(type(t).__name__ == "DTensor" for k in spilled for t in spilled[k])   # the critic is FSDP2's
    freed = all(storage_bytes(t) == 0 for k in spilled for t in spilled[k])   # (never repr a spilled tensor)
    assert len(spilled["optimizer"]) > 0 and dtensors > 0 and freed
    with pytest.raises(RuntimeError, match="spilled to disk .* call onload"):
        tr.train(samples, 1)
    with tr.resident(weights_only=True):                     # what the worker's weight sync does
        during = tr.state_dict_for_check()
    assert all(torch.equal(before[k], during[k]) for k in before)
    tr.onload()
    assert all(torch.equal(before[k], v) for k, v in tr.state_dict_for_check().items())
    m_ref, m = ref.train(samples, 1), tr.train(samples, 1)
    assert m["loss"] == m_ref["loss"] and m["grad_norm"] == m_ref["grad_norm"]
    exp_ref, exp = ref.state_dict_for_check(), tr.state_dict_for_check()
    assert all(torch.equal(exp_ref[k], exp[k]) for k in exp_ref)


@pytest.mark.gpu
def test_trainer_offload_to_disk_on_gpu_frees_device_memory(tiny_model_dir, one_rank_group, tmp_path):
    """On a GPU (one rank): offload to disk drops torch.cuda.memory_allocated by at least the bytes spilled (all of
    them device tensors here), onload restores every weight, gradient and AdamW tensor bitwise, and training goes on."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    samples = random_samples(2, 2, seed=0, vocab=90)
    tr = build(tiny_model_dir, _spill_flags(tmp_path), group=one_rank_group, device="cuda:0")
    tr.train(samples, 0)
    groups = tensors_of(*tr._offload_parts())
    assert all(t.device.type == "cuda" for k in groups for t in groups[k])
    before = [t.detach().clone() for k in groups for t in groups[k]]
    torch.cuda.synchronize()
    on = torch.cuda.memory_allocated()
    tr.offload()
    off = torch.cuda.memory_allocated()
    spilled = tr._disk.spilled_bytes
    tr.onload()
    assert spilled > 0 and on - off >= spilled, (on, off, spilled)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for k in groups for t in groups[k]]))
    assert math.isfinite(tr.train(samples, 1)["loss"])      # training goes on (bitwise parity: the CPU tests)
