"""The checkpoint layout the Megatron trainer wrote before it wrote Megatron-LM's (``dist_ckpt.py``): still read,
so a run saved that way resumes (``dist_ckpt.resume`` comes here when ``--load`` has no ``iter_*`` checkpoint);
``save_trainer_state`` writes it (tests). The FSDP trainer's crash-safe ``step_N/COMPLETE``
directories, with the tensors in a torch.distributed.checkpoint (DCP) directory of our own layout::

    actor/, critic/ (ppo) DCP over the trainer group: every parameter in megatron-core names, each
                          TP-split one as a DTensor sharded over the TP group (fc1 as ``/gate`` and
                          ``/up`` halves), so DCP records full tensors and data-parallel replicas write
                          once; with the optimizer, ``optim/<name>/{exp_avg,exp_avg_sq,step}`` alike
                          (``--use-distributed-optimizer``: written by the DP rank that owns it)
    rng/rank00000.pt ...  python, numpy, torch, CUDA and megatron-core's tensor-parallel RNG states
    trainer_state.json    format (1), backend "megatron", TP size, world size, LR schedule step,
                          has_optim, extra (rollout id, data position, weight version)

``resume`` follows ``miles.trainer.checkpoint.resume``: the newest complete checkpoint that verifies on
every trainer rank (``fsdp_format.verify``: the same files) and loads, a corrupt one skipped with one warning. The tensors reshard on load to
another data-parallel size, and to another TP size when the padded vocabulary is the same; the RNG
is restored only with the same number of trainer ranks (a warning otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from miles.trainer.checkpoint import miles_fsdp
from miles.trainer.checkpoint.fsdp_format import FORMAT, json_extra
from miles.trainer.checkpoint.fsdp_format import verify as verify_step_dir
from miles.trainer.checkpoint.layout import STEP, TRACKER, published, read_trainer_state
from miles.trainer.checkpoint.resume import resume_newest
from miles.trainer.checkpoint.rng import rng_state, set_rng_state
from miles.trainer.checkpoint.sync import barrier, local_error, raise_if_any
from miles.trainer.megatron import torch_dist as td
from miles.trainer.megatron.convert import is_glu_fc1, partition_dim
from miles.trainer.megatron.parallel import local_optimizer
from miles.trainer.megatron.pipeline import global_named_parameters, is_tied_copy
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.trainer.megatron.trainer import MegatronTrainer

logger = get_logger(__name__)


def _tp_mesh(trainer: MegatronTrainer):
    """The TP group's DeviceMesh, built once per trainer (building it is collective); kept on the trainer by this
    module alone."""
    mesh = getattr(trainer, "_legacy_ckpt_tp_mesh", None)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(trainer.groups.tp, device_type=trainer.device.type)
        trainer._legacy_ckpt_tp_mesh = mesh
    return mesh


def _entries(key: str, name: str, t: torch.Tensor, mesh, tp: int) -> dict[str, torch.Tensor]:
    """The DCP entries under ``key`` of one local tensor shaped like parameter ``name`` (the parameter
    itself or an Adam moment of it)."""
    from torch.distributed.tensor import DTensor, Shard

    dim = partition_dim(name)
    if dim is None:
        return {key: t}
    pieces = {f"{key}/gate": t.chunk(2, dim=0)[0], f"{key}/up": t.chunk(2, dim=0)[1]} if is_glu_fc1(name) \
        else {key: t}
    out = {}
    for key, local in pieces.items():
        shape = list(local.shape)
        shape[dim] *= tp
        out[key] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
    return out


def _state_dict(trainer: MegatronTrainer, model, optimizer, with_optim: bool) -> dict[str, torch.Tensor]:
    mesh, tp = _tp_mesh(trainer), trainer.groups.tp_size
    sd: dict[str, torch.Tensor] = {}
    # layers by global index under pipeline parallelism; the last stage's copy of a tied embedding is saved and
    # loaded as the embedding (same values), so a checkpoint has the same keys for every PP size
    named = [("embedding.word_embeddings.weight" if is_tied_copy(p) else n, p) for n, p in global_named_parameters(model)]
    for name, p in named:
        sd.update(_entries(name, name, p.detach(), mesh, tp))
    if with_optim:
        state = local_optimizer(optimizer).state
        for name, p in named:
            if p not in state:                # --use-distributed-optimizer: another DP rank owns it
                continue
            st = state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                sd.update(_entries(f"optim/{name}/{key}", name, st[key], mesh, tp))
            sd[f"optim/{name}/step"] = st["step"]
    return sd


def _megatron_rng() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def save_trainer_state(trainer: MegatronTrainer, path: Path, extra: dict) -> None:
    """Write one checkpoint's contents into ``path`` (collective on the trainer group)."""
    import torch.distributed.checkpoint as dcp

    extra_json = json_extra(extra)
    group = trainer.trainer_group
    raise_if_any(local_error(lambda: path.mkdir(parents=True, exist_ok=True)), group, trainer.device)
    with_optim = not trainer.ckpt.no_save_optim
    for sub, model, opt in _models(trainer):
        if with_optim:
            td.ensure_optim_state(opt)
        dcp.save(_state_dict(trainer, model, opt, with_optim), checkpoint_id=str(path / sub), process_group=group)

    def local_files() -> None:
        (path / "rng").mkdir(exist_ok=True)
        torch.save({**rng_state(), "megatron": _megatron_rng(), "dropout": trainer.dropout_rng_state},
                   path / "rng" / f"rank{trainer.trainer_rank:05d}.pt")
        if trainer.trainer_rank == 0:
            meta = {"format": FORMAT, "backend": "megatron", "tensor_model_parallel_size": trainer.groups.tp_size,
                    "pipeline_model_parallel_size": trainer.groups.pp_size,
                    "padded_vocab_size": trainer.padded_vocab, "world_size": trainer.trainer_world,
                    "schedule": trainer.schedule.state_dict(), "has_optim": with_optim,
                    "critic_schedule": trainer.critic.schedule.state_dict() if trainer.critic is not None else None,
                    "has_critic": trainer.critic is not None, "extra": extra_json}
            (path / "trainer_state.json").write_text(json.dumps(meta, indent=2))

    raise_if_any(local_error(local_files), group, trainer.device)


