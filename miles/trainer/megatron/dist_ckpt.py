"""What a Megatron trainer checkpoint holds, in Megatron-LM's layout (``torch_dist.py``), and how ``--load``,
``--ref-load`` and ``--save`` use it.

    path = save(trainer, rollout_id, extra)    # <save>/iter_<rollout_id>/, then the tracker (layout.save_atomic)
    extra = resume(trainer)                    # --load (default --save): the tracker's iteration, or None
    write_state(trainer, path, extra); extra = load_state(trainer, path)     # one directory (trainer.save/load)
    load_weights(trainer, model, root, step)   # --ref-load of a Megatron checkpoint: model weights only

Megatron's flags keep their meaning: ``--no-load-optim`` (AdamW starts fresh), ``--no-load-rng``,
``--finetune`` (weights only; training starts at rollout 0 with a fresh optimizer, schedule and RNG; also
what a ``release`` checkpoint means, e.g. Miles's ``convert_hf_to_torch_dist`` output), ``--ckpt-step N``
(``iter_N`` instead of the tracker's), ``--ref-ckpt-step``. A checkpoint miles wrote resumes fully (rollout
id, data position, weight version, LR schedule, AdamW moments and step, every rank's RNG); one written by
Megatron-LM / Miles resumes at its iteration + 1 (Miles's rule), with the data position Miles saves under
``<root>/rollout/`` and the LR schedule at iteration x steps per rollout; its optimizer state is read when it
is in megatron-core's per-parameter layout (``optimizer.state.exp_avg.<key>``), else one line asks for
``--no-load-optim``. The layout miles's Megatron backend wrote before (``step_*/actor``) is still read
(``legacy_ckpt.py``). Resuming follows ``miles.trainer.checkpoint.resume``: a corrupt checkpoint is skipped for an
older one with one warning, under ``--load`` and ``--save`` alike; ``iter_*`` dirs without a tracker are resumed
from (the newest that verifies), never overwritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.config.base import ConfigError
from miles.trainer.checkpoint.faults import fault_point
from miles.trainer.checkpoint.fsdp_format import json_extra, verify_dcp
from miles.trainer.checkpoint.layout import ITER, TRACKER, save_atomic
from miles.trainer.checkpoint.resume import resume_newest, resume_root
from miles.trainer.checkpoint.sync import barrier
from miles.trainer.megatron import torch_dist as td
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.trainer.megatron.model import ModelShape
    from miles.trainer.megatron.trainer import MegatronTrainer

logger = get_logger(__name__)


def _flags(trainer: MegatronTrainer) -> dict[str, Any]:
    m = getattr(trainer, "megatron_cfg", None)
    return {k: getattr(m, k, None) for k in ("finetune", "no_load_rng", "ckpt_step", "ref_ckpt_step")}


def _models(trainer: MegatronTrainer) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    out = [("actor", trainer.model, trainer.optimizer)]
    if trainer.critic is not None:
        out.append(("critic", trainer.critic.model, trainer.critic.optimizer))
    return out


def model_sharded(model: torch.nn.Module) -> dict:
    """megatron-core's ``sharded_state_dict()``; for the PPO critic (``critic.MegatronValueModel``) its backbone's
    under ``gpt.`` plus the value head, replicated everywhere and written by the last pipeline stage (it uses it).
    The metadata is passed with its ``dp_cp_group`` (what megatron-core fills in for None): GPTModel's tie of the
    MTP stage's embedding copy (a last pipeline stage holding the MTP block, mtp.py) reads it from the caller's."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    if hasattr(model, "sharded_state_dict"):
        return model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = model.gpt.sharded_state_dict(prefix="gpt.", metadata=ensure_metadata_has_dp_cp_group(None))
    replica = (ps.get_pipeline_model_parallel_world_size() - 1 - ps.get_pipeline_model_parallel_rank(),
               ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True))
    for name, p in model.value_head.named_parameters():
        sd[f"value_head.{name}"] = ShardedTensor.from_rank_offsets(f"value_head.{name}", p, replica_id=replica)
    return sd


