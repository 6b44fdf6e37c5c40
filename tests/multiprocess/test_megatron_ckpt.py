"""Megatron-LM checkpoints (``torch_dist``) on the Megatron backend, on real gloo ranks (torchrun, CPU).

``test_kill_at_each_point_of_a_save_then_resume_matches_uninterrupted``: TP 2 with dropout, through
``kill_mid_save.py``: a trainer rank is SIGKILLed inside the save of rollout 2 at each point of it (``shards``:
rank 1 with its shards written, ``common.pt`` not; ``rename``: ``.tmp.iter_0000002`` complete, not renamed;
``tracker``: ``iter_0000002`` renamed, the tracker still names 1; ``prune``: published, ``iter_0000001`` not
pruned yet); the relaunch resumes from the tracker's checkpoint and ends bitwise equal to an uninterrupted run
(parameters, Adam moments and step, the next RNG draw on every rank, losses); ``--keep-checkpoints 1
--save-retain-interval 2`` leaves iterations 0, 2, 4 (Megatron-LM's meaning, as the FSDP backend's).
After the ``prune`` case, what one ``iter_*`` directory holds (Megatron-LM's files and keys).

``test_weights_only_torch_dist``: a weights-only ``release`` checkpoint written by megatron-core's own
``dist_checkpointing.save`` (what Miles's ``convert_hf_to_torch_dist`` writes) from another model at TP 2; a
TP 1 x DP 2 run with ``--load`` and ``--ref-load`` of it starts training from those weights (rollout 0) and
uses them as the reference; the layout miles wrote before (``step_*``) still resumes; a HF dir as ``--load``
is refused in one line unless ``--megatron-to-hf-mode bridge`` (Miles's rule), then training starts from its
weights; ``--finetune`` of a full checkpoint takes its weights only (rollout 0, fresh AdamW and schedule); the
dry-run check names a checkpoint whose padded vocabulary does not fit in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()
NUM_ROLLOUT = 4


def _trainer(model_dir: str, group, extra: list[str]):
    from trainer_harness import build, flags

    return build(model_dir, flags("megatron", "ckpt_run", "cosine", "kl", ["--num-rollout", str(NUM_ROLLOUT)], extra),
                 group=group)


def _init():
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist, dist.new_group([0, 1], timeout=timedelta(seconds=60))


def make_trainer(model_dir: str, flags: list[str], group):
    return _trainer(model_dir, group, ["--tensor-model-parallel-size", "2", "--hidden-dropout", "0.1"] + flags)


def moments(tr) -> dict:
    from miles.trainer.megatron.parallel import local_optimizer

    state = local_optimizer(tr.optimizer).state
    return {n: (state[p]["exp_avg"].clone(), state[p]["exp_avg_sq"].clone(), int(state[p]["step"]))
            for n, p in tr.model.named_parameters()}


def _launch(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    from _torchrun import torchrun_self

    from miles.utils.net import find_free_port

    return torchrun_self(HERE, 2, find_free_port(), *args, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    from kill_mid_save import reference

    return reference(HERE, tmp_path_factory.mktemp("megatron_ref") / "ref.pt", tiny_model_dir)


@pytest.mark.parametrize("point", ["shards", "rename", "tracker", "prune"])
def test_kill_at_each_point_of_a_save_then_resume_matches_uninterrupted(tiny_model_dir: Path, tmp_path: Path,
                                                                       reference: Path, point: str) -> None:
    from kill_mid_save import kill_then_resume

    from miles.trainer.checkpoint.layout import ITER

    kill_then_resume(HERE, tmp_path, reference, point, ITER, tiny_model_dir)
    if point != "prune":
        return
    from miles.trainer.megatron import torch_dist

    last = tmp_path / "ckpt" / "iter_0000004"             # Megatron-LM's files and keys
    assert json.loads((last / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = torch_dist.read_common(last)
    assert common["iteration"] == 4 and common["args"].tensor_model_parallel_size == 2
    assert common["miles"]["extra"] == {"data_position": 15, "rollout_id": 4}
    keys = torch_dist.dcp_keys(last)
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys and "rng_state/shard_0.1_1.2" in keys
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in keys


def test_checkpoint_faults(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Megatron: a disk that fills mid-save (a real tmpfs), corrupt newest checkpoints under an explicit --load,
    a --save without its tracker, another run's --save, nothing usable (``ckpt_faults.py``)."""
    import ckpt_faults

    from miles.trainer.checkpoint.layout import ITER

    ckpt_faults.check(ckpt_faults.run(HERE, "ITER", tiny_model_dir, tmp_path), ITER, tmp_path)


# ------------------------------------------------------------------------------------ weights only
def _convert_worker(model_dir: str, root: str) -> None:
    """What Miles's convert_hf_to_torch_dist does: megatron-core's own save of the model's sharded state
    dict (TP 2, vocabulary padded to 64 x 2) into ``release``, then the tracker."""
    import argparse

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    from miles.trainer.megatron import convert, model
    from miles.trainer.megatron.compat import apply_cpu_compat, trainer_world

    dist.init_process_group("gloo")
    apply_cpu_compat()
    with trainer_world(2):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1)
    shape = model.ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    padded = model.padded_vocab_size(shape.vocab_size, 64, 2)
    cpu = torch.device("cpu")
    gpt = model.build_gpt_model(shape, model.transformer_config(shape, tp_size=2, device=cpu), padded_vocab=padded,
                                device=cpu)
    convert.load_hf_into(gpt, convert.read_hf_state_dict(model_dir), shape, padded, dist.get_rank(), 2)
    out = Path(root) / "release"
    if dist.get_rank() == 0:
        out.mkdir(parents=True)
    dist.barrier()
    # megatron-core's writer is written for GPUs: it syncs CUDA and puts one flag on the current CUDA device
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
    dist_checkpointing.save({"model": gpt.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0,
                             "args": argparse.Namespace(tensor_model_parallel_size=2)}, str(out))
    if dist.get_rank() == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("release")
    dist.barrier()
    dist.destroy_process_group()


