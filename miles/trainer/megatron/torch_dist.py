"""Megatron-LM's checkpoint format (``--ckpt-format torch_dist``) and directory layout, for the Megatron trainer.

Under ``--save`` (what Megatron-LM and Miles write and read)::

    latest_checkpointed_iteration.txt   the newest complete iteration (written last, atomically)
    iter_0000012/                       one checkpoint; the iteration is the rollout id (as in Miles)
        metadata.json                   {"sharded_backend": "torch_dist", ...} (megatron-core's config)
        common.pt                       args, checkpoint_version, iteration, and "miles": LR schedule(s),
                                        extra (rollout id, data position, weight version), sizes
        .metadata, __<rank>_0.distcp    torch.distributed.checkpoint files: the model's
                                        ``sharded_state_dict()`` (megatron-core's keys, so TP/PP/EP
                                        layouts reshard), Adam moments as ``optimizer.state.exp_avg.<key>``
                                        (``--use-distributed-optimizer``: written by the DP rank that owns
                                        the parameter), and ``rng_state`` (per (PP, TP) rank, a list over DP)
        critic/                         the PPO critic, the same format
    .tmp.iter_0000013/                  a save in progress or a killed one: never read

The directories, the tracker and the crash-safe save are ``miles.trainer.checkpoint.layout``'s (``ITER``); this
module holds the format: which directories ``--load`` may read (``candidates``), the tensors, ``common.pt``.

The tensors are written with megatron-core's translation of sharded tensors to torch DCP
(``strategies.torch``) but with torch's ``dcp.save`` over the trainer group (megatron-core's own
``dist_checkpointing.save`` runs on the default group, which includes engine ranks, and forks writer
processes). Reading a checkpoint written by Megatron-LM or Miles (e.g. ``convert_hf_to_torch_dist``'s
``release`` dir of model weights only) goes through the same reader.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from miles.trainer.checkpoint.layout import ITER, TRACKER, published, read_tracker
from miles.trainer.checkpoint.sync import local_error, raise_if_any
from miles.trainer.collectives import bounded_all_gather_object
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.trainer.megatron.trainer import MegatronTrainer

logger = get_logger(__name__)

COMMON = "common.pt"
FORMAT = 1


def is_torch_dist(path: str | Path) -> bool:
    """A megatron-core distributed checkpoint dir in the ``torch_dist`` format."""
    import json

    f = Path(path) / "metadata.json"
    try:
        return json.loads(f.read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def is_megatron_root(path: str | Path) -> bool:
    """A directory Megatron-LM's ``--load`` reads: a tracker file, itself an ``iter_*``/``release`` dir, or
    ``iter_*`` torch_dist dirs without a tracker (a save killed before its first tracker update)."""
    p = Path(path)
    return (p / TRACKER).is_file() or is_torch_dist(p) or any(is_torch_dist(d) for _, d in published(p, ITER))


def candidates(root: str | Path, flag: str, ckpt_step: int | None = None) -> list[Path]:
    """The checkpoint dirs ``flag`` (``--load``, ``--ref-load``) may load, best first: ``ckpt_step``'s only
    (``--ckpt-step``, ``--ref-ckpt-step``); else the tracker's, then older ``iter_*`` dirs (a fallback when the
    newest is corrupt); without a tracker every ``iter_*`` dir, newest first (``untracked`` says so). A dir that
    is itself a torch_dist checkpoint is the only candidate. Errors name ``flag`` or its step flag."""
    root = Path(root)
    if is_torch_dist(root):
        return [root]
    if ckpt_step is not None:
        step_flag = "--ref-ckpt-step" if flag == "--ref-load" else "--ckpt-step"
        path = root / ITER.name(ckpt_step)
        if not is_torch_dist(path):
            have = ", ".join(p.name for _, p in published(root, ITER)) or "none"
            raise ValueError(f"{step_flag} {ckpt_step}: {path} is not a torch_dist checkpoint (iter_* there: {have}); "
                             f"pick one of those or drop {step_flag}.")
        return [path]
    try:
        tracked = read_tracker(root)
    except ValueError as e:
        raise ValueError(f"{flag} {root}: {e}") from None
    if tracked is None:
        return [p for _, p in reversed(published(root, ITER))]
    if tracked == "release":
        return [root / "release"]
    older = [p for it, p in reversed(published(root, ITER)) if it < tracked]
    return [root / ITER.name(tracked)] + older


def untracked(root: str | Path, ckpt_step: int | None = None) -> bool:
    """``candidates`` lists ``iter_*`` dirs that no tracker names (the tracker is missing)."""
    root = Path(root)
    return ckpt_step is None and not is_torch_dist(root) and not (root / TRACKER).is_file()


def read_common(path: Path) -> dict:
    return torch.load(path / COMMON, map_location="cpu", weights_only=False)


def dcp_keys(path: Path) -> dict[str, Any]:
    """The tensor/object keys of a torch_dist dir and their storage metadata (reads ``.metadata`` only)."""
    from torch.distributed.checkpoint import FileSystemReader

    return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


# ----------------------------------------------------------------------------- tensors
def _pyt(sharded: dict, loading: bool):
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    flat, flat_mapping, rename = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=not loading)
    return mcore_to_pyt_state_dict(flat, loading), flat_mapping, rename


def write(sharded_state_dict: dict, path: Path, group: dist.ProcessGroup, rank: int, device: torch.device,
          after_shards: Callable[[], None] | None = None) -> None:
    """Write a megatron-core sharded state dict as a torch_dist checkpoint into ``path`` (collective on ``group``):
    the sharded part through torch DCP, then ``after_shards()`` (the ``shards`` fault point), then the rest into
    ``common.pt`` and ``metadata.json`` (rank 0). A failure on any rank raises on every rank."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    raise_if_any(local_error(lambda: path.mkdir(parents=True, exist_ok=True)) if rank == 0 else None, group, device)
    pyt, _, _ = _pyt(sharded, loading=False)
    dcp.save(pyt, storage_writer=dcp.FileSystemWriter(str(path)), process_group=group,
             planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))
    if after_shards is not None:
        after_shards()

    def rank0_files() -> None:
        torch.save(common, path / COMMON)
        save_config(CheckpointingConfig("torch_dist", 1), str(path))

    raise_if_any(local_error(rank0_files) if rank == 0 else None, group, device)


