"""The Megatron backend's policy forward, from a planned micro-batch to log-probs at its response positions.

    ids, pos, index = padded_batch(mb, pad_id, row_multiple(trainer))    # packed row -> right-padded [b, s] rows
    hidden, index, shard = rows_forward(trainer, model, mb)              # this stage's forward (CP chunks, SP gather)
    h, targets, full = local_hidden(trainer, model, mb)                  # [n, h] at this CP rank's positions
    logp, entropy = policy_forward(trainer, model, mb, with_entropy=True)   # [N] each, the whole micro-batch's

``MegatronTrainer`` (trainer.py) exposes two of these as its hooks: ``_policy_forward`` (the shared step's,
``step.RLTrainer``) and ``_stage_forward`` (the pipeline schedule's, ``pipeline.py``); the routing replay
(``miles.trainer.routing_replay``) wraps those two on the trainer. The critic (``critic.py``) reads
``local_hidden``. Each function takes the trainer for its groups, options and state (``pad_id``,
``vocab_shard``, ``temperature``, the dropout stream); none holds state of its own.

- rows: one sample per row, causal attention; padding follows the real tokens, so it is never attended to; the
  row length is a multiple of 2 x CP (``context_parallel.shard_rows``), x TP under ``--sequence-parallel``.
- context parallelism: each CP rank runs its two chunks of every row and computes log-probs, entropy (and the
  critic's values) on its own positions; ``RowShard.reassemble`` all-gathers them into micro-batch order.
- ``--sequence-parallel``: the last stage's sequence-split output is all-gathered over TP before the head.
- log-probs: the shared chunked implementation (``miles.trainer.logprobs``), vocabulary-parallel under TP
  (``VocabShard``: no rank materialises the full vocabulary); padding rows of the vocabulary are excluded.
- dropout on CPU: training forwards draw from the trainer's own RNG stream (``dropout_stream``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from miles.trainer import vlm as hf_vlm
from miles.trainer.batching import MicroBatch
from miles.trainer.logprobs import logprobs_and_entropy
from miles.trainer.megatron import context_parallel
from miles.trainer.megatron import model as mmodel
from miles.trainer.megatron import mtp as mtp_mod
from miles.trainer.megatron import vlm as mvlm

if TYPE_CHECKING:
    from miles.trainer.megatron.context_parallel import RowShard
    from miles.trainer.megatron.trainer import MegatronTrainer


def padded_batch(mb: MicroBatch, pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed micro-batch as right-padded rows: (input_ids [b, s], position_ids [b, s], index [N] of the
    response-predicting positions in the flattened [b * s]); ``s`` rounded up to ``multiple``."""
    cu = mb.cu_seqlens.to(device=mb.input_ids.device, dtype=torch.long)
    b = cu.numel() - 1
    s = -(-int(mb.max_seqlen) // multiple) * multiple
    total = int(mb.input_ids.shape[1])                             # = cu[-1], without a device sync
    pos = torch.arange(total, device=cu.device)
    row = torch.searchsorted(cu[1:], pos, right=True)              # sample of each packed position
    flat = row * s + pos - cu[row]
    ids = torch.full((b * s,), pad_id, dtype=mb.input_ids.dtype, device=cu.device)
    ids[flat] = mb.input_ids[0, :total]
    position_ids = torch.arange(s, device=cu.device).unsqueeze(0).expand(b, s)
    return ids.view(b, s), position_ids, flat.index_select(0, mb.logit_index)


def row_multiple(trainer: MegatronTrainer) -> int:
    """What a micro-batch's rows are padded to a multiple of: 2 x CP (``context_parallel.shard_rows``), x TP
    under ``--sequence-parallel`` (megatron-core splits the sequence over TP)."""
    cp = trainer.groups.cp_size
    return (2 * cp if cp > 1 else 1) * (trainer.groups.tp_size if trainer._sequence_parallel else 1)


@contextlib.contextmanager
def dropout_stream(trainer: MegatronTrainer, model) -> Iterator[None]:
    """On CPU, megatron-core's hidden dropout draws from the global torch generator, which other code
    (data, samplers) uses differently on each rank; the ranks of a TP group must draw the same masks.
    Training forwards therefore run on the trainer's own CPU stream (``trainer.dropout_rng_state``: same seed on
    every rank; checkpointed). On GPU megatron-core's seeding of the CUDA generator does this."""
    if trainer.device.type == "cuda" or not model.training or not trainer._dropout:
        yield
        return
    outer = torch.get_rng_state()
    torch.set_rng_state(trainer.dropout_rng_state)
    try:
        yield
    finally:
        trainer.dropout_rng_state = torch.get_rng_state()
        torch.set_rng_state(outer)


def rows_forward(trainer: MegatronTrainer, model, mb: MicroBatch,
                 x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, RowShard | None]:
    """This pipeline stage's forward of ``mb``: (hidden states [s, b, h], index [N] of the response-predicting
    positions in the flattened [b * s], the CP shard); ``x`` is the previous stage's output (None on the first
    stage). With context parallelism the rows are this CP rank's chunks (``context_parallel.shard_rows``: hidden
    [2c, b, h], index [n] into [b * 2c], and the shard that reassembles per-position values), else the shard is
    None. Under ``--sequence-parallel`` the last stage's sequence-split output is all-gathered over TP (backward:
    this rank's part of the replicated gradient); an earlier pipeline stage returns its part [s / tp, b, h], which
    the next stage takes as it is."""
    g, cp = trainer.groups, trainer.groups.cp_size
    ids, pos, index = padded_batch(mb, trainer.pad_id, row_multiple(trainer))
    kw = {}
    if getattr(model, "mtp_training", False) and model.training:   # mtp.py: whole rows; a dummy micro-batch
        #   (zero loss mask) runs the MTP block too, so its MoE all-to-all stays in step with the EP group's
        kw["labels"], kw["loss_mask"] = mtp_mod.labels_and_mask(ids, index, mb.loss_mask, trainer.pad_id)
    shard = None
    if cp > 1:
        shard = context_parallel.shard_rows(ids, pos, index, g.cp_rank, cp)
        ids, pos, index = shard.input_ids, shard.position_ids, shard.local_index
        if kw:                              # ... and this CP rank's columns of them
            kw["labels"], kw["loss_mask"] = mtp_mod.cp_columns(kw["labels"], kw["loss_mask"], g.cp_rank, cp)
    if x is not None:
        model.set_input_tensor(x)
    with dropout_stream(trainer, model):
        if trainer._images is not None:      # Qwen3-VL (vlm.py): the micro-batch's images, M-RoPE, deepstack
            mm = hf_vlm.batch_inputs(trainer._mm or [], mb.sample_ids, ids, trainer._images.image_token_id,
                                     ids.device)
            hidden = mvlm.forward(model, ids, mm, sequence_parallel=trainer._sequence_parallel,
                                  tp_rank=g.tp_rank, tp_size=g.tp_size, **kw)
        else:
            hidden = model(ids, pos, attention_mask=None, **kw)              # [s, b, h]
    if trainer._sequence_parallel and trainer.stage.is_last:    # earlier stages send their part of the sequence
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=g.tp)
    return hidden, index, shard


