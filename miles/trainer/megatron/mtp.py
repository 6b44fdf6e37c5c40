"""Multi-token prediction (``--mtp-num-layers``, ``--enable-mtp-training``, ``--mtp-loss-scaling-factor``): megatron-core's
``MultiTokenPredictionBlock`` built from the checkpoint's MTP layers, as Miles builds it.

    check_mtp_shape(cfg.megatron, shape)    # --mtp-num-layers 1 vs config.json's num_nextn_predict_layers 0 -> ConfigError
    spec = block_spec(config, layer_spec)   # get_gpt_mtp_block_spec (local or transformer-engine spec)
    hidden = attach_loss(model, hidden, ...)   # megatron-core's MTP loss of one micro-batch, attached to hidden

Model: ``GPTModel(..., mtp_block_spec=get_gpt_mtp_block_spec(config, decoder spec))``; each MTP layer is the
decoder's last layer spec (GLM-4.7-Flash, DeepSeek-V3: a MoE layer) behind ``enorm`` (the embedding of token
t + k), ``hnorm`` (the hidden state of token t), ``eh_proj`` (column-parallel over TP, gathered) and a final norm;
the embedding and the output layer are the main model's. The main model's hidden states and logits do not depend on
it: without ``--enable-mtp-training`` the block is loaded, carried (no gradient: its parameters are frozen) and
exported unchanged, and never run.

Training (``--enable-mtp-training``): labels are megatron's (the input tokens shifted left by one), the loss mask
is the response loss mask at the positions that predict a response token; megatron-core rolls both once more per
MTP layer (layer k predicts token t + k + 1). Per layer, the masked mean of megatron-core's vocabulary-parallel
cross entropy over this micro-batch; their mean over the layers x ``--mtp-loss-scaling-factor`` is added to the
training loss through megatron-core's ``MTPLossAutoScaler`` (its gradient enters at the hidden states, scaled
per micro-batch as the policy loss is), and logged as ``mtp_loss`` (unscaled, the step's mean over micro-batches).
Under context parallelism the labels and mask are the whole rows' cut like the input ids (``cp_columns``), and every
shift (ids, positions, labels, mask) crosses the load-balanced chunks (``context_parallel.roll_left``; see
``attach_loss``).

Under pipeline parallelism the block is megatron-core's placement: on the last stage (``get_gpt_mtp_block_spec``
builds it there only), with a copy of the word embedding there (megatron-core's ``mtp_process``: the copy is marked
``shared`` / ``shared_embedding`` like a tied output layer's, loaded from the HF embedding, its gradient summed with
the first stage's over the embedding group in ``parallel.finish_grads``, so both copies take the same update; it is
neither exported nor counted twice). The last stage reads the micro-batch's input ids itself (every stage has them),
so nothing but the hidden states crosses the pipeline. Refused: pipeline parallelism with tied embeddings
(``check_mtp_static``: the last stage would carry an output layer weight the tied head never reads).

Weights (HF GLM-4.7-Flash / DeepSeek-V3 keep MTP layer k as ``model.layers.{num_hidden_layers + k}``):
``mtp.layers.k.enorm`` = ``enorm``, ``hnorm`` = ``hnorm``, ``eh_proj`` = ``eh_proj`` ([h, 2h]: ``[embedding;
hidden]`` columns, as both concatenate them), ``final_layernorm`` = ``shared_head.norm``, and
``mtp.layers.k.transformer_layer.*`` = that layer's decoder-layer tensors (converted as a decoder layer). The
layer's ``embed_tokens`` / ``shared_head.head`` are the main model's embedding and output layer: not loaded,
exported as copies of them.
"""

from __future__ import annotations

import re

import torch

from miles.config.base import ConfigError

_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight"}
COLUMN = ("eh_proj.weight",)


# ------------------------------------------------------------------------------------------- flags
def check_mtp_shape(m, shape) -> None:
    """``--mtp-num-layers`` equals config.json's ``num_nextn_predict_layers`` (one line naming both and the fix)."""
    n = getattr(m, "mtp_num_layers", None) if m is not None else None
    if n is None:
        return
    if int(n) != shape.nextn_layers:
        raise ConfigError(f"--mtp-num-layers {n} does not match --hf-checkpoint's config.json "
                          f"({shape.family.mtp_key} {shape.nextn_layers}): the MTP block is built from the "
                          "checkpoint's MTP layers; pass --mtp-num-layers "
                          f"{shape.nextn_layers}" + (" or drop it" if shape.nextn_layers else ": drop the flag")
                          + " (or use a checkpoint with its MTP layers).")


