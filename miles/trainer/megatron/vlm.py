"""Qwen3-VL on the Megatron backend: transformers' vision tower in front of megatron-core's GPTModel.

    shape = ModelShape.from_hf_config(Qwen3VLConfig)      # the text model's shape, ``vision=True``
    model = build_gpt_model(shape, config, ..., hf_config=hf_config)   # a HiddenGPTModel with ``model.vision``
    hidden = forward(model, input_ids, mm, sequence_parallel=..., tp_rank=..., tp_size=...)   # [s, b, h]

- The language model is the repo's ``HiddenGPTModel`` built from ``text_config`` (Qwen3: qk-norm). The
  checkpoint keeps it under ``model.language_model.*`` (+ ``lm_head.weight`` when untied): ``hf_lm_name`` /
  ``megatron_lm_name`` move between those names and the text model's ``model.*`` ones the converter speaks.
- The vision tower is transformers' ``Qwen3VLVisionModel`` (``AutoModel.from_config(vision_config)``), a
  submodule ``vision`` of the megatron model, replicated on every rank (no TP inside it): its parameters are
  ``vision.<name>`` <-> ``model.visual.<name>``, never TP-sharded (``convert.partition_dim`` is None), so
  ``parallel.finish_grads`` averages them over DP and ``clip_grad_norm`` counts them once. Under
  ``--sequence-parallel`` each TP rank places only its slice of the sequence's image features, so its vision
  gradients are partial: the parameters are marked ``sequence_parallel`` and summed over TP as megatron's
  sequence-parallel norms are. A micro-batch without images leaves them without gradient; ``finish_grads``
  gives every parameter a zero one first, so every rank reduces the same tensors.
- Embeddings: megatron's word embeddings (sequence-scattered under SP), then the image features written at the
  image-token positions of this rank's slice (``torch.where``, differentiable), passed as ``decoder_input``.
- M-RoPE: 3-D positions from transformers' ``Qwen3VLModel.get_rope_index``; the frequencies are interleaved
  by ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies`` and handed to the decoder in megatron's rotary
  format ([s, b, 1, dim], ``cat(freqs, freqs)``) in place of the 1-D ones (``HiddenGPTModel._preprocess``).
- Deepstack: the vision tower's ``deepstack_visual_indexes`` features are added at the image positions after
  decoder layers 0..k-1 (HF ``Qwen3VLTextModel._deepstack_process``), by forward hooks on those layers. The
  hooks add a detached copy through ``_DeepstackAdd``, whose backward stores the gradient; ``_Inject`` on
  the decoder input hands the stored gradients to the vision graph when the decoder's backward reaches it.
  So the vision graph is walked once, also under full recompute (megatron's reentrant checkpoint would
  otherwise backpropagate into it from inside a layer's recomputation).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from miles.config.base import ConfigError

VISION_PREFIX = "vision."                  # the megatron model's submodule
HF_VISION_PREFIX = "model.visual."
HF_LM_PREFIX = "model.language_model."


def is_vlm_config(c: Any) -> bool:
    return getattr(c, "vision_config", None) is not None and getattr(c, "image_token_id", None) is not None


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIX)


def hf_lm_name(text_name: str) -> str:
    """The checkpoint's name of a text-model tensor (``model.layers.0...`` -> ``model.language_model.layers.0...``)."""
    return HF_LM_PREFIX + text_name[len("model."):] if text_name.startswith("model.") else text_name


