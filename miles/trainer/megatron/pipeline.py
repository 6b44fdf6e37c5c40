"""Pipeline parallelism on the Megatron backend (``--pipeline-model-parallel-size N``): our own 1F1B schedule
over torch.distributed point-to-point ops (gloo on CPU, NCCL on GPU), every wait bounded by the trainer's timeout.

    counts = stage_layer_counts(num_layers=8, pp=2, first=None, last=None)   # [4, 4]; split flags checked
    stage = Stage.from_parallel_state(timeout=600.0)                         # this rank's place in its pipeline
    losses = train_1f1b(stage, n, shape_of, forward, device=dev)             # forward + backward of n micro-batches
    outs = forward_only(stage, n, shape_of, forward, device=dev)             # last stage: every forward's output

Layout: megatron-core's ``tp-cp-ep-dp-pp`` order over the trainer ranks, so a stage is a block of TP (x DP)
ranks and stage ``s`` holds the decoder layers megatron-core assigns it (``--decoder-first-pipeline-num-layers``
/ ``--decoder-last-pipeline-num-layers``, the rest split evenly); the first stage also holds the embedding, the
last the final norm and output layer (with tied embeddings a copy of the embedding, kept equal by summing the
two copies' gradients over megatron-core's embedding group, ``parallel.finish_grads``).

Why our own schedule rather than megatron-core's ``get_forward_backward_func``: its p2p layer allocates on
``torch.cuda.current_device()``, batches ops with ``batch_isend_irecv`` and needs fixed tensor shapes or a shape
exchange; the trainer's micro-batches are right-padded ``[b, s]`` rows of varying size that every stage of a
pipeline already knows (the ranks of one pipeline train the same samples), and the loss needs the RL inputs of
the shared trainer code. The schedule is Megatron's non-interleaved 1F1B: stage ``s`` of ``P`` runs
``min(P - s - 1, n)`` warm-up forwards, then alternates one forward and one backward, then drains the
remaining backwards; so at most ``P - s`` micro-batches' activations are alive on stage ``s``. Each exchange
posts its send and its receive together (``isend``/``irecv``; even stages send first, odd stages receive first,
as megatron-core's unbatched p2p does, so a NCCL pair's in-order stream never waits on itself) and waits for
both, which matches the neighbour's order and cannot deadlock. Hidden states travel as ``[s, b, h]`` in the parameters' dtype,
``s`` this rank's part of the padded rows: its two chunks under context parallelism, its TP part under
``--sequence-parallel`` (the last stage gathers it over TP and reassembles the log-probs over CP, as one stage does).
MoE layers run their all-to-all over the stage's own EP group; every rank of a stage runs the same schedule.
Interleaved (virtual) stages are not implemented: ``--num-layers-per-virtual-pipeline-stage`` and
``--num-virtual-stages-per-pipeline-rank`` are refused by name.

Names: a stage's parameters are ``decoder.layers.<local i>``; ``global_named_parameters`` renames them to the
model-wide layer number megatron-core gave the layer (``layer_number - 1``), so the HF conversion, the weight
export and the checkpoints see the same names as with one stage (``global_exported_buffers``: the family's buffers
loaded and exported with them, the DeepSeek-style routers' expert bias).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from miles.config.base import ConfigError
from miles.utils.process_groups import LOG_HINT, wait_timeout_message

if TYPE_CHECKING:
    from miles.trainer.megatron.model import ModelShape
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.metrics import MetricSums

_LAYER = re.compile(r"^(.*?)decoder\.layers\.(\d+)\.(.+)$")


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Decoder layers per stage (megatron-core's split): ``first``/``last`` layers on the end stages when given,
    the rest evenly over the other stages. One line naming the flag when the split does not work."""
    if pp == 1:
        if first is not None or last is not None:
            name = "--decoder-first-pipeline-num-layers" if first is not None else "--decoder-last-pipeline-num-layers"
            raise ConfigError(f"{name} needs --pipeline-model-parallel-size > 1 (got 1): drop it.")
        return [num_layers]
    if num_layers < pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is more than config.json's num_hidden_layers "
                          f"{num_layers}: every stage needs at least one layer; choose at most {num_layers}.")
    rest, middle = num_layers, pp
    for name, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if v is not None:
            rest, middle = rest - v, middle - 1
            if v >= num_layers:
                raise ConfigError(f"{name} {v} leaves no layer for the other stages (config.json's num_hidden_layers "
                                  f"{num_layers}); choose fewer.")
    if middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % middle):
        given = ", ".join(f"{n} {v}" for n, v in (("--decoder-first-pipeline-num-layers", first),
                                                  ("--decoder-last-pipeline-num-layers", last)) if v is not None)
        what = f"with {given} " if given else ""
        raise ConfigError(f"--pipeline-model-parallel-size {pp} {what}cannot split config.json's num_hidden_layers "
                          f"{num_layers}: the remaining {rest} layers must divide evenly over the {middle} other "
                          "stage(s), at least one each; change the split flags or the pipeline size.")
    even = rest // middle if middle else 0
    return [first if (i == 0 and first is not None) else last if (i == pp - 1 and last is not None) else even
            for i in range(pp)]


