"""Micro-batching and sequence packing.

A micro-batch is several samples concatenated into ONE row ``[1, T]`` with ``position_ids``
restarting at 0 for each sample; attention never crosses samples: the HF model sees the restarts
(``find_packed_sequence_indices``) and builds a block-diagonal causal mask (SDPA/eager, CPU), or our
varlen attention reads ``cu_seq_lens`` (flash-attention varlen, GPU; see ``modeling.py``).

Planning:
- fixed: ``--micro-batch-size`` samples per micro-batch, in order;
- dynamic (``--use-dynamic-batch-size``): first-fit-decreasing bins of at most ``--max-tokens-per-gpu``
  tokens (a sample longer than the budget is an error naming the flag).
All trainer ranks must run the same number of forward/backward passes (FSDP all-gathers and
reduce-scatters are collectives), so ``sync_count`` takes the max over the group and ranks pad with
zero-weight dummy micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.config.base import ConfigError


@dataclass
class SampleData:
    """One sample as the trainer needs it (CPU tensors)."""

    tokens: torch.Tensor          # [L] int64, prompt + response
    response_length: int          # R
    loss_mask: torch.Tensor       # [R] float32

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [1, T] int64
    position_ids: torch.Tensor    # [1, T] int64, restarting at 0 per sample
    cu_seqlens: torch.Tensor      # [n + 1] int32
    max_seqlen: int
    logit_index: torch.Tensor     # [N] positions whose output predicts a response token
    targets: torch.Tensor         # [N] the response tokens
    loss_mask: torch.Tensor       # [N] float32
    sample_ids: list[int]         # indices into the caller's sample list (empty for a dummy)
    lengths: list[int]            # response lengths, sum = N

    @property
    def is_dummy(self) -> bool:
        return not self.sample_ids

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> MicroBatch:
        nb = device.type == "cuda"
        return MicroBatch(
            input_ids=self.input_ids.to(device, non_blocking=nb), position_ids=self.position_ids.to(device, non_blocking=nb),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=nb), max_seqlen=self.max_seqlen,
            logit_index=self.logit_index.to(device, non_blocking=nb), targets=self.targets.to(device, non_blocking=nb),
            loss_mask=self.loss_mask.to(device, non_blocking=nb), sample_ids=self.sample_ids, lengths=self.lengths)


def plan_micro_batches(
    lengths: Sequence[int], *, micro_batch_size: int, max_tokens: int | None = None, dynamic: bool = False,
) -> list[list[int]]:
    """Group sample indices into micro-batches (see module docstring). lengths: total tokens per sample."""
    if not lengths:
        return []
    if not dynamic:
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}.")
        idx = list(range(len(lengths)))
        return [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
    if not max_tokens or max_tokens <= 0:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu N (the token budget of a micro-batch).")
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] > max_tokens:
        raise ConfigError(f"a sample of {lengths[longest]} tokens (prompt + response) exceeds --max-tokens-per-gpu "
                         f"{max_tokens}; raise --max-tokens-per-gpu to at least {lengths[longest]} or cap "
                         "--rollout-max-response-len.")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def coalesce_micro_batches(plan: list[list[int]], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Merge consecutive planned micro-batches into one forward while it holds at most ``max_tokens`` tokens
    as right-padded rows (samples x longest sample); a planned micro-batch over the budget stays as it is.

    The loss of a step is a sum over its samples with the step's totals as denominators (``losses.Reducer``),
    so running two planned micro-batches as one forward changes only the float summation order, not the
    math; what it saves is a forward and a backward's fixed costs (on a small model, all of their cost)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}.")
    out: list[list[int]] = []
    longest = 0
    for group in plan:
        g_longest = max((lengths[i] for i in group), default=0)
        if out and (len(out[-1]) + len(group)) * max(longest, g_longest) <= max_tokens:
            out[-1] = out[-1] + group
            longest = max(longest, g_longest)
        else:
            out.append(list(group))
            longest = g_longest
    return out


def pack(samples: Sequence[SampleData], sample_ids: Sequence[int]) -> MicroBatch:
    """Concatenate the given samples into one packed row (CPU tensors), with a fixed number of tensor ops
    whatever the sample count (a step of many short samples is otherwise dominated by per-sample ops)."""
    chosen = [samples[sid] for sid in sample_ids]
    n = torch.tensor([s.length for s in chosen], dtype=torch.long)              # [k] tokens per sample
    lengths = [s.response_length for s in chosen]
    r = torch.tensor(lengths, dtype=torch.long)                                 # [k] response tokens
    ends = torch.cumsum(n, 0)                                                   # [k] end offsets
    starts = ends - n
    input_ids = torch.cat([s.tokens for s in chosen])                           # [T]
    position_ids = torch.arange(input_ids.numel(), dtype=torch.long) - torch.repeat_interleave(starts, n)
    # the output at position p predicts token p + 1: response token j of a sample sits at prompt + j, so
    # its logit is read at offset + prompt - 1 + j
    r_starts = torch.cumsum(r, 0) - r
    j = torch.arange(int(r.sum()), dtype=torch.long) - torch.repeat_interleave(r_starts, r)
    logit_index = torch.repeat_interleave(ends - r - 1, r) + j                  # [N]
    return MicroBatch(
        input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int32), ends.to(torch.int32)]),
        max_seqlen=int(n.max()), logit_index=logit_index, targets=input_ids[logit_index + 1],
        loss_mask=torch.cat([s.loss_mask for s in chosen]).float(), sample_ids=list(sample_ids), lengths=lengths)


def padded_rows(mb: MicroBatch, pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed row as right-padded rows: (input_ids [k, L], position_ids [k, L], logit_index [N] into the
    flattened [k * L] positions), L the longest sample. Causal attention never reaches a row's padding, so
    no mask is needed; on SDPA without varlen this replaces the packed row's block-diagonal [T, T] mask."""
    cu = mb.cu_seqlens.to(torch.long)
    n = cu[1:] - cu[:-1]                                                        # [k]
    k, width = int(n.numel()), int(mb.max_seqlen)
    flat = mb.input_ids[0]
    row = torch.repeat_interleave(torch.arange(k), n)                           # [T] row of each packed position
    col = mb.position_ids[0]                                                    # [T] position inside its sample
    ids = torch.full((k, width), pad_token_id, dtype=flat.dtype, device=flat.device)
    ids[row.to(flat.device), col] = flat
    pos = torch.arange(width, dtype=torch.long, device=flat.device).expand(k, width)
    li = mb.logit_index
    index = row.to(li.device)[li] * width + col[li]
    return ids, pos, index