def read(sharded_state_dict: dict, path: Path, group: dist.ProcessGroup) -> dict:
    """Load a megatron-core sharded state dict from a torch_dist dir (collective on ``group``); returns the
    loaded state dict (tensors where the sharded ones were, plus ``common.pt``'s entries)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        _replace_sharded_keys_with_state_dict_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
    )
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    common = read_common(path)
    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    merge(common, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)
    check = [t for t in nested_values(sharded) if isinstance(t, ShardedTensor)]
    pyt, flat_mapping, rename = _pyt(sharded, loading=True)
    dcp.load(pyt, storage_reader=dcp.FileSystemReader(str(path)), process_group=group,
             planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=check))
    loaded = _replace_sharded_keys_with_state_dict_keys({k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()},
                                                        flat_mapping, rename)
    _restore_dict_types(loaded, sharded)
    merge(common, loaded)
    return apply_factory_merges(common, factories)


# ----------------------------------------------------------------------------- optimizer and RNG
def _owner_replica(replica_id):
    """``--use-distributed-optimizer``: the owning DP rank writes the state (DP position of megatron-core's
    replica id, its last entry, set to 0); the TP/PP positions stay as the parameter's."""
    if isinstance(replica_id, tuple):
        return replica_id[:-1] + (0,)
    return 0


