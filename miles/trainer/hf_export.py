"""Write the trained policy as a HF model directory (``--save-hf``).

Weights come from the trainer's ``iter_weight_buckets`` under the source checkpoint's names and shapes (tied
embeddings once, as ``save_pretrained`` writes them; on the FSDP backend transformers 5's load-time conversion
reverted, ``miles.weight_sync.hf_layout``: Nemotron-H's ``backbone.*``, MoE experts per expert), cast to the dtype of
the source checkpoint's config, and are
written by trainer rank 0 as ``model.safetensors`` or, above ``max_shard_bytes``, as numbered shards
with ``model.safetensors.index.json``. Everything else in ``--hf-checkpoint`` except weights
(config, generation config, tokenizer files, chat template) is copied alongside, so the directory
loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``. The write
goes to a temporary sibling directory renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from miles.utils.logging import get_logger

logger = get_logger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def checkpoint_dtype(hf_dir: str | Path) -> torch.dtype:
    """The dtype named in the checkpoint's config.json (``dtype`` or ``torch_dtype``), default bfloat16."""
    from miles.utils.model_dir import ModelDirError

    try:
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"--hf-checkpoint {hf_dir}: config.json is unreadable ({type(e).__name__}: {e}); give a "
                            "local HF model directory written by save_pretrained.") from None
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    return dt if isinstance(dt, torch.dtype) else torch.bfloat16



# SGLang's --dtype choices (sglang_server_args.json) -> torch dtypes; 'auto' is absent: the checkpoint's
_SGLANG_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "float": torch.float32, "float32": torch.float32}


def weight_sync_dtype(hf_dir: str | Path, sglang_dtype: str | None) -> torch.dtype:
    """The dtype the weight sync sends: the one the engines serve. ``sglang_dtype`` is ``--sglang-dtype`` (None or
    ``auto``: the checkpoint's, ``checkpoint_dtype``). An engine casts what it receives to the dtype it holds, so
    weights sent in another dtype would be rounded there (an fp32 trainer's update is below bf16's precision: the
    engine would keep its old values) and would no longer equal the trainer's; cast on the trainer, they do."""
    if sglang_dtype is None or sglang_dtype == "auto":
        return checkpoint_dtype(hf_dir)
    if sglang_dtype not in _SGLANG_DTYPES:
        raise ValueError(f"--sglang-dtype {sglang_dtype!r} is not one of auto, {', '.join(_SGLANG_DTYPES)}")
    return _SGLANG_DTYPES[sglang_dtype]

def copy_non_weight_files(src: str | Path, dst: str | Path) -> None:
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, Path(dst) / f.name)


def write_hf_dir(out_dir: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], src_dir: str | Path,
                 max_shard_bytes: int = 5 * 1024**3) -> Path:
    """Write (name, CPU tensor) pairs plus the non-weight files of ``src_dir`` to ``out_dir`` (rank 0 only)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.parent / f".tmp.{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata=meta)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata=meta)
            for k, v in shard.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    copy_non_weight_files(src_dir, tmp)
    if out.exists():
        old = out.parent / f".old.{out.name}.{os.getpid()}"
        os.replace(out, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out)
    logger.info("wrote HF model to %s (%d shard(s))", out, len(shards))
    return out