def dummy_micro_batch(pad_token_id: int = 0) -> MicroBatch:
    """A two-token sample with one zero-mask response token: keeps FSDP collectives in lockstep."""
    tokens = torch.tensor([pad_token_id, pad_token_id], dtype=torch.long)
    mb = pack([SampleData(tokens=tokens, response_length=1, loss_mask=torch.zeros(1))], [0])
    mb.sample_ids = []
    return mb


def sync_count(n: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """Max of ``n`` over the group (the number of micro-batches every rank must run)."""
    if group is None or dist.get_world_size(group) == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def padded_micro_batches(
    samples: Sequence[SampleData], plan: list[list[int]], group: dist.ProcessGroup | None, device: torch.device,
    pad_token_id: int = 0,
) -> list[MicroBatch]:
    """Pack each planned micro-batch and pad with dummies to the group-wide count."""
    total = sync_count(len(plan), group, device)
    mbs = [pack(samples, ids) for ids in plan]
    mbs += [dummy_micro_batch(pad_token_id) for _ in range(total - len(plan))]
    return mbs


def split_into_steps(num_samples: int, num_steps: int) -> list[list[int]]:
    """Split local sample indices into ``num_steps`` contiguous, near-equal slices (some may be empty)."""
    if num_steps <= 0:
        raise ValueError(f"--num-steps-per-rollout must be positive, got {num_steps}.")
    base, extra = divmod(num_samples, num_steps)
    out, start = [], 0
    for s in range(num_steps):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