def check_mtp_static(o, shape) -> None:
    """The MTP block under layouts this backend does not build it for (``o``: ``options.Options``)."""
    if not o.mtp_num_layers:
        return
    if o.pp > 1 and shape.tie_embeddings:
        raise ConfigError(f"--mtp-num-layers {o.mtp_num_layers} with --pipeline-model-parallel-size {o.pp} and tied "
                          "embeddings (config.json's tie_word_embeddings true) is not supported by the Megatron "
                          "backend: use --pipeline-model-parallel-size 1, or drop --mtp-num-layers.")


def check_mtp_tensors(hf: dict, shape) -> None:
    """The checkpoint holds the MTP layers ``--mtp-num-layers`` builds (their own tensors, ``model.layers.{L + k}``)."""
    for k in range(shape.mtp_num_layers):
        for own in _OWN.values():
            name = f"model.layers.{shape.num_layers + k}.{own}"
            if name not in hf:
                raise ConfigError(f"--mtp-num-layers {shape.mtp_num_layers}: --hf-checkpoint has no {name} (its MTP "
                                  f"layer {k}, though config.json's num_nextn_predict_layers is {shape.nextn_layers}): "
                                  "use a checkpoint that stores its MTP layers, or drop --mtp-num-layers.")


def check_mtp_lora(o) -> None:
    """LoRA with an MTP block: carried frozen and not adapted (as Miles's LoRA recipes leave it), so
    ``--enable-mtp-training`` (which would train it) is refused."""
    if o.mtp_num_layers and o.mtp_training:
        raise ConfigError(f"--enable-mtp-training with --lora-rank is not supported by the Megatron backend (the MTP "
                          f"block of --mtp-num-layers {o.mtp_num_layers} is carried frozen and not adapted under LoRA): "
                          "drop --enable-mtp-training or LoRA.")


# ------------------------------------------------------------------------------------------- names
def decoder_name(name: str, num_layers: int) -> str | None:
    """``mtp.layers.k.transformer_layer.X`` -> ``decoder.layers.{num_layers + k}.X`` (the HF layer it converts as)."""
    m = _MTP.match(name)
    if m is None or not m.group(2).startswith("transformer_layer."):
        return None
    return f"decoder.layers.{num_layers + int(m.group(1))}.{m.group(2).removeprefix('transformer_layer.')}"


def own_hf_name(name: str, num_layers: int) -> str | None:
    """The HF name of an MTP layer's own tensor (norms, ``eh_proj``), else None."""
    m = _MTP.match(name)
    if m is None or m.group(2) not in _OWN:
        return None
    return f"model.layers.{num_layers + int(m.group(1))}.{_OWN[m.group(2)]}"


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def shared_copies(name: str, full: torch.Tensor, shape) -> list[tuple[str, torch.Tensor]]:
    """The MTP layers' copies of the embedding / output layer under their HF names (``embed_tokens``,
    ``shared_head.head``), exported with the main model's tensor."""
    if not shape.mtp_num_layers:
        return []
    what = {"embedding.word_embeddings.weight": "embed_tokens.weight",
            "output_layer.weight": "shared_head.head.weight"}.get(name)
    if what is None:
        return []
    return [(f"model.layers.{shape.num_layers + k}.{what}", full[:shape.vocab_size].clone())
            for k in range(shape.mtp_num_layers)]