def _sharded(trainer: MegatronTrainer, model, opt, *, with_optim: bool, rng: bool) -> tuple[dict, dict]:
    model_sd = model_sharded(model)
    sd: dict[str, Any] = {"model": model_sd}
    optim: dict[str, Any] = {}
    if with_optim:
        td.ensure_optim_state(opt)
        optim = td.optim_sharded(model_sd, opt, owner_writes=trainer.distributed_optimizer)
        sd["optimizer"] = {"state": optim}
    if rng:
        sd["rng_state"] = td.rng_object(trainer.dropout_rng_state, trainer.device, trainer.timeout)
    return sd, optim


# ----------------------------------------------------------------------------- save
def write_state(trainer: MegatronTrainer, path: Path, extra: dict) -> None:
    """One checkpoint's contents into ``path`` (collective on the trainer group)."""
    extra_json = json_extra(extra)
    with_optim = not trainer.ckpt.no_save_optim
    iteration = int(extra_json.get("rollout_id", 0))
    for sub, model, opt in _models(trainer):
        sd, _ = _sharded(trainer, model, opt, with_optim=with_optim, rng=sub == "actor")
        schedule = trainer.schedule if sub == "actor" else trainer.critic.schedule
        sd.update(args=td.common_args(trainer), checkpoint_version=3.0, iteration=iteration,
                  miles={"format": td.FORMAT, "backend": "megatron", "extra": extra_json, "has_optim": with_optim,
                         "has_critic": trainer.critic is not None, "schedule": schedule.state_dict(),
                         "optim_step": td.optim_step(opt) if with_optim else 0,
                         "world_size": trainer.trainer_world})
        last = sub == _models(trainer)[-1][0]
        td.write(sd, path if sub == "actor" else path / sub, trainer.trainer_group, trainer.trainer_rank,
                 trainer.device, after_shards=(lambda: fault_point("shards", iteration, trainer.trainer_rank))
                 if last else None)


def save(trainer: MegatronTrainer, rollout_id: int, extra: dict) -> Path:
    """Crash-safe ``<save>/iter_<rollout_id>`` (``trainer.save`` writes it), then the tracker; prunes
    (--keep-checkpoints, --save-retain-interval: ``cadence.to_prune``). Collective."""
    ck = trainer.ckpt
    if not ck.save:
        raise ValueError("checkpoint() needs --save DIR.")
    extra = {**extra, "rollout_id": rollout_id}
    return save_atomic(ck.save, ITER, rollout_id, lambda d: trainer.save(d, extra), group=trainer.trainer_group,
                       device=trainer.device, keep=ck.keep_checkpoints, retain_interval=ck.save_retain_interval)


# ----------------------------------------------------------------------------- load
def verify(path: Path, with_critic: bool) -> str | None:
    """Why ``path`` cannot be loaded, or None (cheap: metadata, common.pt, file sizes)."""
    if (path / "model").is_dir() and not td.is_torch_dist(path):
        return f"{path.name} is a Miles FSDP checkpoint (iter_*/model): resume it with --train-backend fsdp"
    if not path.is_dir():
        return f"{path.name} is missing"
    if not td.is_torch_dist(path):
        return f"{path.name} is not a torch_dist checkpoint (no metadata.json saying so)"
    for d in [path] + ([path / "critic"] if with_critic else []):
        if not (d / td.COMMON).is_file():
            return f"{d.relative_to(path.parent)}/{td.COMMON} is missing"
        problem = verify_dcp(d)
        if problem:
            return problem
        try:
            td.read_common(d)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means "corrupt"
            return f"{d.name}/{td.COMMON} is unreadable ({type(e).__name__})"
    return None


