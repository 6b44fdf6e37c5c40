"""Tiny Qwen3.5-MoE / Qwen3-Next models built locally (no hub): transformers' ``Qwen3_5MoeForCausalLM`` and
``Qwen3NextForCausalLM`` at test size.

    build_tiny_qwen35_model("/tmp/q35")                  # qwen3_5_moe_text: 4 layers, 3 gated DeltaNet + 1 gated attention
    build_tiny_qwen35_model("/tmp/qn", kind="qwen3_next") # the same shape as Qwen3-Next (fused in_proj_qkvz / in_proj_ba)
    build_tiny_qwen35_model("/tmp/qd", kind="qwen3_5")    # dense Qwen3.5 (qwen3_5_text): a SwiGLU MLP per layer
    build_tiny_qwen35_model("/tmp/qv", vlm=True)          # the published Qwen3.5 layout: qwen3_5_moe, text_config

Every part of the family is present at this size: ``layer_types`` (``full_attention_interval`` 4: linear, linear,
linear, full), the gated DeltaNet (``linear_num_value_heads`` twice ``linear_num_key_heads``, so each q/k head serves
two value heads; a depthwise causal conv of ``linear_conv_kernel_dim``; ``A_log``, ``dt_bias``; the gated RMSNorm),
the gated full attention (``q_proj`` holds each head's query and output gate; q/k norms; partial rotary, a quarter
of ``head_dim``), the (1 + w) RMSNorms, MoE with a sigmoid-gated shared expert. Norm weights, ``dt_bias`` and the
router are drawn at random (transformers starts them at 0 / 1) so each part changes the output. ``mtp.*`` weights
are not written (transformers neither builds nor saves them). The tokenizer is ``miles.utils.tiny_model``'s.
"""

from __future__ import annotations

from pathlib import Path

KINDS = ("qwen3_5_moe", "qwen3_next", "qwen3_5")


def build_tiny_qwen35_model(
    out_dir: str | Path,
    *,
    kind: str = "qwen3_5_moe",
    hidden_size: int = 64,
    num_layers: int = 4,
    full_attention_interval: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 8,
    linear_value_head_dim: int = 8,
    linear_conv_kernel_dim: int = 4,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    shared_expert_intermediate_size: int = 48,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    partial_rotary_factor: float = 0.25,
    seed: int = 0,
    dtype: str = "float32",
    vlm: bool = False,
    mtp: bool = False,
) -> Path:
    """Write a randomly initialised ``kind`` causal LM plus the tiny tokenizer to ``out_dir``. ``vlm`` (Qwen3.5 only):
    the layout of the published Qwen3.5 checkpoints instead, ``Qwen3_5MoeForConditionalGeneration`` (config.json
    ``qwen3_5_moe`` with a ``text_config``; the text model under ``model.language_model.``, a one-block vision tower
    under ``model.visual.``), the text model's weights the same as without ``vlm``. ``mtp``: the checkpoint also
    holds one MTP layer as the published ones do (``mtp_num_hidden_layers`` 1; ``mtp.fc``, ``mtp.pre_fc_norm_*``,
    ``mtp.norm``, ``mtp.layers.0.*`` = a full-attention MoE decoder layer), drawn at random: transformers neither
    builds nor reads it."""
    import torch

    from miles.utils.tiny_model import build_tokenizer

    if kind not in KINDS:
        raise ValueError(f"build_tiny_qwen35_model: kind {kind!r} is not one of {KINDS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim, linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        max_position_embeddings=max_position_embeddings, full_attention_interval=full_attention_interval,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                         "partial_rotary_factor": partial_rotary_factor},
        tie_word_embeddings=False, router_aux_loss_coef=0.0, hidden_act="silu", rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(**common, intermediate_size=2 * moe_intermediate_size, decoder_sparse_step=1,
                                 norm_topk_prob=True, mlp_only_layers=[])
        cls = Qwen3NextForCausalLM
    elif kind == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        dense = {k: v for k, v in common.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                             "shared_expert_intermediate_size", "router_aux_loss_coef")}
        config = Qwen3_5TextConfig(**dense, intermediate_size=2 * moe_intermediate_size)
        cls = Qwen3_5ForCausalLM
    else:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        config = Qwen3_5MoeTextConfig(**common)
        cls = Qwen3_5MoeForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight", "q_norm.weight", "k_norm.weight")):
                p.normal_(0.0, 0.2) if not name.endswith("linear_attn.norm.weight") else p.normal_(1.0, 0.2)
            elif name.endswith("dt_bias"):
                p.normal_(1.0, 0.3)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)
    model = model.to(getattr(torch, dtype))
    if vlm:
        if kind != "qwen3_5_moe":
            raise ValueError("build_tiny_qwen35_model: vlm=True is the Qwen3.5 layout (kind qwen3_5_moe)")
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        text = config.to_dict()
        for k in ("architectures", "model_type", "transformers_version"):
            text.pop(k, None)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
        full = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                                                                   tie_word_embeddings=False))
        with torch.no_grad():                   # the same text model: its weights copied in
            lm = model.state_dict()
            for name, p in full.state_dict().items():
                src = "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") \
                    else name
                if src in lm:
                    p.copy_(lm[src])
        model = full.to(getattr(torch, dtype))
        write_image_processor(out)
    if mtp:
        config.mtp_num_hidden_layers = 1
        if vlm:
            model.config.text_config.mtp_num_hidden_layers = 1
    model.save_pretrained(str(out), safe_serialization=True)
    if mtp:
        _add_mtp(out, cls, config, seed, getattr(torch, dtype))
    return out


