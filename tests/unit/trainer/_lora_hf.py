"""Helpers of the FSDP backend's LoRA tests on real transformers models (``test_lora_hf_{moe,mla,gdn,dsa,dsv4,vlm}.py``): the spec, the fp32 model, and the merged-weights reference (the
adapter forward against a plain model whose weights are ``W + (alpha / r) B @ A``, what the weight export adds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from miles.config.lora import resolve
from miles.trainer import lora


def lora_spec(targets: str | tuple[str, ...], shared: bool = False) -> lora.LoraSpec:
    """Rank 4, alpha 8 (alpha / r = 2), no dropout; ``targets``: ``--target-modules``'s text, or Megatron leaf names."""
    leaves = resolve(targets).leaves if isinstance(targets, str) else targets
    return lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=leaves, experts_shared_outer=shared)


def hf_model(path: Path) -> torch.nn.Module:
    """The checkpoint as transformers loads it, fp32 (the MLA aliases registered: Kimi-K2's and GLM-4.7-Flash's)."""
    from transformers import AutoModelForCausalLM

    from miles.utils.hf_aliases import register_hf_aliases

    register_hf_aliases()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@dataclass
class MergedReference:
    ids: torch.Tensor           # the token ids (2 x seq_len) every forward ran on
    base_exact: bool            # B = 0: the adapter forward gave the base model's logits bit for bit
    err: float                  # max |adapter forward - merged weights' forward| with random A and B
    moved: float                # max |adapter forward - base forward|: how far the adapters move the logits


def merged_reference(model: torch.nn.Module, base: torch.nn.Module, ad, seq_len: int = 12) -> MergedReference:
    """``model`` holds the adapters ``ad`` (B = 0 as attached), ``base`` a plain copy of the checkpoint: the logits
    with B = 0, then with every adapter parameter drawn from N(0, 0.3) against ``base`` with ``ad.delta`` added to
    each target (``base`` keeps the merged weights); 2 rows of ``seq_len`` random tokens."""
    torch.manual_seed(0)
    ids = torch.randint(4, 90, (2, seq_len))
    with torch.no_grad():
        ref = base(input_ids=ids).logits
        base_exact = torch.equal(model(input_ids=ids).logits, ref)
        for p in ad.parameters():
            p.normal_(0.0, 0.3)
        hooked = model(input_ids=ids).logits
        sd = base.state_dict()
        for name in ad.hf_targets():
            sd[name] = sd[name] + ad.delta(name)
        base.load_state_dict(sd)
        merged = base(input_ids=ids).logits
    return MergedReference(ids, base_exact, (hooked - merged).abs().max().item(), (hooked - ref).abs().max().item())