def _load_model(trainer: MegatronTrainer, model, opt, path: Path, *, with_optim: bool, with_rng: bool) -> dict:
    sd, optim = _sharded(trainer, model, opt, with_optim=with_optim, rng=with_rng)
    keys = td.dcp_keys(path)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    absent = [k for k, v in sd["model"].items() if isinstance(v, ShardedObject) and v.unique_key not in keys]
    for k in absent:                           # e.g. _extra_state a checkpoint of another layer spec lacks
        sd["model"].pop(k)
    with torch.no_grad():
        loaded = td.read(sd, path, trainer.trainer_group)
        missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
        bad = [k for k in list(missing) + list(unexpected) if not k.endswith("_extra_state")]
        if bad:
            raise ValueError(f"{path}: the checkpoint's model does not match this one ({bad[0]} and {len(bad) - 1} "
                             "more); check --hf-checkpoint is the architecture the checkpoint was trained with.")
        for key, sh in optim.items():           # loaded in place, except the halves of a GLU factory
            t = loaded["optimizer"]["state"][key]
            if t.data_ptr() != sh.data.data_ptr():
                sh.data.copy_(t)
    return loaded


def load_state(trainer: MegatronTrainer, path: Path) -> dict | None:
    """Load ``path`` into the trainer (collective); returns the resume ``extra``, None for a weights-only start."""
    flags = _flags(trainer)
    common = td.read_common(path)
    ours = common.get("miles") if isinstance(common.get("miles"), dict) else None
    finetune = bool(flags["finetune"]) or path.name == "release"
    keys = td.dcp_keys(path)
    has_optim = any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    skip_optim = trainer.ckpt.no_load_optim or finetune
    if not has_optim and not skip_optim:
        if ours is None:
            raise ValueError(f"{path}: no optimizer state in megatron-core's per-parameter layout (weights only, or "
                             "Megatron's distributed-optimizer layout): pass --no-load-optim to start AdamW fresh, "
                             "or --finetune to start a new run from these weights.")
        logger.warning("%s was saved with --no-save-optim: AdamW state starts fresh.", path)
    with_optim = has_optim and not skip_optim
    with_rng = not flags["no_load_rng"] and not finetune and td.rng_key_present(path)
    if trainer.critic is not None and not (ours or {}).get("has_critic"):
        raise ValueError(f"{path} has no critic but --advantage-estimator ppo needs one; resume with the estimator "
                         "the checkpoint was trained with, or start a new run.")
    for sub, model, opt in _models(trainer):
        d = path if sub == "actor" else path / sub
        loaded = _load_model(trainer, model, opt, d, with_optim=with_optim, with_rng=with_rng and sub == "actor")
        if sub == "actor" and with_rng and not td.restore_rng(loaded["rng_state"], trainer):
            logger.warning("%s: saved with another data-parallel size; RNG not restored.", path)
        sub_common = common if sub == "actor" else td.read_common(d)
        sub_ours = sub_common.get("miles") or {}
        if with_optim and "optim_step" in sub_ours:
            td.set_optim_step(opt, int(sub_ours["optim_step"]))
        schedule = trainer.schedule if sub == "actor" else trainer.critic.schedule
        if finetune:
            continue
        if "schedule" in sub_ours:
            schedule.load_state_dict(sub_ours["schedule"])
        else:                                  # Megatron-LM / Miles: one rollout = num_steps_per_rollout steps
            schedule.load_state_dict({**schedule.state_dict(),
                                      "step": int(common.get("iteration", 0)) * trainer.num_steps_per_rollout})
    if not with_rng and not finetune and not flags["no_load_rng"]:
        logger.warning("%s: no RNG state for this (PP, TP) layout; RNG not restored.", path)
    barrier(trainer.trainer_group, trainer.device)
    logger.info("loaded checkpoint %s (%s)", path, "weights only" if finetune else f"schedule step {trainer.schedule.step}")
    if finetune:
        return None
    if ours is not None:
        return ours["extra"]
    iteration = int(common.get("iteration", 0))
    extra: dict[str, Any] = {"rollout_id": iteration, "next_rollout_id": iteration + 1, "miles_checkpoint": str(path)}
    data_state = path.parent / "rollout" / f"global_dataset_state_dict_{iteration}.pt"
    if data_state.is_file():
        extra["miles_data_state"] = {k: v for k, v in torch.load(data_state, weights_only=False).items()
                                     if k in ("sample_offset", "epoch_id")}
    return extra