def _add_mtp(out: Path, cls, config, seed: int, dtype) -> None:
    """Append one random MTP layer's tensors (Qwen3-Next's names) to ``out``'s model.safetensors."""
    import copy

    import torch
    from safetensors.torch import load_file, save_file

    one = copy.deepcopy(config)
    one.num_hidden_layers, one.layer_types = 1, ["full_attention"]
    torch.manual_seed(seed + 1)
    layer = cls(one).model.layers[0]
    h = config.hidden_size
    tensors = {f"mtp.layers.0.{n}": t.detach().clone() for n, t in layer.state_dict().items()}
    tensors = {n: (t.normal_(0.0, 0.2) if n.endswith("norm.weight") else t) for n, t in tensors.items()}
    tensors["mtp.layers.0.mlp.gate.weight"] = torch.randn(config.num_experts, h) * 0.5
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        tensors[name] = torch.randn(h) * 0.2
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.02
    # transformers 5 fuses experts in memory; the checkpoint names them per expert, as save_pretrained writes them
    fused = {n: t for n, t in tensors.items() if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    for n, t in fused.items():
        del tensors[n]
        base = n[:n.rindex(".") + 1]
        for e in range(t.shape[0]):
            if n.endswith("gate_up_proj"):
                gate, up = t[e].chunk(2, dim=0)
                tensors[f"{base}{e}.gate_proj.weight"], tensors[f"{base}{e}.up_proj.weight"] = gate, up
            else:
                tensors[f"{base}{e}.down_proj.weight"] = t[e]
    path = out / "model.safetensors"
    disk = load_file(str(path))
    disk.update({n: t.to(dtype).contiguous() for n, t in tensors.items()})
    save_file(disk, str(path), metadata={"format": "pt"})


def write_image_processor(out: Path) -> None:
    """``preprocessor_config.json`` of the tiny Qwen3.5 vision tower (patch 16, 2 x 2 merge, 2 frames), as the
    published Qwen3.5 checkpoints ship one: transformers' Qwen2-VL image processor (``AutoImageProcessor``'s class
    for ``qwen3_5_moe``; the PIL backend, no torchvision needed), what the FSDP backend's ``vlm.ImageProcessor``
    loads for a vision-language checkpoint."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(str(out))