def _models(trainer: MegatronTrainer) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    out = [("actor", trainer.model, trainer.optimizer)]
    if trainer.critic is not None:
        out.append(("critic", trainer.critic.model, trainer.critic.optimizer))
    return out


def load_trainer_state(trainer: MegatronTrainer, path: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    meta = read_trainer_state(path)
    if meta.get("backend") != "megatron":
        raise ValueError(f"{path} was written by the {meta.get('backend', 'fsdp')} backend; resume it with "
                         f"--train-backend {meta.get('backend', 'fsdp')}, or start from --hf-checkpoint.")
    if meta.get("padded_vocab_size") != trainer.padded_vocab:
        raise ValueError(f"{path}: saved with TP {meta.get('tensor_model_parallel_size')} (vocabulary padded to "
                         f"{meta.get('padded_vocab_size')}); this run pads it to {trainer.padded_vocab}: resume with "
                         f"--tensor-model-parallel-size {meta.get('tensor_model_parallel_size')}.")
    with_optim = bool(meta["has_optim"]) and not trainer.ckpt.no_load_optim
    if not meta["has_optim"] and not trainer.ckpt.no_load_optim:
        logger.warning("%s was saved with --no-save-optim: AdamW state starts fresh.", path)
    if trainer.critic is not None and not meta.get("has_critic"):
        raise ValueError(f"{path} has no critic but --advantage-estimator ppo needs one; resume with the "
                         "estimator the checkpoint was trained with, or start a new run.")
    for sub, model, opt in _models(trainer):
        if with_optim:
            td.ensure_optim_state(opt)
        with torch.no_grad():
            dcp.load(_state_dict(trainer, model, opt, with_optim), checkpoint_id=str(path / sub),
                     process_group=trainer.trainer_group)
    trainer.schedule.load_state_dict(meta["schedule"])
    if trainer.critic is not None:
        trainer.critic.schedule.load_state_dict(meta["critic_schedule"])
    rng_file = path / "rng" / f"rank{trainer.trainer_rank:05d}.pt"
    if rng_file.is_file() and meta.get("world_size") == trainer.trainer_world:
        state = torch.load(rng_file, weights_only=False)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state.pop("megatron"))
        trainer.dropout_rng_state = state.pop("dropout")
        set_rng_state(state)
    else:
        logger.warning("%s: no RNG state for trainer rank %d of %d (saved with %s ranks); RNG not restored.",
                       path, trainer.trainer_rank, trainer.trainer_world, meta.get("world_size"))
    barrier(trainer.trainer_group, trainer.device)
    logger.info("loaded checkpoint %s (schedule step %d)", path, trainer.schedule.step)
    return meta["extra"]


def resume(trainer: MegatronTrainer, flag: str, root: str) -> dict | None:
    """The newest usable ``step_*`` checkpoint under ``root`` (collective on the trainer group); None when there is
    none (a fresh start); a Miles FSDP checkpoint there is one error naming ``--train-backend fsdp``."""
    found = [p for _, p in reversed(published(root, STEP))]
    if not found:
        miles_ckpt = miles_fsdp.find(root)
        if miles_ckpt is not None:
            raise ValueError(f"{flag} {root} holds a Miles FSDP checkpoint ({miles_ckpt.name}), which this trainer "
                             "backend cannot read: resume it with --train-backend fsdp.")
        if flag == "--load" and trainer.trainer_rank == 0:   # Miles's meaning: a --load not written yet is a fresh start
            logger.warning("--load %s: no checkpoint there yet (no %s nor iter_*); starting from --hf-checkpoint.",
                           root, TRACKER)
        return None
    rank, world = trainer.trainer_rank, trainer.trainer_world
    return resume_newest(found, flag=flag, root=root, verify=lambda p: verify_step_dir(p, rank=rank, world=world),
                         load=lambda p: load_trainer_state(trainer, p), group=trainer.trainer_group,
                         device=trainer.device, rank=rank)