# ---------------------------------------------------------------------------------------------- names
def global_name(model: nn.Module, name: str) -> str:
    """``decoder.layers.<i>.x`` (this stage's i-th layer) -> ``decoder.layers.<global layer index>.x``."""
    m = _LAYER.match(name)
    if m is None:
        return name
    prefix, i, rest = m.group(1), int(m.group(2)), m.group(3)
    layer = model.get_submodule(f"{prefix}decoder.layers")[i]
    return f"{prefix}decoder.layers.{int(layer.layer_number) - 1}.{rest}"


def global_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(global_name(model, n), p) for n, p in model.named_parameters()]


def global_exported_buffers(model: nn.Module, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """The family's buffers loaded and exported with the parameters (``Family.exported_buffers``: the DeepSeek-style
    routers' ``expert_bias``), under global layer names."""
    return [(global_name(model, n), b) for n, b in shape.family.exported_buffers(model)]


def is_tied_copy(p: torch.Tensor) -> bool:
    """The last stage's copy of a tied embedding (megatron-core marks it ``shared``): not exported and not
    counted twice in the gradient norm."""
    return bool(getattr(p, "shared", False))


@torch.no_grad()
def load_hf_into(model: nn.Module, hf: dict[str, torch.Tensor], shape: ModelShape, padded_vocab: int, tp_rank: int,
                 tp_size: int, ep_rank: int = 0, ep_size: int = 1) -> None:
    """``convert.load_hf_into`` for one pipeline stage: layers by their global index, this EP rank's experts by
    their global index (``moe.global_name``), the family's exported buffers (the routers' expert bias) as
    parameters, and the last stage's copy of a tied embedding (or of the embedding the MTP block reads, mtp.py) from
    the HF embedding."""
    from miles.trainer.megatron import convert, moe, mtp

    num_local = shape.num_experts // ep_size if shape.num_experts else 0
    named = [(moe.global_name(n, ep_rank, num_local), p)
             for n, p in global_named_parameters(model) + global_exported_buffers(model, shape)]
    sources = ["embedding.word_embeddings.weight" if is_tied_copy(p) else n for n, p in named]
    hf = convert.family_hf_state(hf, shape)
    mtp.check_mtp_tensors(hf, shape)              # every stage: the same one line where the MTP layers are missing
    full = convert.hf_to_megatron(hf, shape, padded_vocab, sorted(set(sources)))
    for (name, p), src in zip(named, sources):
        piece = convert.shard(src, full[src], convert.partition_dim(src), tp_rank, tp_size, shape)
        if tuple(piece.shape) != tuple(p.shape):
            raise ValueError(f"HF weight for {name}: shape {tuple(piece.shape)} does not fit the megatron "
                             f"parameter {tuple(p.shape)} (config.json and the weights disagree).")
        p.copy_(piece.to(p.dtype))


# ---------------------------------------------------------------------------------------------- p2p
@dataclass(frozen=True)
class Stage:
    """This rank's stage of its pipeline; ``prev``/``next``/``last_rank`` are global ranks."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    prev: int
    next: int
    first_rank: int
    last_rank: int
    timeout: float

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def from_parallel_state(cls, timeout: float) -> Stage:
        from megatron.core import parallel_state as ps

        size = ps.get_pipeline_model_parallel_world_size()
        if size == 1:
            me = dist.get_rank()
            return cls(group=None, rank=0, size=1, prev=me, next=me, first_rank=me, last_rank=me, timeout=timeout)
        return cls(group=ps.get_pipeline_model_parallel_group(), rank=ps.get_pipeline_model_parallel_rank(),
                   size=size, prev=ps.get_pipeline_model_parallel_prev_rank(),
                   next=ps.get_pipeline_model_parallel_next_rank(),
                   first_rank=ps.get_pipeline_model_parallel_first_rank(),
                   last_rank=ps.get_pipeline_model_parallel_last_rank(), timeout=timeout)


def wait_all(works: list, stage: Stage, what: str) -> None:
    """Wait for point-to-point or collective work, at most ``stage.timeout`` seconds each."""
    for w in works:
        try:
            ok = w.wait(timeout=timedelta(seconds=stage.timeout))
        except RuntimeError as e:
            raise TimeoutError(_timeout_message(stage, what, e)) from e
        if ok is False:
            raise TimeoutError(_timeout_message(stage, what))


def _timeout_message(stage: Stage, what: str, error: BaseException | None = None) -> str:
    """``wait_timeout_message`` for a stage: the stage named, its neighbours (global ranks) what to check."""
    ranks = sorted({stage.prev, stage.next} - {dist.get_rank()}) or [stage.prev]
    named = f"global rank{'s' if len(ranks) > 1 else ''} {' and '.join(map(str, ranks))}"
    return wait_timeout_message(f"pipeline stage {stage.rank} of {stage.size}: {what}", stage.group, stage.timeout,
                                size=stage.size, error=error,
                                check=f"that the neighbouring stages ({named}) are alive and reached this call "
                                      f"({LOG_HINT})")


class _Pipe:
    """The exchanges of one schedule with the neighbouring stages (no-ops at the pipeline's ends)."""

    def __init__(self, stage: Stage, device: torch.device, dtype: torch.dtype = torch.float32):
        self.stage, self.device, self.dtype = stage, device, dtype

    def _exchange(self, send: list[tuple[torch.Tensor, int]], recv: list[tuple[tuple, int]],
                  what: str) -> list[torch.Tensor]:
        ops, outs = [], []

        def post_sends() -> None:
            for t, peer in send:
                ops.append(dist.isend(t.detach().contiguous(), dst=peer, group=self.stage.group))

        def post_recvs() -> None:
            for shape, peer in recv:
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                ops.append(dist.irecv(buf, src=peer, group=self.stage.group))
                outs.append(buf)

        # even stages send first, odd stages receive first: on NCCL a pair's sends and receives run in order on
        # one stream, so both neighbours sending first would wait on each other (gloo does not care)
        for post in ((post_sends, post_recvs) if self.stage.rank % 2 == 0 else (post_recvs, post_sends)):
            post()
        wait_all(ops, self.stage, what)
        return outs

    def recv_forward(self, shape) -> torch.Tensor | None:
        if self.stage.is_first:
            return None
        (x,) = self._exchange([], [(shape, self.stage.prev)], "receiving activations")
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.stage.is_last:
            self._exchange([(y, self.stage.next)], [], "sending activations")

    def recv_backward(self, shape) -> torch.Tensor | None:
        if self.stage.is_last:
            return None
        (g,) = self._exchange([], [(shape, self.stage.next)], "receiving gradients")
        return g

    def send_backward(self, g: torch.Tensor | None) -> None:
        if not self.stage.is_first:
            self._exchange([(g, self.stage.prev)], [], "sending gradients")

    def send_forward_recv_backward(self, y: torch.Tensor, shape) -> torch.Tensor | None:
        if self.stage.is_last:
            return None
        (g,) = self._exchange([(y, self.stage.next)], [(shape, self.stage.next)], "sending activations")
        return g

    def send_backward_recv_forward(self, g: torch.Tensor | None, shape) -> torch.Tensor | None:
        if self.stage.is_first:
            return None
        (x,) = self._exchange([(g, self.stage.prev)], [(shape, self.stage.prev)], "sending gradients")
        return x.requires_grad_()


Forward = Callable[[int, "torch.Tensor | None"], torch.Tensor]


def train_1f1b(stage: Stage, n: int, shape_of: Callable[[int], tuple], forward: Forward, *,
               device: torch.device, dtype: torch.dtype = torch.float32) -> None:
    """Forward and backward of micro-batches ``0..n-1`` in the 1F1B order (module docstring). ``forward(i, x)``
    gets this stage's input (None on the first stage) and returns the activations to send (``dtype``,
    ``shape_of(i)``), or on the last stage the scalar loss to backpropagate; gradients accumulate in ``.grad``."""
    pipe = _Pipe(stage, device, dtype)
    warmup = 0 if stage.is_last else min(stage.size - stage.rank - 1, n)
    pending: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
        y = forward(i, x)
        pending.append((x, y))
        return y

    def bwd(grad_y: torch.Tensor | None) -> torch.Tensor | None:
        x, y = pending.popleft()
        if y.requires_grad:            # LoRA: a first stage without adapters (the base frozen) has nothing to train
            torch.autograd.backward(y, grad_y)
        if x is None:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    for i in range(warmup):
        pipe.send_forward(fwd(i, pipe.recv_forward(shape_of(i))))
    steady = n - warmup
    x = pipe.recv_forward(shape_of(warmup)) if steady > 0 else None
    for k in range(steady):
        i = warmup + k
        grad_y = pipe.send_forward_recv_backward(fwd(i, x), shape_of(k))      # the oldest pending is k
        grad_x = bwd(grad_y)
        if k + 1 < steady:
            x = pipe.send_backward_recv_forward(grad_x, shape_of(i + 1))
        else:
            pipe.send_backward(grad_x)
    for k in range(steady, n):
        pipe.send_backward(bwd(pipe.recv_backward(shape_of(k))))


@torch.no_grad()
def forward_only(stage: Stage, n: int, shape_of: Callable[[int], tuple], forward: Forward, *,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> list:
    """Forward passes of micro-batches ``0..n-1`` through the pipeline; the last stage returns what ``forward``
    returned for each, the other stages an empty list. A stage sends micro-batch i while computing i + 1."""
    pipe = _Pipe(stage, device, dtype)
    outs, sending = [], None
    for i in range(n):
        x = pipe.recv_forward(shape_of(i)) if not stage.is_first else None
        y = forward(i, x.detach() if x is not None else None)
        if stage.is_last:
            outs.append(y)
            continue
        if sending is not None:
            wait_all([sending[0]], stage, "sending activations")
        y = y.detach().contiguous()
        sending = (dist.isend(y, dst=stage.next, group=stage.group), y)
    if sending is not None:
        wait_all([sending[0]], stage, "sending activations")
    return outs


def broadcast_from_last(stage: Stage, t: torch.Tensor) -> torch.Tensor:
    """``t`` (the last stage's; a buffer of the same shape and dtype elsewhere) on every stage of the pipeline."""
    if stage.size > 1:
        wait_all([dist.broadcast(t, src=stage.last_rank, group=stage.group, async_op=True)], stage,
                 "broadcasting the last stage's results")
    return t


def broadcast_object_from_last(stage: Stage, obj: Any, device: torch.device) -> Any:
    """The last stage's picklable ``obj`` on every stage (the others pass anything): its pickled size, then its
    bytes, each broadcast waited on for at most ``stage.timeout`` (``broadcast_object_list`` has no bounded
    wait on NCCL)."""
    if stage.size == 1:
        return obj
    import pickle

    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if stage.is_last else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    n = int(broadcast_from_last(stage, size).item())
    buf = payload.to(device) if payload is not None else torch.empty(n, dtype=torch.uint8, device=device)
    broadcast_from_last(stage, buf)
    return obj if stage.is_last else pickle.loads(buf.cpu().numpy().tobytes())


# ---------------------------------------------------------------------------------------------- trainer passes
def _shape_fn(trainer: MegatronTrainer, mbs: list) -> Callable[[int], tuple]:
    """[s, b, h] of micro-batch i's hidden states between stages (``forward.padded_batch`` rows: its longest
    sample, rounded up to ``forward.row_multiple``; this CP rank's two chunks of it, and under
    ``--sequence-parallel`` this TP rank's part)."""
    from miles.trainer.megatron.forward import row_multiple

    m, g = row_multiple(trainer), trainer.groups
    split = g.cp_size * (g.tp_size if trainer._sequence_parallel else 1)
    return lambda i: (-(-int(mbs[i].max_seqlen) // m) * m // split, int(mbs[i].cu_seqlens.numel()) - 1,
                      trainer.shape.hidden_size)


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the hidden states between stages: the parameters' (fp32 masters under autocast keep an fp32
    residual stream; bf16 parameters give bf16 states); the same on every stage."""
    return next(model.parameters()).dtype


def forward_pass(trainer: MegatronTrainer, model: nn.Module, data: list) -> list[torch.Tensor]:
    """The shared trainer's forward-only log-prob pass (old, reference, teacher) through the pipeline: the last
    stage computes the log-probs (vocabulary-parallel under TP) and broadcasts them to the other stages, so
    every rank holds the same per-sample CPU float32 results (the advantages and metrics need them)."""
    stage = trainer.stage
    mbs = trainer._micro_batches(data, list(range(len(data))))
    dtype = activation_dtype(model)

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
        dmb = mbs[i].to(trainer.device)
        if not stage.is_last:
            return trainer._stage_forward(model, dmb, x)[0].to(dtype)
        return trainer._policy_forward(model, dmb, x=x)[0].float()      # CP: reassembled over the CP group

    outs = forward_only(stage, len(mbs), _shape_fn(trainer, mbs), fwd, device=trainer.device, dtype=dtype)
    real = [j for j, mb in enumerate(mbs) if not mb.is_dummy]
    sizes = [sum(mbs[j].lengths) for j in real]
    if stage.is_last:
        flat = torch.cat([outs[j] for j in real]) if real else torch.zeros(0, device=trainer.device)
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=trainer.device)
    flat = broadcast_from_last(stage, flat.contiguous())
    result: list[torch.Tensor | None] = [None] * len(data)
    for j, vals in zip(real, flat.cpu().split(sizes)):
        for sid, piece in zip(mbs[j].sample_ids, vals.split(mbs[j].lengths)):
            result[sid] = piece
    return result  # type: ignore[return-value]


def forward_backward(trainer: MegatronTrainer, data: list, ids: list[int], per_sample: dict,
                     samples: list) -> tuple[MetricSums, int]:
    """One optimizer step's micro-batches through the 1F1B schedule; the loss of each is the shared loss family
    (``losses.py``) on the last stage, as ``RLTrainer._micro_step`` (``miles.trainer.step``) composes it, and with
    ``--enable-mtp-training`` the MTP block's (last stage, ``mtp.attach_loss``) as ``MegatronTrainer._micro_step``
    scales and logs it. The step's metric sums are broadcast from the last stage, so every rank returns the same
    (metric sums, tokens)."""
    from miles.trainer.losses import accumulate_metrics, dummy_micro_batch_loss, micro_batch_loss
    from miles.trainer.metrics import MetricSums

    stage, a, dev = trainer.stage, trainer.algo, trainer.device
    mbs = trainer._micro_batches(data, ids)
    ntok, nsamp = trainer._group_sum([float(sum(float(data[i].loss_mask.sum()) for i in ids)), float(len(ids))])
    trainer.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    acc: dict[str, torch.Tensor] = {}
    dtype = activation_dtype(trainer.model)
    mtp = stage.is_last and getattr(trainer.model, "mtp_training", False)      # the MTP block's loss (mtp.py)
    if mtp:             # its gradient scaled per micro-batch as MegatronTrainer._micro_step scales it (PP 1)
        from miles.trainer.megatron import mtp as mtp_mod

        mtp_mod.set_backward_scale(trainer.world / max(len(mbs), 1), dev)

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
        mb = mbs[i]
        dmb = mb.to(dev)
        if not stage.is_last:
            return trainer._stage_forward(trainer.model, dmb, x)[0].to(dtype)
        trainer.model.mtp_loss_value = None
        lp, ent = trainer._policy_forward(trainer.model, dmb, with_entropy=True, entropy_grad=a.entropy_coef != 0,
                                          x=x)
        if mb.is_dummy:
            return dummy_micro_batch_loss(lp, ent)
        loss, metrics, _ = micro_batch_loss(trainer.loss_fn, a, mb, dmb, lp, ent, per_sample, samples, ntok, nsamp,
                                            dev)
        if mtp and trainer.model.mtp_loss_value is not None:    # the step's mean over micro-batches and DP
            metrics = {**metrics, "mtp_loss": trainer.model.mtp_loss_value / (max(len(mbs), 1) * trainer.world)}
        accumulate_metrics(acc, metrics)
        return loss * trainer.world                       # gradients are averaged over DP

    train_1f1b(stage, len(mbs), _shape_fn(trainer, mbs), fwd, device=dev, dtype=dtype)
    keys = sorted(acc)
    host = torch.stack([acc[k] for k in keys]).cpu() if keys else None
    keys, host = broadcast_object_from_last(stage, (keys, host), dev)
    sums = MetricSums()
    if keys:
        sums.add(dict(zip(keys, host.unbind())))
    return sums, sum(mb.num_tokens for mb in mbs if not mb.is_dummy)
