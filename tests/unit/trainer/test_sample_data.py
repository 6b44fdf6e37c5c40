"""``RLTrainer._sample_data`` (the step both backends share): the token-id bounds are checked on the sample's Python ints
(a list) or on its tensor, with the same result and the same refusal."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.step import RLTrainer
from miles.types import Sample


class _Vocab:
    vocab_size = 101


@pytest.mark.parametrize("as_tensor", [False, True])
def test_sample_data_is_the_same_from_a_list_or_a_tensor_and_refuses_out_of_vocabulary_ids(as_tensor: bool) -> None:
    def sample(tokens):
        return Sample(index=3, group_index=1, tokens=torch.tensor(tokens) if as_tensor else tokens, response_length=2,
                      loss_mask=[1, 0], reward=1.0)

    d = RLTrainer._sample_data(_Vocab, sample([7, 8, 100, 0, 5]), 0)
    assert d.tokens.dtype == torch.long and d.tokens.tolist() == [7, 8, 100, 0, 5]
    assert d.response_length == 2 and d.loss_mask.tolist() == [1.0, 0.0]
    for bad, shown in (([7, 101, 5, 6], "101"), ([7, -1, 5, 6], "-1")):
        with pytest.raises(ValueError, match=rf"sample 0 \(index 3, group 1\): token id {shown} is outside the model's "
                                             r"vocabulary of 101"):
            RLTrainer._sample_data(_Vocab, sample(bad), 0)