def resume(trainer: MegatronTrainer) -> dict | None:
    """The newest usable checkpoint under --load (default --save), loaded through ``trainer.load``: the tracker's (or
    --ckpt-step's), an older one when it is corrupt (one warning); without a tracker, the newest ``iter_*`` that
    verifies (one warning); the earlier ``step_*`` layout (``legacy_ckpt``); a HF dir (bridge mode); or None."""
    ck = trainer.ckpt
    flag, root = resume_root(ck, ITER, rank=trainer.trainer_rank)
    if not root:
        return None
    ckpt_step = _flags(trainer)["ckpt_step"]
    found = td.candidates(root, flag, ckpt_step)
    if not found and (Path(root) / "config.json").is_file():
        load_hf_weights(trainer, root, flag)
        return None
    if not found:
        from miles.trainer.megatron import legacy_ckpt

        return legacy_ckpt.resume(trainer, flag, root)   # step_* of the earlier layout, or a fresh start
    if td.untracked(root, ckpt_step) and trainer.trainer_rank == 0:
        logger.warning("%s %s holds iter_* checkpoints but no %s (a save killed before its first tracker update, or "
                       "a copy without it): resuming from the newest one that verifies, %s first.", flag, root,
                       TRACKER, found[0].name)
    return resume_newest(found, flag=flag, root=root, verify=lambda p: verify(p, trainer.critic is not None),
                         load=trainer.load, group=trainer.trainer_group, device=trainer.device,
                         rank=trainer.trainer_rank,
                         fix=f"fix or delete them, or point {flag} elsewhere (a --save of another run is never "
                             "overwritten).")


def _hf_load_refusal(flag: str, root: str) -> str:
    return (f"{flag} {root} is a HF model dir, which Miles loads only with --megatron-to-hf-mode bridge: add that "
            "flag, or pass the dir as --hf-checkpoint.")


def load_hf_weights(trainer: MegatronTrainer, root: str, flag: str) -> None:
    """Miles's ``--megatron-to-hf-mode bridge`` meaning of a HF model dir as ``--load``: training starts from its
    weights (rollout 0, fresh optimizer); with ``raw`` Miles refuses it, and so does this."""
    from transformers import AutoConfig

    from miles.trainer.megatron import convert, pipeline
    from miles.trainer.megatron.model import ModelShape

    if getattr(trainer.cfg, "megatron_to_hf_mode", "raw") != "bridge":
        raise ValueError(_hf_load_refusal(flag, root))
    if ModelShape.from_hf_config(AutoConfig.from_pretrained(root)) != trainer.shape:
        raise ValueError(f"{flag} {root}: its architecture differs from --hf-checkpoint's; give a HF dir of the same "
                         "model.")
    g = trainer.groups
    load = pipeline.load_hf_into if getattr(g, "pp_size", 1) > 1 else convert.load_hf_into
    ep = {"ep_rank": g.ep_rank, "ep_size": g.ep_size} if getattr(g, "ep_size", 1) > 1 else {}
    load(trainer.model, convert.read_hf_state_dict(root), trainer.shape, trainer.padded_vocab, g.tp_rank, g.tp_size,
         **ep)
    barrier(trainer.trainer_group, trainer.device)
    logger.info("%s %s: a HF model dir (--megatron-to-hf-mode bridge); training starts from its weights", flag, root)


