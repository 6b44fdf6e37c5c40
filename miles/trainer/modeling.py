"""Model construction: load a HF causal LM, wrap it so log-probs are computed inside the FSDP root
forward, and shard it with FSDP2.

- ``PolicyModel(hf_model)`` has one submodule ``lm`` (the HF model), so parameter names are
  ``lm.<HF name>``; ``hf_name`` strips the prefix. Its forward returns log-probs (and entropy) of
  the response tokens only, via ``logprobs.logprobs_and_entropy`` (chunked).
- ``shard_model`` applies ``fully_shard`` to every transformer block (the classes in the HF model's
  ``_no_split_modules``) and then to the root, over a 1-D DeviceMesh of the trainer group. bf16
  params with fp32 gradient reduction on GPU (``MixedPrecisionPolicy``), fp32 on CPU unless --bf16.
  ``offload=True`` keeps the shards in (pinned) CPU memory (``CPUOffloadPolicy``): used for the
  reference and teacher models, which then stay off the accelerator between uses.
- Attention: on GPU, when ``torch.nn.attention.varlen.varlen_attn`` exists and the model has no
  sliding window, a varlen flash-attention function is registered with transformers as
  ``miles_varlen`` and reads ``cu_seq_lens_q``/``max_length_q`` of the packed row; elsewhere SDPA with
  the block-diagonal mask transformers derives from the restarting ``position_ids`` (eager attention with that
  mask for gpt-oss, whose sinks transformers computes only there; DeepSeek-V4: eager, one right-padded row per
  sample, ``NO_PACKING``).
- On GPU the models' RMSNorm, SwiGLU MLP and q/k RoPE run compiled forwards of transformers' own expressions
  (``hf_fusions.py``: only classes whose code is the verified form).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from miles.config.base import ConfigError
from miles.trainer.logprobs import logprobs_and_entropy
from miles.utils.logging import get_logger

logger = get_logger(__name__)

PREFIX = "lm."
EAGER_ONLY = ("gpt_oss", "deepseek_v4")   # no SDPA path in transformers (attention sinks; V4's compressed entries)
# models whose forward cannot take several samples packed in one row: DeepSeek-V4's compressors pool windows of the
# row and see earlier windows whatever the position ids say; Inkling's short convolutions mix each token with the
# ones before it along the row, the previous sample's included (each sample runs as its own right-padded row)
NO_PACKING = ("deepseek_v4", "inkling_text")
VARLEN_ATTN = "miles_varlen"
_registered = False


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, **kwargs):
    """transformers attention interface: q [1, Hq, T, D], k/v [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None or max_len is None:
        raise RuntimeError("miles_varlen attention needs cu_seq_lens_q and max_length_q (pass them to the forward).")
    if query.shape[0] != 1:
        raise RuntimeError("miles_varlen attention expects one packed row (batch size 1).")
    fn = _varlen_fn()
    params = inspect.signature(fn).parameters
    q = query[0].transpose(0, 1)                                   # [T, Hq, D]
    k = key[0].transpose(0, 1)                                     # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    kw = {}
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    elif q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if "scale" in params:
        kw["scale"] = scaling
    out = fn(q, k, v, cu, cu, int(max_len), int(max_len), **kw)    # [T, Hq, D]
    return out.unsqueeze(0), None


def register_varlen_attention() -> bool:
    """Register ``miles_varlen`` with transformers; False when torch has no varlen attention."""
    global _registered
    if _registered:
        return True
    if _varlen_fn() is None:
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTN, _varlen_attention)
    _registered = True
    return True


def choose_attention(device: torch.device, config) -> str:
    """The attention implementation for the trainer on ``device`` (see module docstring)."""
    if getattr(config, "model_type", None) in EAGER_ONLY:
        return "eager"
    if device.type == "cuda" and getattr(config, "sliding_window", None) in (None, 0) and not getattr(
            config, "use_sliding_window", False) and register_varlen_attention():
        return VARLEN_ATTN
    return "sdpa"


