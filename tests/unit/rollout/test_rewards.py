"""Rewards: built-ins, custom per sample and per group, visible failures, remote_rm over real HTTP."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from miles.config import ConfigError, parse_args
from miles.rollout.plugins import PluginArgs
from miles.rollout.rewards import Rewarder, register_reward, registered_rewards
from miles.rollout.rm_hub.math_answer import answers_match, extract_answer, extract_boxed, math_reward
from miles.types import Sample, SampleStatus


def reward_cfg(*extra: str):
    return parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", *extra], validate=False).reward


def done(response: str, label=None, **kw) -> Sample:
    return Sample(response=response, label=label, status=SampleStatus.COMPLETED, **kw)


def score(rewarder: Rewarder, samples: list[Sample]) -> int:
    return asyncio.run(rewarder.score_group(samples))


def test_exact_match_and_quickstart():
    r = Rewarder(reward_cfg("--rm-type", "exact_match"))
    s = [done(" 42\n", "42"), done("42.", "42"), done("x", 42)]
    assert score(r, s) == 0 and [x.reward for x in s] == [1.0, 0.0, 0.0]
    q = Rewarder(reward_cfg("--rm-type", "quickstart"))
    s = [done("7<|endoftext|>", "7"), done(" 7 ", 7), done("77", "7"), done("", "7")]
    assert score(q, s) == 0 and [x.reward for x in s] == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("response,label,want", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}} and later \\boxed{12}", "12", 1.0),
    ("The total is 1,000 apples.", "1000", 1.0),
    ("x = 5, y = 7, so 12", "12", 1.0),
    ("$\\boxed{x = 3}$", "3", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("answer: 13", "\\boxed{13}", 1.0),
    ("answer: 13", "14", 0.0),
    ("no number here", "3", 0.0),
    ("\\boxed{3", "3", 1.0),  # unbalanced: no boxed answer, so the last number is used
])
def test_math_answers(response, label, want):
    assert math_reward(response, label) == want


def test_math_helpers():
    assert extract_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert extract_boxed("\\boxed 7") == "7"
    assert extract_boxed("\\boxed{3") is None and extract_answer("\\boxed{3") == "3"
    assert answers_match("2/4", "0.5") and answers_match("-.5", "-1/2") and not answers_match("", "")


def test_failures_are_visible_and_counted(caplog):
    with pytest.raises(ConfigError, match="--rm-type 'nope' is not a known reward; known: .*exact_match"):
        Rewarder(reward_cfg("--rm-type", "nope"))
    with pytest.raises(ConfigError, match="no reward chosen"):
        Rewarder(reward_cfg())
    r = Rewarder(reward_cfg("--rm-type", "deepscaler"))
    s = [done("</think>\\boxed{1}", "1", index=0), done("\\boxed{1}", None, index=5, group_index=2),
         done("1", "1", index=6)]
    s[2].status = SampleStatus.ABORTED  # not scored at all
    with caplog.at_level("ERROR", logger="miles"):
        assert score(r, s) == 1
    assert s[0].reward == 1.0 and s[0].status is SampleStatus.COMPLETED
    assert s[1].status is SampleStatus.FAILED and s[1].reward is None and "--label-key" in s[1].metadata["reward_error"]
    assert s[2].reward is None and s[2].status is SampleStatus.ABORTED
    assert "reward failed for sample 5 (group 2, rollout 0)" in caplog.text


def test_math_without_label_key_scores_zero_and_warns_once(caplog):
    """Miles's math grades a missing label 0, and its OPD scripts pass --rm-type math without --label-key."""
    r = Rewarder(reward_cfg("--rm-type", "math"))
    s = [done("\\boxed{1}", None, index=i) for i in range(3)]
    with caplog.at_level("WARNING", logger="miles"):
        assert score(r, s) == 0
        assert score(r, [done("\\boxed{2}", None, index=4)]) == 0
    assert [x.reward for x in s] == [0.0, 0.0, 0.0] and all(x.status is SampleStatus.COMPLETED for x in s)
    assert caplog.text.count("pass --label-key") == 1, caplog.text
    labelled = [done("\\boxed{1}", "1", index=0)]   # a labelled sample is still graded
    assert score(r, labelled) == 0 and labelled[0].reward == 1.0
    # with --label-key set, a sample whose label went missing still fails, naming the flag
    cfg = parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--rm-type", "math", "--label-key", "answer"],
                     validate=False)
    keyed = Rewarder(cfg.reward, PluginArgs(cfg.reward, cfg.data))
    s = [done("\\boxed{1}", None, index=7)]
    assert score(keyed, s) == 1 and s[0].status is SampleStatus.FAILED and "--label-key answer" in \
        s[0].metadata["reward_error"]