def _select(out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> [N, h] at the flattened [b * s] positions ``index``."""
    s, b = out.shape[0], out.shape[1]
    return out.transpose(0, 1).reshape(b * s, -1).index_select(0, index)


def local_hidden(trainer: MegatronTrainer, model, mb: MicroBatch, x: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(hidden [n, h] at this CP rank's response-predicting positions, their targets [n], ``full``:
    per-position values of those positions [n] -> the whole micro-batch's [N], on every CP rank; without
    CP all N positions and the identity). ``x``: the previous pipeline stage's output (last stage)."""
    hidden, index, shard = rows_forward(trainer, model, mb, x)
    h = _select(hidden, index)
    if shard is None:
        return h, mb.targets, lambda t: t
    return h, mb.targets.index_select(0, shard.mine), lambda t: shard.reassemble(t, trainer.groups.cp)


def policy_forward(trainer: MegatronTrainer, model, mb: MicroBatch, *, with_entropy: bool = False,
                   entropy_grad: bool = False, x: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``mb``'s targets; under pipeline parallelism the last stage's, ``x`` its
    input. With context parallelism each CP rank computes its own positions', reassembled per micro-batch."""
    h, targets, full = local_hidden(trainer, model, mb, x)
    if trainer.groups.cp_size == 1:
        return head_logprobs(trainer, model, mb, h, with_entropy=with_entropy, entropy_grad=entropy_grad)
    if h.shape[0] == 0:       # no response position in this rank's chunks: the backward must still run
        lp = h.float().sum(-1) * 0.0                                # (collectives), so stay in the graph
        ent = lp if with_entropy else None
    else:
        lp, ent = head_logprobs(trainer, model, mb, h, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                targets=targets)
    return full(lp), (full(ent) if ent is not None else None)


def head_logprobs(trainer: MegatronTrainer, model, mb: MicroBatch, h: torch.Tensor, *, with_entropy: bool = False,
                  entropy_grad: bool = False, targets: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``mb``'s targets (or ``targets``) from the final hidden states ``h`` [N, h]
    (last stage)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    weight = mmodel.output_weight(model)
    if trainer.vocab_shard is not None:
        h = copy_to_tensor_model_parallel_region(h, group=trainer.groups.tp)   # backward: sum over TP

        def head(x):
            return F.linear(x, weight.to(x.dtype))
    else:                   # the weight itself: logprobs takes its fused path on GPU
        head = weight[:trainer.vocab_size] if weight.shape[0] != trainer.vocab_size else weight
    return logprobs_and_entropy(h, head, mb.targets if targets is None else targets,
                                temperature=trainer.temperature, chunk_size=trainer.cfg.log_probs_chunk_size,
                                with_entropy=with_entropy, entropy_grad=entropy_grad,
                                vocab_shard=trainer.vocab_shard, softcap=trainer.shape.final_logit_softcapping)