def load_hf_model(path: str | Path, device: torch.device, *, causal_lm: bool = True,
                  flag: str | None = None) -> nn.Module:
    """Load a local HF model on CPU in float32 (the master weights), with the trainer's attention; for a CUDA
    ``device``, its RMSNorm, SwiGLU and RoPE modules run fused forwards of the same math (``hf_fusions.apply``).

    The directory is checked first (``miles.utils.model_dir``): a missing path, a directory that is not a
    model or a truncated safetensors file raises ``ModelDirError``, one line naming ``flag`` (the flag the
    path came from, e.g. ``--ref-load``; "model directory" when not given), the path and the file."""
    from transformers.utils import logging as hf_logging

    from miles.trainer import vlm
    from miles.utils.model_dir import load_config

    path = Path(path)
    config = load_config(path, flag)
    hf_logging.disable_progress_bar()
    # a VLM runs right-padded rows (its 3-D positions are per row: miles.trainer.vlm), so never varlen
    attn = "sdpa" if vlm.is_vlm(config) else choose_attention(device, config)
    cls = auto_class(config, causal_lm=causal_lm)
    try:
        model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn)
    except ModuleNotFoundError as e:     # the model class imports an optional package when built (Inkling's tower)
        raise missing_package_error(e, path, flag, config, cls) from None
    model.config.use_cache = False
    if device.type == "cuda":     # fused RMSNorm / SwiGLU / RoPE forwards of the same math (hf_fusions.py)
        from miles.trainer import hf_fusions

        patched = hf_fusions.apply(model)
        logger.info("fused forwards (hf_fusions): %s", "; ".join(f"{k} {', '.join(v) or '-'}" for k, v in patched.items()))
    return model


def auto_class(config, *, causal_lm: bool = True):
    """The transformers auto class ``load_hf_model`` builds ``config`` with (a VLM: image-text-to-text; the critic's
    backbone, ``causal_lm=False``: ``AutoModel``)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    from miles.trainer import vlm

    return (AutoModelForImageTextToText if vlm.is_vlm(config) else AutoModelForCausalLM) if causal_lm else AutoModel


# the FSDP backend's words in ``miles.utils.build_imports``' line (who builds the class, the other way to run)
FSDP_BUILDS = "the FSDP backend builds"
FSDP_ALTERNATIVE = "add --train-backend megatron"


def check_buildable(path: str | Path, flag: str | None, *, causal_lm: bool = True) -> None:
    """Preflight of ``load_hf_model(path, causal_lm=...)`` without building the model
    (``miles.utils.build_imports.check_buildable``: the class's modeling module and the parts of its build that import
    a package lazily); a missing package is ``missing_package_error``'s one line."""
    from miles.utils import build_imports
    from miles.utils.model_dir import load_config

    config = load_config(path, flag, check=False)
    build_imports.check_buildable(config, auto_class(config, causal_lm=causal_lm), path, flag, builder=FSDP_BUILDS,
                                  alternative=FSDP_ALTERNATIVE)


def preflight_check(cfg, hf_config: dict | None) -> None:
    """The FSDP backend's preflight (``miles.run.preflight``): every model it builds (the policy; the reference and
    the OPD teacher when given; the PPO critic's backbone) imports what its transformers class needs."""
    train, algo = cfg.train, cfg.algo
    if hf_config is None or not train.hf_checkpoint or cfg.cluster.debug_rollout_only:
        return
    builds = [("--hf-checkpoint", train.hf_checkpoint, True)]
    builds += [(f, p, True) for f, p in (("--ref-load", train.ref_load),
                                         ("--opd-teacher-load", getattr(algo, "opd_teacher_load", None))) if p]
    if algo.loss_type != "sft_loss" and algo.advantage_estimator == "ppo":
        builds.append(("--critic-load", train.critic_load, False) if train.critic_load
                      else ("--hf-checkpoint", train.hf_checkpoint, False))
    for flag, path, causal_lm in builds:
        try:
            check_buildable(path, flag, causal_lm=causal_lm)
        except ConfigError:
            raise
        except Exception:       # noqa: BLE001 -- a bad directory is the path checks' line (miles.run.preflight)
            continue


def missing_package_error(e: ModuleNotFoundError, path: str | Path, flag: str | None, config,
                          auto_cls) -> ConfigError:
    """The FSDP backend's one line for a transformers model class that needs a Python package not installed here
    (``miles.utils.build_imports.missing_package_error``: the flag and path, the class, the package and the fix)."""
    from miles.utils import build_imports

    return build_imports.missing_package_error(e, path, flag, config, auto_cls, builder=FSDP_BUILDS,
                                               alternative=FSDP_ALTERNATIVE)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules whose class is in the HF model's ``_no_split_modules``."""
    from miles.trainer.vlm import is_vision_block

    names = set(getattr(model, "_no_split_modules", None) or [])
    # a VLM's vision blocks stay in the root unit: every rank gathers them, with or without images (vlm.py)
    blocks = [m for m in model.modules() if type(m).__name__ in names and not is_vision_block(m)]
    if not blocks:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__} (its _no_split_modules is "
                         f"{sorted(names)}); the FSDP backend supports HF decoder-only models.")
    return blocks