CUSTOM = textwrap.dedent('''
    import math

    async def per_sample(args, sample):
        if sample.response == "boom":
            raise RuntimeError("verifier crashed")
        if sample.response == "str":
            return "1.0"
        if sample.response == "nan":
            return math.nan
        if sample.response == "dict":
            return {"acc": 0.25, "fmt": 1}
        return len(sample.response) + (args.rm_timeout == 60.0)

    def one_arg(sample):
        return sample.response == "yes"

    async def group(args, samples):
        rs = [s.response for s in samples]
        if "boom" in rs:
            raise ValueError("group verifier crashed")
        if "short" in rs:
            return [1.0]
        return [float(r == max(rs)) if r != "none" else None for r in rs]

    def bad_sig(a, b, c, d):
        return 0
''')


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_custom_per_sample(custom_module):
    r = Rewarder(reward_cfg("--custom-rm-path", f"{custom_module}.per_sample", "--reward-key", "acc"))
    s = [done("abc"), done("boom"), done("str"), done("nan"), done("dict")]
    assert score(r, s) == 3
    assert s[0].reward == 4.0  # len 3 + args.rm_timeout seen through PluginArgs
    assert [x.status for x in s[1:4]] == [SampleStatus.FAILED] * 3
    assert "RuntimeError: verifier crashed" in s[1].metadata["reward_error"]
    assert "returned str '1.0', expected a number" in s[2].metadata["reward_error"]
    assert "expected a finite number" in s[3].metadata["reward_error"]
    assert s[4].reward == 0.25 and s[4].metadata["rewards"] == {"acc": 0.25, "fmt": 1}
    r1 = Rewarder(reward_cfg("--custom-rm-path", f"{custom_module}.one_arg"))
    s = [done("yes"), done("no")]
    assert score(r1, s) == 0 and [x.reward for x in s] == [1.0, 0.0]


def test_custom_group(custom_module):
    r = Rewarder(reward_cfg("--custom-rm-path", f"{custom_module}.group", "--group-rm"))
    s = [done("a"), done("c"), done("b")]
    assert score(r, s) == 0 and [x.reward for x in s] == [0.0, 1.0, 0.0]
    s = [done("a"), done("none")]
    assert score(r, s) == 1 and s[0].reward == 0.0 and s[1].status is SampleStatus.FAILED
    s = [done("a"), done("boom")]
    assert score(r, s) == 2 and "group reward raised ValueError" in s[0].metadata["reward_error"]
    s = [done("short"), done("x")]
    assert score(r, s) == 2 and "returned list of length 1, expected a list of 2" in s[1].metadata["reward_error"]


def test_custom_path_errors(custom_module):
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod'.*PYTHONPATH"):
        Rewarder(reward_cfg("--custom-rm-path", "no_such_mod.f"))
    with pytest.raises(ConfigError, match="has no attribute 'missing'; callables there: .*per_sample"):
        Rewarder(reward_cfg("--custom-rm-path", f"{custom_module}.missing"))
    with pytest.raises(ConfigError, match=r"bad_sig.*has signature \(a, b, c, d\); expected async def f\(args, sample\)"):
        Rewarder(reward_cfg("--custom-rm-path", f"{custom_module}.bad_sig"))
    with pytest.raises(ConfigError, match="must be a dotted path"):
        Rewarder(reward_cfg("--custom-rm-path", "nodots"))
    with pytest.raises(ConfigError, match="--group-rm needs --custom-rm-path"):
        Rewarder(reward_cfg("--rm-type", "math", "--group-rm"))


def test_register_reward_and_metadata_override():
    @register_reward("test_len_is_label")
    async def _len(args, sample):
        return float(len(sample.response) == sample.label)

    assert "test_len_is_label" in registered_rewards()
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_len_is_label", lambda a, s: 0.0)
    r = Rewarder(reward_cfg("--rm-type", "test_len_is_label"))
    s = [done("abc", 3), done("abc", 3, metadata={"rm_type": "exact_match"}), done("x", 1, metadata={"rm_type": "bogus"})]
    assert score(r, s) == 1
    assert s[0].reward == 1.0 and s[1].reward == 0.0
    assert "metadata 'rm_type' 'bogus' is not a known reward" in s[2].metadata["reward_error"]


class RewardServer:
    """A real aiohttp server on a free port; behaviour scripted per response text."""

    def __init__(self):
        self.calls = 0
        self.fail_first = 0

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.calls += 1
        if body["response"] == "flaky" and self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=503, text="busy")
        if body["response"] == "slow":
            await asyncio.sleep(2)
        if body["response"] == "bad-request":
            return web.Response(status=422, text="no label")
        if body["response"] == "dict":
            return web.json_response({"score": 0.5, "label_seen": body["label"]})
        return web.json_response(float(body["response"] == body["label"]))

    async def start(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/reward", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/reward"


def test_remote_rm_against_real_server():
    async def main():
        srv = RewardServer()
        url = await srv.start()
        try:
            r = Rewarder(reward_cfg("--rm-type", "remote_rm", "--rm-url", url, "--rm-timeout", "0.5",
                                    "--rm-max-retries", "2", "--reward-key", "score"))
            s = [done("a", "a"), done("a", "b"), done("dict", "L")]
            assert await r.score_group(s) == 0
            assert [x.reward for x in s] == [1.0, 0.0, 0.5] and s[2].metadata["rewards"]["label_seen"] == "L"
            srv.fail_first = 2
            s = [done("flaky", "flaky")]
            assert await r.score_group(s) == 0 and s[0].reward == 1.0  # two 503s retried
            calls = srv.calls
            s = [done("bad-request", "x")]
            assert await r.score_group(s) == 1 and srv.calls == calls + 1  # a 4xx is not retried
            assert "answered HTTP 422: no label" in s[0].metadata["reward_error"]
            s = [done("slow", "x")]
            assert await r.score_group(s) == 1
            assert "failed 3 times (--rm-timeout 0.5s, --rm-max-retries 2)" in s[0].metadata["reward_error"]
            await r.aclose()
        finally:
            await srv.runner.cleanup()

    asyncio.run(main())
    with pytest.raises(ConfigError, match="remote_rm needs --rm-url"):
        Rewarder(reward_cfg("--rm-type", "remote_rm"))
