"""Miles's ``Sample.weight_versions`` (one engine weight version per /generate turn) and ``Sample.remove_sample``
(kept in its group, trained on by no token), as Miles's plugins read and set them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from miles.rollout.generate import append_output
from miles.trainer.step import RLTrainer
from miles.types import Sample


def _answer(ids: list[int], version: str) -> dict:
    return {"text": "x", "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                       "finish_reason": {"type": "length"}, "weight_version": version}}


def test_each_turn_records_the_engines_weight_version():
    s = Sample(tokens=[1, 2], response_length=0)
    assert s.weight_versions == [] and not s.remove_sample            # Miles's defaults
    append_output(s, _answer([3, 4], "5"))
    append_output(s, _answer([6], "6"))                               # a second turn after a weight sync
    assert s.weight_versions == ["5", "6"] and s.weight_version == 5  # the oldest version, as before
    assert s.tokens == [1, 2, 3, 4, 6] and s.loss_mask == [1, 1, 1]


def test_a_removed_sample_trains_on_no_token():
    trainer = SimpleNamespace(vocab_size=16)
    kept = RLTrainer._sample_data(trainer, Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 0]), 0)
    assert torch.equal(kept.loss_mask, torch.tensor([1.0, 0.0]))
    s = Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], remove_sample=True)
    gone = RLTrainer._sample_data(trainer, s, 1)
    assert torch.equal(gone.loss_mask, torch.zeros(2)) and gone.response_length == 2
    assert s.loss_mask == [1, 1]                                      # the sample itself is not rewritten