def _finetune_worker(model_dir: str, other_dir: str, root: str, out: str) -> None:
    import torch
    from trainer_harness import random_samples

    from miles.trainer.checkpoint import save_checkpoint
    from miles.trainer.megatron import convert, legacy_ckpt, parallel

    dist, group = _init()
    rank = dist.get_rank(group)
    save = str(Path(out).parent / "save")
    flags = ["--load", root, "--ref-load", root, "--kl-coef", "0.01", "--make-vocab-size-divisible-by", "128",
             "--save", save]
    tr = _trainer(model_dir, group, flags)          # TP 1 x DP 2, vocabulary padded to 128: the same rows
    extra = tr.resume()
    loaded = tr.state_dict_for_check()
    ref_equal = all(torch.equal(p, q) for p, q in zip(tr.model.parameters(), tr.ref.parameters()))
    step = tr.schedule.step
    tr.train(random_samples(1, 3, first_group=rank), 0)
    tr.checkpoint(0, {"data_position": 3})
    tr4 = _trainer(model_dir, group, ["--load", save, "--finetune"])    # weights only, rollout 0
    finetune_extra, finetune_step = tr4.resume(), tr4.schedule.step
    finetune_fresh_optim = not parallel.local_optimizer(tr4.optimizer).state
    finetuned = tr4.state_dict_for_check()
    legacy = Path(out).parent / "legacy"
    save_checkpoint(legacy, 5, lambda d: legacy_ckpt.save_trainer_state(tr, d, {"rollout_id": 5, "data_position": 9}),
                    group=group)
    trained = tr.state_dict_for_check()
    tr2 = _trainer(model_dir, group, ["--load", str(legacy)])
    legacy_extra = tr2.resume()
    again = tr2.state_dict_for_check()
    try:                                            # a HF dir as --load: Miles reads it in bridge mode only
        _trainer(model_dir, group, ["--load", other_dir]).resume()
        raw_error = None
    except ValueError as e:
        raw_error = str(e)
    tr3 = _trainer(model_dir, group, ["--load", other_dir, "--megatron-to-hf-mode", "bridge"])
    bridge_extra, bridged = tr3.resume(), tr3.state_dict_for_check()
    if rank == 0:
        hf = convert.read_hf_state_dict(other_dir)
        torch.save({"extra": extra, "step": step, "ref_equal": ref_equal, "legacy_extra": legacy_extra,
                    "loaded_equal_other": all(torch.equal(loaded[k], hf[k]) for k in loaded),
                    "legacy_equal": all(torch.equal(trained[k], again[k]) for k in trained),
                    "raw_error": raw_error, "bridge_extra": bridge_extra,
                    "finetune": (finetune_extra, finetune_step, finetune_fresh_optim,
                                 all(torch.equal(finetuned[k], trained[k]) for k in trained)),
                    "bridge_equal_other": all(torch.equal(bridged[k], hf[k]) for k in bridged),
                    "trained_moved": any(not torch.equal(trained[k], hf[k]) for k in trained)}, out)
    dist.barrier(group)
    dist.destroy_process_group()


def test_weights_only_torch_dist(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch

    from miles.config import parse_args
    from miles.config.base import ConfigError
    from miles.trainer.megatron import dist_ckpt
    from miles.utils.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", hidden_size=64, num_layers=2, seed=7)
    root = tmp_path / "converted"
    conv = _launch("convert", str(other), str(root))
    assert conv.returncode == 0, conv.stdout[-2000:] + conv.stderr[-4000:]
    out = tmp_path / "finetune.pt"
    run = _launch("finetune", str(tiny_model_dir), str(other), str(root), str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    res = torch.load(out, weights_only=False)
    assert res["extra"] is None and res["step"] == 0                 # a weights-only start: rollout 0
    assert res["loaded_equal_other"] and res["ref_equal"] and res["trained_moved"]
    assert res["legacy_extra"] == {"rollout_id": 5, "data_position": 9} and res["legacy_equal"]
    assert "--megatron-to-hf-mode bridge" in res["raw_error"] and "\n" not in res["raw_error"]
    assert res["bridge_extra"] is None and res["bridge_equal_other"]
    assert res["finetune"] == (None, 0, True, True)      # --finetune of a full checkpoint: its weights only

    # the dry run: TP 2 with the default padding (128 x 2 = 256 rows) does not fit the 128-row checkpoint
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    base = ["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
            "--train-backend", "megatron", "--load", str(root)]
    dist_ckpt.preflight_check(parse_args(base), hf_config)              # TP 1: fits
    with pytest.raises(ConfigError) as e:
        dist_ckpt.preflight_check(parse_args(base + ["--tensor-model-parallel-size", "2"]), hf_config)
    msg = str(e.value)
    assert "\n" not in msg and "embedding.word_embeddings.weight" in msg and "[128, 64]" in msg and "[256, 64]" in msg


if __name__ == "__main__":
    if sys.argv[1] == "kill_mid_save":
        import kill_mid_save

        kill_mid_save.worker(make_trainer, *sys.argv[2:], moments=moments)
    elif sys.argv[1] == "ckpt_faults":
        import ckpt_faults

        ckpt_faults.worker(make_trainer, *sys.argv[2:])
    elif sys.argv[1] == "convert":
        _convert_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "finetune":
        _finetune_worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