# ------------------------------------------------------------------------------------------- model
def block_spec(config, layer_spec, *, te: bool):
    """megatron-core's MTP block spec of ``config.mtp_num_layers`` layers like the decoder's last one; None on a
    pipeline stage other than the last (megatron-core places the block there)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=te)


def freeze(model: torch.nn.Module) -> None:
    """Without ``--enable-mtp-training``: the MTP block carried without gradients (its weights never change); a
    pipeline stage without the block has nothing to freeze."""
    if getattr(model, "mtp", None) is None:
        return
    for p in model.mtp.parameters():
        p.requires_grad_(False)


def attach_loss(model, hidden: torch.Tensor, kwargs: dict, labels: torch.Tensor, loss_mask: torch.Tensor,
                vocab_size: int) -> torch.Tensor:
    """Run the MTP block on the main hidden states [s, b, h] and attach megatron-core's MTP loss to them
    (``MTPLossAutoScaler``); returns the main hidden states. ``model.mtp_loss_value`` is the (detached, unscaled)
    mean over the MTP layers of each layer's masked mean cross entropy. Under context parallelism ``labels`` /
    ``loss_mask`` are this rank's columns of the whole rows' (``cp_columns``), the rolls cross the chunks
    (``context_parallel.roll_left``), each layer's loss is this rank's sum over the CP group's count (the CP ranks'
    gradients are partial sums, as the main head's) and the logged value is summed over the CP group."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    cp = _cp_group(model)
    if cp is not None:
        install_cp_roll(model, cp)
    out = model.mtp(hidden_states=hidden, embedding=model.embedding, **kwargs)
    n = model.config.mtp_num_layers
    chunks = torch.chunk(out, 1 + n, dim=0)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    main = chunks[0]
    total = main.new_zeros((), dtype=torch.float32)
    for k in range(n):
        logits, _ = model.output_layer(chunks[k + 1], weight=weight)        # [s, b, V / tp]
        start = logits.shape[-1] * _tp_rank(model)                          # this rank's vocabulary shard
        cols = torch.arange(start, start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))    # the vocabulary padding rows
        labels, loss_mask = _roll(labels, cp), _roll(loss_mask, cp)
        num = loss_mask.sum()
        if cp is not None:
            torch.distributed.all_reduce(num, group=cp)
        ce = model.compute_language_model_loss(labels, logits)            # [b, s]
        layer_loss = (ce * loss_mask).sum() / num.clamp(min=1)
        total = total + layer_loss.float().detach()
        main = MTPLossAutoScaler.apply(main, model.config.mtp_loss_scaling_factor / n * layer_loss)
    if cp is not None:
        torch.distributed.all_reduce(total, group=cp)
    model.mtp_loss_value = total / n
    return main


def _cp_group(model):
    cp = getattr(model, "cp_group", None)
    return cp if cp is not None and torch.distributed.get_world_size(cp) > 1 else None


def _roll(x: torch.Tensor, cp) -> torch.Tensor:
    """megatron-core's roll of the MTP inputs (left by one, zero last); under CP across the chunks."""
    if cp is None:
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        return roll_tensor(x, shifts=-1, dims=-1)[0]
    from miles.trainer.megatron import context_parallel

    return context_parallel.roll_left(x, cp)


def install_cp_roll(model, cp) -> None:
    """Each MTP layer's input shift (token t + k + 1's embedding at position t) rolled across the CP chunks with
    ``context_parallel.roll_left`` (megatron-core's CP roll allocates its buffers on CUDA only)."""
    from megatron.core.utils import make_viewless_tensor

    for layer in model.mtp.layers:
        if getattr(layer, "_miles_cp_roll", False):
            continue

        def get_embeddings(input_ids, position_ids, embedding, hidden_states, packed_seq_params=None):
            if packed_seq_params is not None:
                raise ValueError("the MTP block under context parallelism takes padded rows, not packed sequences")
            input_ids, position_ids = _roll(input_ids, cp), _roll(position_ids, cp)
            decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
            return input_ids, position_ids, decoder_input, hidden_states

        layer._get_embeddings = get_embeddings
        layer._miles_cp_roll = True


def _tp_rank(model) -> int:
    tp = getattr(getattr(model, "pg_collection", None), "tp", None)
    return torch.distributed.get_rank(tp) if tp is not None and torch.distributed.get_world_size(tp) > 1 else 0


def labels_and_mask(ids: torch.Tensor, index: torch.Tensor, loss_mask: torch.Tensor, pad_id: int):
    """Megatron's labels [b, s] (the input tokens shifted left by one, ``pad_id`` last) and the loss mask [b, s]:
    the response loss mask at the positions (``index`` into the flattened [b * s]) that predict a response token."""
    labels = torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), pad_id)], dim=1)
    mask = torch.zeros(ids.numel(), dtype=torch.float32, device=ids.device)
    mask[index] = loss_mask.to(device=ids.device, dtype=torch.float32)
    return labels, mask.view(ids.shape)


def cp_columns(labels: torch.Tensor, mask: torch.Tensor, cp_rank: int, cp_size: int):
    """This CP rank's columns (``context_parallel.chunk_columns``) of the whole rows' labels and loss mask."""
    from miles.trainer.megatron import context_parallel

    cols = context_parallel.chunk_columns(labels.shape[1], cp_rank, cp_size, labels.device)
    return labels.index_select(1, cols), mask.index_select(1, cols)


def set_backward_scale(scale: float, device: torch.device) -> None:
    """The factor the attached MTP loss's gradient is multiplied by (the policy loss's per micro-batch scale)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale(torch.tensor(float(scale), device=device))
