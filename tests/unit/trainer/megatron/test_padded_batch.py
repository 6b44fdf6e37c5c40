"""The packed micro-batch of the shared planner as the right-padded rows the Megatron trainer runs."""

from __future__ import annotations

import torch

from miles.trainer.batching import SampleData, pack
from miles.trainer.megatron.forward import padded_batch


def test_padded_rows_and_logit_positions() -> None:
    samples = [SampleData(tokens=torch.tensor([5, 6, 7, 8, 9]), response_length=2, loss_mask=torch.ones(2)),
               SampleData(tokens=torch.tensor([11, 12, 13]), response_length=1, loss_mask=torch.ones(1))]
    mb = pack(samples, [0, 1])
    ids, pos, index = padded_batch(mb, pad_id=0, multiple=4)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [11, 12, 13, 0, 0, 0, 0, 0]]
    assert pos.tolist() == [list(range(8))] * 2
    # the outputs at 8 and 9's predecessors (row 0, cols 2 and 3) and at 13's (row 1, col 1)
    assert index.tolist() == [2, 3, 8 + 1]
    assert ids.view(-1)[index + 1].tolist() == mb.targets.tolist()
