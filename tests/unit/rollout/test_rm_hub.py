"""Miles v0.1.0's --rm-type names with their meaning, list labels, and the --rm-timeout bound on every reward."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

from miles.config import ConfigError, parse_args
from miles.rollout.rewards import Rewarder
from miles.types import Sample, SampleStatus


def rewarder(*extra: str) -> Rewarder:
    return Rewarder(parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", *extra], validate=False).reward)


def rewards(rm: str, cases, *extra: str):
    r = rewarder("--rm-type", rm, *extra)
    s = [Sample(response=resp, label=lab, status=SampleStatus.COMPLETED, metadata=dict(meta or {}))
         for resp, lab, meta in cases]
    asyncio.run(r.score_group(s))
    return [x.reward if x.status is not SampleStatus.FAILED else x.metadata["reward_error"] for x in s]


def test_math_is_boxed_only_with_symbolic_equality():
    assert rewards("math", [("so \\boxed{\\frac{1}{2}}", "0.5", None), ("\\boxed{0.5}", "\\frac12", None),
                            ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", None), ("the answer is 12", "12", None),
                            ("\\boxed{13}", "12", None), ("\\boxed{(1,2)}", "(1, 2)", None)]) == [1, 1, 1, 0, 0, 1]


def test_one_element_list_label_is_its_element_for_builtins():
    assert rewards("math", [("\\boxed{7}", ["7"], None), ("\\boxed{8}", ["7", "8"], None)]) == [1, 1]
    assert rewards("exact_match", [("7", ["7"], None)]) == [1.0]
    assert rewards("quickstart", [("7", ["7"], None)]) == [1.0]
    assert "empty list" in rewards("math", [("\\boxed{7}", [], None)])[0]


def test_deepscaler_and_gemma_math():
    assert rewards("deepscaler", [("think</think> \\boxed{3}", "3", None), ("\\boxed{3}", "3", None),
                                  ("###Response \\boxed{3}", "3", None)]) == [1, 0, 1]
    assert rewards("gemma_math", [("\\boxed{9}<channel|>\\boxed{3}", "3", None), ("\\boxed{3}", "3", None)]) == [1, 1]


def test_dapo_scores_plus_minus_one_from_answer_line():
    assert rewards("dapo", [("work...\nAnswer: 42", "42", None), ("Answer: 41", "42", None),
                            ("no answer", "42", None)]) == [1.0, -1.0, -1.0]


def test_f1_gpqa_random_and_boxed_prefix():
    got = rewards("f1", [("The Eiffel Tower", "eiffel tower", None), ("tower", "eiffel tower", None), ("yes", "no", None)])
    assert got[0] == 1.0 and got[1] == pytest.approx(2 / 3) and got[2] == 0.0
    assert rewards("gpqa", [("The answer is B", "B", None), ("The answer is C", "B", None),
                            ("I pick C", None, {"correct_letter": "C"}), ("it is paris", "Paris", {"choices": ["Rome", "Paris"]})]
                   ) == [1.0, 0.0, 1.0, 1.0]
    assert rewards("boxed_f1", [("blah \\boxed{eiffel tower}", "eiffel tower", None), ("eiffel tower", "eiffel tower", None)]) == [1.0, 0.0]
    assert set(rewards("random", [("a", None, None)] * 8)) <= {0, 1}
    one = rewards("deterministic_random", [("abc", None, None)] * 3)
    assert len(set(one)) == 1 and one[0] in (0, 1)


def test_unknown_types_and_ifbench_without_ifbench_are_refused():
    with pytest.raises(ConfigError, match="--rm-type 'boxed_nope' is not a known reward"):
        rewarder("--rm-type", "boxed_nope")
    with pytest.raises(ConfigError, match="--rm-type ifbench needs IFBench's evaluation_lib"):
        rewarder("--rm-type", "ifbench")


HANGS = textwrap.dedent('''
    import asyncio, time

    def sync_forever(args, sample):
        time.sleep(3600)

    async def async_forever(args, sample):
        await asyncio.sleep(3600)
''')


@pytest.mark.parametrize("fn", ["sync_forever", "async_forever"])
def test_custom_reward_that_never_returns_fails_the_sample_within_rm_timeout(fn, tmp_path, monkeypatch):
    (tmp_path / "hang_rm.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = rewarder("--custom-rm-path", f"hang_rm.{fn}", "--rm-timeout", "0.3")
    s = [Sample(response="x", status=SampleStatus.COMPLETED) for _ in range(3)]
    t0 = time.monotonic()
    assert asyncio.run(r.score_group(s)) == 3
    assert time.monotonic() - t0 < 2.0
    for x in s:
        assert x.status is SampleStatus.FAILED and x.reward is None
        assert x.metadata["reward_error"].startswith(f"--custom-rm-path hang_rm.{fn} did not return within --rm-timeout 0.3s")
