"""Extension points: module.function loading, signature checks, the args view, filters, generate helpers."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_args
from miles.rollout.filters import FilterOutput, call_filter, check_no_aborted, check_reward_nonzero_std, load_filter
from miles.rollout.generate import (
    EngineResponseError,
    build_sampling_params,
    calculator_observation,
    parse_output,
    safe_arithmetic,
)
from miles.rollout.plugins import PluginArgs, choose_arity, is_async, load_function
from miles.types import Sample, SampleStatus


def cfg(*extra: str):
    return parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", *extra], validate=False)


def test_plugin_args_is_a_read_only_view_over_sections():
    c = cfg("--rm-url", "http://x", "--rollout-max-response-len", "77")
    args = PluginArgs(c.rollout, c.data, c.reward, None, client="C", tokenizer="T")
    assert args.rollout_max_response_len == 77 and args.rm_url == "http://x" and args.n_samples_per_prompt == 1
    assert args.client == "C" and args.tokenizer == "T"
    with pytest.raises(AttributeError, match="no field 'lr' .looked in RolloutConfig, DataConfig, RewardConfig"):
        _ = args.lr
    with pytest.raises(AttributeError, match="read-only"):
        args.rm_url = "y"


def test_load_function_errors_name_flag_and_fix():
    assert load_function("miles.rollout.filters.check_reward_nonzero_std", "--x") is check_reward_nonzero_std
    with pytest.raises(ConfigError, match="--x 'os.path.sep' names a str, not a function"):
        load_function("os.path.sep", "--x")
    with pytest.raises(ConfigError, match="--x 'a.' must be a dotted path"):
        load_function("a.", "--x")


def test_choose_arity():
    def one(sample): ...
    def two(args, sample, extra=None): ...
    def star(*a): ...
    def kwonly(args, sample, *, need): ...
    assert choose_arity(one, (1, 2), "--f", "m.one", "forms") == 1
    assert choose_arity(two, (1, 2), "--f", "m.two", "forms") == 2
    assert choose_arity(star, (1, 2), "--f", "m.star", "forms") == 2
    with pytest.raises(ConfigError, match="unusable signature .required keyword-only parameter 'need'"):
        choose_arity(kwonly, (2,), "--f", "m.kwonly", "forms")
    with pytest.raises(ConfigError, match=r"--f 'm.one' has signature \(sample\); expected f\(a, b, c\)"):
        choose_arity(one, (3,), "--f", "m.one", "f(a, b, c)")

    async def coro(a): ...

    class Callable:
        async def __call__(self, a): ...
    assert is_async(coro) and is_async(Callable()) and not is_async(one)


def _group(*rewards, status=SampleStatus.COMPLETED):
    return [Sample(reward=r, status=status) for r in rewards]


def test_filters():
    assert check_reward_nonzero_std(None, _group(1.0, 0.0)).keep
    out = check_reward_nonzero_std(None, _group(1.0, 1.0, 1.0))
    assert not out.keep and out.reason == "zero_std"
    assert check_reward_nonzero_std(None, _group(1.0, None)).reason == "too_few_rewards"
    assert not check_no_aborted(None, _group(1.0, status=SampleStatus.ABORTED)).keep
    assert call_filter(None, None, []) == FilterOutput(keep=True)
    assert call_filter(lambda a, s: False, None, []) == FilterOutput(keep=False)
    with pytest.raises(TypeError, match="returned str; expected FilterOutput"):
        call_filter(lambda a, s: "yes", None, [])
    with pytest.raises(ConfigError, match=r"'miles.rollout.generate.safe_arithmetic' has signature \(expr: 'str'\) .*; "
                                          r"expected def f\(args, samples, \*\*kwargs\)"):
        load_filter("miles.rollout.generate.safe_arithmetic")


def test_sampling_params_and_output_parsing():
    c = cfg("--rollout-max-response-len", "9", "--rollout-stop", "</a>", "--rollout-stop-token-ids", "1", "2",
            "--rollout-top-k", "5", "--rollout-temperature", "0.7")
    p = build_sampling_params(c.rollout)
    assert p == {"max_new_tokens": 9, "temperature": 0.7, "top_p": 1.0, "top_k": 5, "skip_special_tokens": False,
                 "stop": ["</a>"], "stop_token_ids": [1, 2]}
    assert build_sampling_params(c.rollout, max_new_tokens=3, temperature=0.0)["max_new_tokens"] == 3
    out = {"text": "ab", "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "4",
                                       "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}}
    assert parse_output(out) == ([5, 6], [-0.1, -0.2], SampleStatus.TRUNCATED, 4)
    out["meta_info"]["weight_version"] = "default"
    assert parse_output(out)[3] is None
    with pytest.raises(EngineResponseError, match="no meta_info.output_token_logprobs .the request must set return_logprob"):
        parse_output({"meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(EngineResponseError, match="finish_reason None"):
        parse_output({"meta_info": {"finish_reason": None, "output_token_logprobs": []}})


def test_calculator_tool():
    assert safe_arithmetic("(2+3)*4 - 1") == 19
    assert calculator_observation("let me compute <calc>6*7</calc>") == "<result>42</result>"
    assert calculator_observation("<calc>1/4</calc>") == "<result>0.25</result>"
    assert calculator_observation("no tool call") is None
    assert calculator_observation("<calc>__import__('os')</calc>").startswith("<result>error: not plain arithmetic")
    assert calculator_observation("<calc>1/0</calc>").startswith("<result>error:")


def test_unsupported_marker_refuses_at_load_and_reward_value_reads_the_reward_key(tmp_path, monkeypatch):
    from miles.rollout.plugins import reward_value, unsupported

    assert unsupported("why")(lambda: None).__miles_unsupported__ == "why"
    (tmp_path / "marked_plugins.py").write_text(
        "from miles.rollout.plugins import unsupported\n\n@unsupported('needs X, which is not available')\n"
        "def f(args, sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--custom-rm-path marked_plugins.f: needs X, which is not available$"):
        load_function("marked_plugins.f", "--custom-rm-path")
    keyed = PluginArgs(cfg("--reward-key", "acc").reward)
    assert reward_value(Sample(reward={"acc": 0.5}), keyed) == 0.5
    assert reward_value(Sample(reward=2.0), keyed) == 2.0 and reward_value(Sample(reward={"a": 1}), None) == {"a": 1}
