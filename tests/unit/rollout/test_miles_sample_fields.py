"""Miles's ``Sample.weight_versions`` (one engine weight version per /generate turn) and ``Sample.remove_sample``
(kept in its group, trained on by no token), as Miles's plugins read and set them."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
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


class _CharTokenizer:
    def decode(self, ids):
        return "".join(chr(65 + i) for i in ids)


def test_strip_last_output_tokens_cuts_every_per_token_field():
    """Miles's ``Sample.strip_last_output_tokens(n, tokenizer)``: tokens, response_length, loss mask, log-probs,
    the per-token metadata lists and the routed experts (base64 int32, one row per token but the last) lose the
    last n response tokens; the response is re-decoded; n beyond the response is one line."""
    import base64

    import numpy as np

    from miles.utils.types import Sample as MilesSample

    assert MilesSample is Sample
    experts = np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3)  # 5 tokens -> 4 rows, 2 layers, top-3
    s = Sample(tokens=[1, 2, 3, 4, 5], response_length=3, response="DEF", loss_mask=[1, 0, 1],
               rollout_log_probs=[-0.1, -0.2, -0.3], rollout_routed_experts=base64.b64encode(experts.tobytes()).decode(),
               metadata={"teacher_log_probs": [-1.0, -2.0, -3.0], "opd_reverse_kl": [0.1, 0.2, 0.3], "other": [9]})
    s.strip_last_output_tokens(0, _CharTokenizer())
    assert s.tokens == [1, 2, 3, 4, 5] and s.response == "DEF"
    s.strip_last_output_tokens(2, _CharTokenizer())
    assert (s.tokens, s.response_length, s.response) == ([1, 2, 3], 1, "D")
    assert s.loss_mask == [1] and s.rollout_log_probs == [-0.1]
    assert s.metadata == {"teacher_log_probs": [-1.0], "opd_reverse_kl": [0.1], "other": [9]}
    left = np.frombuffer(base64.b64decode(s.rollout_routed_experts), dtype=np.int32).reshape(-1, 2, 3)
    assert left.shape == (2, 2, 3) and (left == experts[:2]).all()
    s.strip_last_output_tokens(1, _CharTokenizer())
    assert (s.tokens, s.response_length, s.response) == ([1, 2], 0, "")
    from miles.types import SampleError

    with pytest.raises(SampleError, match="^cannot strip 1 tokens: only 0 output tokens available$") as e:
        s.strip_last_output_tokens(1, _CharTokenizer())
    # one line (a MilesError), a bad argument (ValueError) and, as Miles's assert-based check, an AssertionError
    assert isinstance(e.value, ValueError) and isinstance(e.value, AssertionError)


def test_indexer_topk_is_cut_with_the_response_and_stays_on_the_rollout_side():
    """Miles's ``Sample.rollout_indexer_topk`` (DeepSeek-V3.2's indexer replay, refused here): one row per token but
    the last, cut by strip_last_output_tokens like the routed experts; the sample wire does not carry it."""
    import numpy as np

    from miles.run.wire import decode_samples, encode_samples

    topk = np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3)
    s = Sample(tokens=[1, 2, 3, 4, 5], response_length=3, response="DEF", rollout_indexer_topk=topk)
    s.strip_last_output_tokens(2, _CharTokenizer())
    assert s.rollout_indexer_topk.shape == (2, 2, 3) and (s.rollout_indexer_topk == topk[:2]).all()
    [back] = decode_samples(encode_samples([s]))
    assert back.tokens == [1, 2, 3] and back.rollout_indexer_topk is None


def test_reward_spec_routes_the_builtin_reward_and_crosses_the_wire():
    """Miles's ``Sample.reward_spec`` (``RewardSpec(rm_type, custom_rm_path)``): its set fields win over
    metadata["rm_type"] and the flags in the built-in rewarder (as in rm_hub), and it survives the sample wire."""
    import asyncio

    from miles.config import parse_args
    from miles.rollout.rewards import Rewarder
    from miles.run.wire import decode_samples, encode_samples
    from miles.types import SampleStatus
    from miles.utils.types import RewardSpec

    reward = parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--rm-type", "exact_match"],
                        validate=False).reward
    rewarder = Rewarder(reward)

    def done(**kw):
        return Sample(response="\\boxed{4}", label="4", status=SampleStatus.COMPLETED, **kw)

    plain, by_spec, by_path = done(), done(reward_spec=RewardSpec(rm_type="math")), done(
        reward_spec=RewardSpec(custom_rm_path=f"{__name__}.seven"))
    asyncio.run(rewarder.score_group([plain, by_spec, by_path]))
    assert (plain.reward, by_spec.reward, by_path.reward) == (0.0, 1.0, 7.0)   # exact_match, math, the function
    back = decode_samples(encode_samples([by_spec, plain]))
    assert back[0].reward_spec == RewardSpec(rm_type="math") and back[1].reward_spec is None


async def seven(args, sample):
    return 7.0


def test_validate_names_the_first_per_token_field_that_disagrees():
    """Miles's ``Sample.validate()`` (its verifiers example calls it on the sample it builds): the per-token fields
    agree with ``response_length``; otherwise one line, a SampleError (a ValueError and, as Miles's ``assert``, an
    AssertionError) naming the field and both lengths."""
    from miles.types import SampleError

    ok = Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 0], rollout_log_probs=[-0.1, 0.0],
                metadata={"teacher_log_probs": [-0.2, -0.3]}, rollout_indexer_topk=[[0], [1], [2]])
    ok.validate()
    Sample().validate()                                              # an empty sample is consistent
    bad = {
        "response_length -1 must be between 0 and len(tokens) 2": Sample(tokens=[1, 2], response_length=-1),
        "response_length 3 must be between 0 and len(tokens) 2": Sample(tokens=[1, 2], response_length=3),
        "loss_mask has 1 entries, expected response_length 2": Sample(tokens=[1, 2, 3], response_length=2,
                                                                      loss_mask=[1]),
        "rollout_log_probs has 3 entries, expected response_length 2": Sample(
            tokens=[1, 2, 3], response_length=2, rollout_log_probs=[0.0] * 3),
        "metadata['opd_reverse_kl'] has 1 entries, expected response_length 2": Sample(
            tokens=[1, 2, 3], response_length=2, metadata={"opd_reverse_kl": [0.1]}),
        "rollout_indexer_topk has 2 rows, expected one per token but the last (3)": Sample(
            tokens=[1, 2, 3, 4], response_length=1, rollout_indexer_topk=[[0], [1]]),
    }
    for message, sample in bad.items():
        with pytest.raises(SampleError, match=re.escape(message)) as e:
            sample.validate()
        assert isinstance(e.value, AssertionError) and isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_prefix_cache_info_adds_up_each_turns_cached_prompt_tokens():
    """Miles's ``Sample.prefix_cache_info`` (``Sample.PrefixCacheInfo``; its random_async example calls
    ``sample.prefix_cache_info.add(meta_info)``): each /generate answer's ``cached_tokens`` / ``prompt_tokens`` added
    up, by the default generate and by a plugin; a rollout-side attribute, not sent to the trainer."""
    from miles.run.wire import decode_samples, encode_samples

    s = Sample(tokens=[1, 2])
    assert isinstance(s.prefix_cache_info, Sample.PrefixCacheInfo) and s.prefix_cache_info.prefix_cache_hit_rate == 0.0
    first, second = _answer([3, 4], "5"), _answer([6], "5")
    first["meta_info"].update(prompt_tokens=2, cached_tokens=0)
    second["meta_info"].update(prompt_tokens=5, cached_tokens=4)
    append_output(s, first)
    append_output(s, second)
    info = s.prefix_cache_info
    assert (info.cached_tokens, info.total_prompt_tokens, info.prefix_cache_hit_rate) == (4, 7, 4 / 7)
    info.add({"cached_tokens": 3, "prompt_tokens": 3})                 # as Miles's plugins call it
    info.add({"cached_tokens": {"device": 1}, "prompt_tokens": None})  # an engine's other shape adds nothing
    assert info.to_dict() == {"cached_tokens": 7, "total_prompt_tokens": 10}
    assert Sample.PrefixCacheInfo.from_dict(info.to_dict()) == info
    assert Sample(tokens=[1]).prefix_cache_info is not Sample(tokens=[1]).prefix_cache_info   # one per sample
    back = decode_samples(encode_samples([s]))[0]
    assert back.tokens == s.tokens and back.prefix_cache_info == Sample.PrefixCacheInfo()  # not on the wire