def text_hf_state(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen3-VL state dict with the language model under the text model's names (vision tensors kept)."""
    return {("model." + k[len(HF_LM_PREFIX):] if k.startswith(HF_LM_PREFIX) else k): v for k, v in hf.items()}


def check_static(o, shape, *, lora: bool = False) -> None:
    """One line for what the Megatron backend does not run with a vision-language model (any loss runs: SFT, and
    the RL losses with old / reference log-probs computed with the images, as the training forward)."""
    if not shape.vision:
        return
    what = "a vision-language --hf-checkpoint (Qwen3-VL)"
    if o.pp > 1:
        raise ConfigError(f"--pipeline-model-parallel-size {o.pp} with {what} is not supported by the Megatron "
                          "backend (the vision tower runs before the first stage); use "
                          "--pipeline-model-parallel-size 1 with tensor (+ --sequence-parallel) and data parallelism.")
    if o.cp > 1:
        raise ConfigError(f"--context-parallel-size {o.cp} with {what} is not supported by the Megatron backend "
                          "(the image features and M-RoPE positions are not split over CP ranks); use "
                          "--context-parallel-size 1.")
    if o.mtp_num_layers:
        raise ConfigError(f"--mtp-num-layers {o.mtp_num_layers} with {what} is not supported by the Megatron "
                          "backend (Qwen3-VL has no MTP layers); drop --mtp-num-layers.")
    if lora:
        raise ConfigError(f"--lora-rank with {what} is not supported by the Megatron backend; drop --lora-rank or "
                          "use --train-backend fsdp.")


# ----------------------------------------------------------------------------- building
def attach_vision(model: torch.nn.Module, hf_config: Any, *, sequence_parallel: bool) -> None:
    """Give the megatron model ``hf_config``'s vision tower (``model.vision``, weights uninitialised until
    ``convert.load_hf_into``), the M-RoPE helpers and the deepstack hooks."""
    from transformers import AutoModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    vision = AutoModel.from_config(hf_config.vision_config)
    for p in vision.parameters():
        p.sequence_parallel = bool(sequence_parallel)      # parallel.finish_grads sums them over TP
    model.vision = vision
    text = hf_config.text_config
    model.vlm = SimpleNamespace(config=hf_config, image_token_id=int(hf_config.image_token_id),
                                rotary=Qwen3VLTextRotaryEmbedding(text),
                                deepstack=len(getattr(hf_config.vision_config, "deepstack_visual_indexes", []) or []),
                                active=None)
    if model.vlm.deepstack > model.config.num_layers:
        raise ConfigError(f"--hf-checkpoint: {model.vlm.deepstack} deepstack layers but only "
                          f"{model.config.num_layers} decoder layers.")
    for i in range(model.vlm.deepstack):
        model.decoder.layers[i].register_forward_hook(functools.partial(_deepstack_hook, model.vlm, i))


def _deepstack_hook(state, i: int, module, args, output):
    run = state.active
    if run is None or run.deepstack is None:
        return output
    hidden, context = output if isinstance(output, tuple) else (output, None)
    hidden = _DeepstackAdd.apply(hidden, run.deepstack[i], run.grads, i)
    return (hidden, context) if isinstance(output, tuple) else hidden


class _DeepstackAdd(torch.autograd.Function):
    """``hidden + feats`` (feats detached); backward stores the features' gradient in ``grads[i]``."""

    @staticmethod
    def forward(ctx, hidden, feats, grads, i):
        ctx.grads, ctx.i = grads, i
        return hidden + feats.to(hidden.dtype)

    @staticmethod
    def backward(ctx, g):
        prev = ctx.grads[ctx.i]
        ctx.grads[ctx.i] = g if prev is None else prev + g
        return g, None, None, None


class _Inject(torch.autograd.Function):
    """Identity on the decoder input; backward also returns the deepstack features' stored gradients (to the
    vision graph, in the same backward pass)."""

    @staticmethod
    def forward(ctx, x, grads, *feats):
        ctx.grads = grads
        ctx.shapes = [(f.shape, f.dtype) for f in feats]
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        out = [ctx.grads[i] if ctx.grads[i] is not None else torch.zeros(s, dtype=d, device=g.device)
               for i, (s, d) in enumerate(ctx.shapes)]
        return (g, None, *[o.to(d) for o, (_, d) in zip(out, ctx.shapes)])


# ----------------------------------------------------------------------------- forward
def rope_positions(hf_config: Any, input_ids: torch.Tensor, mm: dict | None) -> torch.Tensor:
    """Qwen3-VL's 3-D M-RoPE positions [3, b, s] of right-padded rows (transformers' ``get_rope_index``)."""
    b, s = input_ids.shape
    if not mm:
        return torch.arange(s, device=input_ids.device).view(1, 1, s).expand(3, b, s)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    this = SimpleNamespace(config=hf_config,
                           get_vision_position_ids=functools.partial(Qwen3VLModel.get_vision_position_ids, None))
    pos, _ = Qwen3VLModel.get_rope_index(this, input_ids, mm_token_type_ids=mm["mm_token_type_ids"],
                                         image_grid_thw=mm["image_grid_thw"])
    return pos


def rope_freqs(rotary, positions: torch.Tensor) -> torch.Tensor:
    """Interleaved M-RoPE angles in megatron's rotary format [s, b, 1, dim] from positions [3, b, s]."""
    inv = rotary.inv_freq.to(device=positions.device, dtype=torch.float32)
    freqs = positions[..., None].float() * inv                        # [3, b, s, dim / 2]
    emb = rotary.recomposition_frequencies(freqs)                     # [b, s, dim]: cat(interleaved, interleaved)
    return emb.transpose(0, 1).unsqueeze(2).contiguous()


def _local(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a [s, ...] tensor under sequence parallelism."""
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def forward(model, input_ids: torch.Tensor, mm: dict | None, *, sequence_parallel: bool, tp_rank: int,
            tp_size: int, **kw) -> torch.Tensor:
    """The megatron VLM's final-norm hidden states [s(/tp), b, h] of right-padded rows ``input_ids`` [b, s] with
    ``mm`` (``miles.trainer.vlm.batch_inputs``: pixel values, grids, image-token mask; empty without images)."""
    state = model.vlm
    b, s = input_ids.shape
    positions = rope_positions(state.config, input_ids, mm)
    emb = model.embedding(input_ids=input_ids, position_ids=positions[0])          # [s(/tp), b, h]
    run = SimpleNamespace(freqs=rope_freqs(state.rotary, positions), deepstack=None, grads=[None] * state.deepstack)
    if mm:
        vision = model.vision
        out = vision(mm["pixel_values"].to(next(vision.parameters()).dtype), grid_thw=mm["image_grid_thw"],
                     return_dict=True)
        feats = out.pooler_output                                                  # [n_img, h]
        mask = input_ids == state.image_token_id                                   # [b, s]
        n = int(mask.sum())
        if n != feats.shape[0]:
            raise ValueError(f"a micro-batch has {n} image tokens but its images give {feats.shape[0]} features.")
        index = torch.full((b, s), -1, dtype=torch.long, device=input_ids.device)
        index[mask] = torch.arange(n, device=input_ids.device)                      # HF's row-major order
        index = index.t()                                                          # [s, b] (megatron's layout)
        if sequence_parallel:
            index = _local(index, tp_rank, tp_size)
        where = (index >= 0).unsqueeze(-1)
        take = index.clamp(min=0)

        def place(f: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
            return torch.where(where, f.to(base.dtype)[take], base)

        ds = [place(f, torch.zeros_like(emb)) for f in out.deepstack_features[:state.deepstack]]
        emb = place(feats, emb)
        if ds:
            run.deepstack = [d.detach() for d in ds]
            emb = _Inject.apply(emb, run.grads, *ds)
    state.active = run          # kept until the next forward: full recompute runs the hooks again in the backward
    model._mrope_freqs = run.freqs
    try:
        return model(input_ids, positions[0], attention_mask=None, decoder_input=emb, **kw)
    finally:
        model._mrope_freqs = None