def optim_sharded(model_sd: dict, optimizer: torch.optim.Optimizer, *, owner_writes: bool) -> dict[str, Any]:
    """``optimizer.state.{exp_avg,exp_avg_sq}.<param key>`` for every parameter with state on this rank,
    laid out like the parameter (megatron-core's ``make_sharded_optimizer_tensor``)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    from miles.trainer.megatron.parallel import local_optimizer

    state = local_optimizer(optimizer).state
    params = {id(p): p for g in local_optimizer(optimizer).param_groups for p in g["params"]}
    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, sh in flat_items(tensors):
        p = params.get(id(sh.data))
        if p is None or p not in state or id(p) in seen:
            continue
        seen.add(id(p))
        base = replace(sh, replica_id=_owner_replica(sh.replica_id)) if owner_writes else sh
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}/{name}"] = make_sharded_optimizer_tensor(base, state[p][k], prefix=f"optimizer.state.{k}")
    return out


def ensure_optim_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's state exists (zero moments) before a load writes into it: one step with zero gradients
    and lr 0 creates it and leaves every parameter bit-identical."""
    from miles.trainer.megatron.parallel import local_optimizer

    local = local_optimizer(opt)
    owned = [p for g in local.param_groups for p in g["params"]]
    if all(p in local.state and local.state[p] for p in owned):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def flat_items(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, leaf) of a nested dict."""
    out = []
    for k, v in d.items():
        out += flat_items(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def optim_step(optimizer: torch.optim.Optimizer) -> int:
    from miles.trainer.megatron.parallel import local_optimizer

    steps = [int(st["step"]) for st in local_optimizer(optimizer).state.values() if "step" in st]
    return max(steps, default=0)


def set_optim_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    from miles.trainer.megatron.parallel import local_optimizer

    for st in local_optimizer(optimizer).state.values():
        if "step" in st:
            st["step"].fill_(step) if isinstance(st["step"], torch.Tensor) else st.__setitem__("step", step)


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)


def rng_object(dropout_state: torch.Tensor, device: torch.device, timeout: float) -> Any:
    """Megatron-LM's ``rng_state`` ShardedObject (shape (PP, TP), replica = DP rank) holding the RNG states of
    every DP rank of this (PP, TP) position (Megatron-LM's ``--data-parallel-random-init`` layout); gathered
    over the DP group with a wait of at most ``timeout`` seconds (tensors on ``device``)."""
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    mine = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": get_cuda_rng_tracker().get_states(),
            "miles_dropout_rng_state": dropout_state}
    if torch.cuda.is_available():
        mine["cuda_rng_state"] = torch.cuda.get_rng_state()
    group = _dp_group()
    states = bounded_all_gather_object(mine, group, timeout, device, "gathering the RNG states of the DP group")
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", states, (pp, tp), (ps.get_pipeline_model_parallel_rank(),
                                                          ps.get_tensor_model_parallel_rank()),
                         replica_id=dist.get_rank(group))


def rng_key_present(path: Path) -> bool:
    """This rank's (PP, TP) ``rng_state`` object is in the checkpoint (same PP and TP sizes)."""
    from megatron.core import parallel_state as ps

    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    key = (f"rng_state/shard_{ps.get_pipeline_model_parallel_rank()}.{ps.get_tensor_model_parallel_rank()}_"
           f"{pp}.{tp}")
    return key in dcp_keys(path)


def restore_rng(states: list, trainer: MegatronTrainer) -> bool:
    """Set this rank's RNG from a loaded ``rng_state`` list; False (nothing set) when the DP size differs."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    group = _dp_group()
    if len(states) != dist.get_world_size(group):
        return False
    s = states[dist.get_rank(group)]
    random.setstate(s["random_rng_state"])
    np.random.set_state(s["np_rng_state"])
    torch.set_rng_state(s["torch_rng_state"])
    if "cuda_rng_state" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(s["rng_tracker_states"])
    if "miles_dropout_rng_state" in s:
        trainer.dropout_rng_state = s["miles_dropout_rng_state"]
    return True


def common_args(trainer: MegatronTrainer) -> argparse.Namespace:
    """The ``args`` Megatron-LM keeps in ``common.pt`` (the fields its loader and tools read)."""
    s, g = trainer.shape, trainer.groups
    return argparse.Namespace(
        tensor_model_parallel_size=g.tp_size, pipeline_model_parallel_size=getattr(g, "pp_size", 1),
        context_parallel_size=getattr(g, "cp_size", 1), expert_model_parallel_size=getattr(g, "ep_size", 1),
        data_parallel_size=g.dp_size, num_layers=s.num_layers, hidden_size=s.hidden_size,
        ffn_hidden_size=s.ffn_hidden_size, num_attention_heads=s.num_attention_heads,
        num_query_groups=s.num_query_groups, kv_channels=s.kv_channels, padded_vocab_size=trainer.padded_vocab,
        vocab_size=s.vocab_size, untie_embeddings_and_output_weights=not s.tie_embeddings,
        use_distributed_optimizer=trainer.distributed_optimizer, ckpt_format="torch_dist")