def load_weights(trainer: MegatronTrainer, model: torch.nn.Module, root: str, ckpt_step: int | None, flag: str) -> None:
    """Model weights only from a Megatron checkpoint (``--ref-load``): the newest usable one, as ``resume``;
    collective on the trainer group."""
    found = td.candidates(root, flag, ckpt_step)
    if not found:
        raise ConfigError(f"{flag} {root}: no Megatron checkpoint there ({TRACKER} missing).")

    def load(path: Path) -> Path:
        _load_model(trainer, model, None, path, with_optim=False, with_rng=False)
        return path

    try:
        path = resume_newest(found, flag=flag, root=root, verify=lambda p: verify(p, False), load=load,
                             group=trainer.trainer_group, device=trainer.device, rank=trainer.trainer_rank)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    logger.info("%s: loaded weights from %s", flag, path)


# ----------------------------------------------------------------------------- dry run
def check_dir(root: str, flag: str, *, shape: ModelShape, padded_vocab: int, ckpt_step: int | None = None) -> None:
    """The checks that need no world: the tracker names a torch_dist dir whose embedding and layer stack have
    this run's shapes (vocabulary padded for this TP size, the layer count). Raises ValueError (one line)."""
    found = td.candidates(root, flag, ckpt_step)
    if not found:
        return
    path = resume_newest(found, flag=flag, root=root, verify=lambda p: verify(p, False), load=lambda p: p,
                         group=None, device=None, rank=0, warn=False)   # the one a resume would load
    keys = td.dcp_keys(path)
    want = {"embedding.word_embeddings.weight": (padded_vocab, shape.hidden_size),
            "decoder.final_layernorm.weight": (shape.hidden_size,)}
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    if qkv in keys:
        rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels
        want[qkv] = (shape.num_layers, rows, shape.hidden_size)
    for key, expected in want.items():
        got = tuple(getattr(keys.get(key), "size", ()) or ())
        if key in keys and got != expected:
            hint = (" (the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP: use the TP "
                    "size or --make-vocab-size-divisible-by the checkpoint was saved with)"
                    if key.startswith("embedding") and got[1:] == expected[1:] else
                    "; --hf-checkpoint must be the architecture the checkpoint was trained with")
            raise ValueError(f"{flag} {root}: {path.name} holds {key} of shape {list(got)}, this run needs "
                             f"{list(expected)}{hint}.")


def preflight_check(cfg: MilesConfig, hf_config: dict | None) -> None:
    """``miles.run.preflight`` backend check: --load and --ref-load Megatron checkpoints fit the model."""
    from miles.trainer.megatron import options
    from miles.trainer.megatron.model import padded_vocab_size

    if hf_config is None:
        return
    m, load = cfg.megatron, cfg.checkpoint.load
    if load and (Path(load) / "config.json").is_file() and not td.is_megatron_root(load) \
            and getattr(cfg.train, "megatron_to_hf_mode", "raw") != "bridge":
        raise ConfigError(_hf_load_refusal("--load", load))
    dirs = [("--load", cfg.checkpoint.load, m.ckpt_step), ("--ref-load", cfg.train.ref_load, m.ref_ckpt_step)]
    dirs = [(f, d, s) for f, d, s in dirs if d and td.is_megatron_root(d)]
    if not dirs:
        return
    from transformers import AutoConfig

    d = dict(hf_config)
    try:
        shape = options.shape_of(AutoConfig.for_model(d.pop("model_type", None), **d))
    except (ValueError, ConfigError):
        return                                  # the architecture check reports it
    o = options.resolve(m, cfg.train)
    padded = padded_vocab_size(shape.vocab_size, o.vocab_divisible_by, o.tp)
    for flag, root, step in dirs:
        try:
            check_dir(root, flag, shape=shape, padded_vocab=padded, ckpt_step=step)
        except ValueError as e:
            raise ConfigError(str(e)) from None