def base_model(hf_model: nn.Module) -> nn.Module:
    return getattr(hf_model, hf_model.base_model_prefix)


def attn_kwargs(hf_model: nn.Module, cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """Extra forward kwargs the attention implementation needs for a packed row."""
    if hf_model.config._attn_implementation == VARLEN_ATTN:
        return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
                "max_length_q": max_seqlen, "max_length_k": max_seqlen}
    return {}


class PolicyModel(nn.Module):
    """HF causal LM whose forward returns log-probs (and entropy) of the response tokens."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.lm = hf_model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logit_index: torch.Tensor,
                targets: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *, temperature: float = 1.0,
                chunk_size: int = 1024, with_entropy: bool = False, entropy_grad: bool = False,
                mm: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids/position_ids [1, T] (a packed row) or [B, L] (right-padded rows, no mask needed: causal
        attention never reaches the padding); logit_index [N] into the flattened [B*T] positions, targets [N]
        -> (log-probs [N], entropy [N] | None). ``mm``: a VLM's image inputs (``miles.trainer.vlm``; {} for
        a micro-batch without images); the model then computes its own (3-D) positions."""
        extra = {}
        if mm is not None:
            extra, position_ids = mm, None
        out = base_model(self.lm)(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                  **attn_kwargs(self.lm, cu_seqlens, max_seqlen), **extra)
        hidden = out.last_hidden_state.flatten(0, 1).index_select(0, logit_index)   # [B*T, H] -> [N, H]
        if (mup := logits_mup_width_multiplier(self.lm.config)) != 1.0:
            hidden = hidden / mup
        lp, ent = logprobs_and_entropy(hidden, self.lm.get_output_embeddings(), targets, temperature=temperature,
                                       chunk_size=chunk_size, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                       softcap=final_logit_softcapping(self.lm.config))
        if mm is not None and "pixel_values" not in mm:  # same gradients on every rank (miles.trainer.vlm)
            from miles.trainer.vlm import vision_anchor

            lp = lp + vision_anchor(self.lm).to(lp.dtype)
        return lp, ent


def logits_mup_width_multiplier(config) -> float:
    """What the HF model divides its final hidden states by before its head (Inkling's muP
    ``logits_mup_width_multiplier``, on the multimodal config its text config's; 1: none): its forward does, so the
    log-probs computed from its hidden states do too."""
    text = getattr(config, "text_config", None) or config
    return float(getattr(text, "logits_mup_width_multiplier", None) or 1.0)


def final_logit_softcapping(config) -> float:
    """The HF model's final logit softcapping (Gemma 2/3/4: ``final_logit_softcapping``, on a VLM its text config's;
    0: none): its forward caps the logits, so the log-probs computed from its hidden states cap them too."""
    text = getattr(config, "text_config", None) or config
    return float(getattr(text, "final_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None)
                 or 0.0)


def hf_name(name: str) -> str:
    """``lm.model.layers.0...`` -> ``model.layers.0...`` (the HF checkpoint's name)."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def mixed_precision(device: torch.device, bf16: bool | None):
    """The MixedPrecisionPolicy: bf16 params + fp32 reduction when bf16 (default on GPU), else None."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    use_bf16 = device.type == "cuda" if bf16 is None else bf16
    if not use_bf16:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(module: nn.Module, blocks: list[nn.Module], mesh, *, mp_policy=None, offload: bool = False,
                recompute: bool = False) -> nn.Module:
    """fully_shard every block, then the root; optional activation checkpointing of the blocks."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if recompute:
        _enable_recompute(blocks)
    kw = {"mesh": mesh}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    on_gpu = mesh.device_type == "cuda"
    kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True) if (offload and on_gpu) else OffloadPolicy()
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(module, **kw)
    return module


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` was wrapped by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def reshard_all(module: nn.Module) -> None:
    """Reshard every FSDP2 module under ``module``. FSDP2 leaves the root unsharded after a forward
    (it expects the backward next); after a forward-only pass we free it explicitly, and weight
    iteration and checkpoints always see the sharded fp32 parameters."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _enable_recompute(blocks: list[nn.Module]) -> None:
    """Non-reentrant activation checkpointing of each block's forward (parameter names unchanged)."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        if getattr(block, "_miles_recompute", False):
            continue
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._miles_recompute = True


def count_params(module: nn.Module) -> int:
    """Number of parameters of the unsharded model (shared tensors once)."""
    return sum(p.numel() for p in module.parameters())
