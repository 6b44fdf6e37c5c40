"""The ``miles.*`` plugin paths Miles v0.1.0's launch scripts name: each resolves and does what Miles's does.

Paths (from v0.1.0's examples/, scripts/ and tests/): the dynamic-sampling filters of ``filter_hub``,
on-policy distillation's ``reward_func`` / ``post_process_rewards`` (against a real teacher engine),
the generate hub, ``sft_rollout.generate_rollout`` and the default / fully-async rollout names; plus
the flags that go with them (``--opd-*``, ``--rollout-function-path``, ``--custom-reward-post-process-path``,
``--fully-async``). Absent features are refused by name in one line.
"""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest
import torch
from embedded_engines import start_engine, wait_engines
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.config import ConfigError, parse_args
from miles.config.data import custom_rollout_path
from miles.fleet.client import EngineClient
from miles.rollout.data import DataSource, PromptDataset
from miles.rollout.manager import RolloutError, RolloutManager
from miles.rollout.plugins import PluginArgs, load_function
from miles.rollout.reward_post_process import RewardPostProcessError
from miles.rollout.rollout_fn import RolloutFunctionError, build_prompt_dataset, build_rollout_function
from miles.rollout.teacher import TeacherError
from miles.types import Sample, SampleStatus

# (flag, path) pairs as Miles v0.1.0's launch scripts pass them
RUNNABLE = [
    ("--dynamic-sampling-filter-path", "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"),
    ("--dynamic-sampling-filter-path", "miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted"),
    ("--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func"),
    ("--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards"),
    ("--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout"),
    ("--rollout-function-path", "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn"),
    ("--rollout-function-path", "miles.rollout.sglang_rollout.generate_rollout"),
    ("--custom-generate-function-path", "miles.rollout.sglang_rollout.generate"),
    ("--custom-generate-function-path", "miles.rollout.generate_hub.single_turn.generate"),
    ("--custom-generate-function-path", "miles.rollout.generate_hub.benchmarkers.generate_with_random_osl"),
    ("--rollout-function-path", "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn"),
]
REFUSED = [
    ("--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate", "session server"),
    ("--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate", "tool-call parser"),
]


def cfg(*extra: str, validate: bool = True):
    return parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", *extra], validate=validate)


@pytest.mark.parametrize("flag,path", RUNNABLE)
def test_miles_paths_resolve(flag, path):
    assert callable(load_function(path, flag))


@pytest.mark.parametrize("flag,path,why", REFUSED)
def test_absent_features_are_refused_by_name(flag, path, why):
    with pytest.raises(ConfigError, match=rf"^{flag} {path}: .*{why}.*not available") as e:
        load_function(path, flag)
    assert "\n" not in str(e.value)


def test_the_default_and_fully_async_rollout_names_select_the_built_in_rollout():
    for path in ("miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn",
                 "miles.rollout.sglang_rollout.generate_rollout"):
        assert custom_rollout_path(cfg("--rollout-function-path", path).data) is None
    sft = "miles.rollout.sft_rollout.generate_rollout"
    assert custom_rollout_path(cfg("--rollout-function-path", sft).data) == sft
    assert custom_rollout_path(cfg().data) is None
    fa = "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn"
    assert custom_rollout_path(cfg("--rollout-function-path", fa, validate=False).data) is None
    assert parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--fully-async"], is_async=True).data.fully_async
    with pytest.raises(ConfigError, match=r"^--fully-async runs in train_async.py"):
        cfg("--fully-async")
    with pytest.raises(ConfigError, match=r"^--fully-async runs in train_async.py"):
        cfg("--rollout-function-path", fa)
    with pytest.raises(ConfigError, match="--pause-generation-mode abort would throw away"):
        parse_args(["--num-rollout", "1", "--rollout-batch-size", "2", "--fully-async", "--pause-generation-mode", "abort"], is_async=True)
    with pytest.raises(ConfigError, match="--fully-async and --rollout-function-path .* both select"):
        parse_args(["--num-rollout", "1", "--rollout-batch-size", "2", "--fully-async", "--rollout-function-path", fa], is_async=True)


# ----------------------------------------------------------------------------- filter hub
def _group(*rewards, status=SampleStatus.COMPLETED):
    return [Sample(reward=r, status=status) for r in rewards]


def test_filter_hub_is_miles_filters():
    f = load_function("miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std", "--f")
    out = f(None, _group(1.0, 1.0, 1.0))
    assert (out.keep, out.reason) == (False, "zero_std_1.0")  # Miles's drop reason: the reward, rounded
    assert f(None, _group(0.04, 0.04)).reason == "zero_std_0.0"
    assert f(None, _group(1.0, 0.0)).keep and f(None, [[Sample(reward=1.0)], [Sample(reward=0.0)]]).keep  # nested
    assert not f(None, _group(1.0)).keep  # one sample: no deviation (n - 1 = 0)
    args = PluginArgs(cfg("--reward-key", "acc").reward)
    assert f(args, _group({"acc": 1, "x": 0}, {"acc": 0, "x": 0})).keep  # --reward-key picks from dict rewards
    assert not f(args, _group({"acc": 1}, {"acc": 1})).keep
    g = load_function("miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted", "--f")
    out = g(None, _group(1.0, 0.0) + _group(None, status=SampleStatus.ABORTED))
    assert (out.keep, out.reason) == (False, "group_has_aborted")
    assert g(None, _group(1.0) + _group(None, status=SampleStatus.FAILED)).keep  # Miles drops aborted only


def test_miles_sample_accessors():
    from miles.rollout.sglang_rollout import GenerateState  # what Miles's example plugins import

    assert GenerateState(PluginArgs(cfg().rollout, tokenizer="T")).tokenizer == "T"
    s = Sample(reward={"score": 2.0})
    assert s.get_reward_value(PluginArgs(cfg("--reward-key", "score").reward)) == 2.0
    assert Sample.Status.ABORTED is SampleStatus.ABORTED


# ----------------------------------------------------------------------------- OPD flags
def test_opd_flags_with_miles_values(tmp_path):
    teacher = str(tmp_path)
    c = cfg("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", teacher, "--opd-kl-coef", "0.5")
    assert c.algo.opd_teacher_in_trainer and c.algo.opd_teacher_load == teacher and c.algo.opd_kl_coef == 0.5
    assert cfg("--use-opd", "--opd-type", "model", "--opd-teacher-load", teacher).algo.opd_teacher_in_trainer
    with pytest.raises(ConfigError, match="--opd-type megatron needs --opd-teacher-load"):
        cfg("--use-opd", "--opd-type", "megatron")
    miles_sglang = ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate",
                    "--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func",
                    "--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards"]
    c = cfg(*miles_sglang, "--opd-top-k-strategy", "only-student", "--opd-reward-weight-mode", "student_p",
            "--opd-teacher-key", "teacher_name")
    assert not c.algo.opd_teacher_in_trainer and c.algo.opd_teacher_key == "teacher_name"
    with pytest.raises(ConfigError, match="--opd-type sglang needs a teacher: --rm-url"):
        cfg("--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate")  # no reward_func / post-process
    assert cfg("--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "http://t:1").algo.opd_teacher_urls
    assert cfg(*miles_sglang, "--opd-log-prob-top-k", "16").algo.opd_log_prob_top_k == 16  # tests/unit/rollout/test_opd_topk.py
    with pytest.raises(ConfigError, match="--opd-teacher-ckpt-step 3 picks a Megatron checkpoint step"):
        cfg("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", teacher, "--opd-teacher-ckpt-step", "3")
    with pytest.raises(ConfigError, match=r"'http://y' is not NAME=URL"):  # checked at start-up, not per sample
        cfg(*miles_sglang, "--opd-teacher-urls", "a=http://x", "http://y")
    with pytest.raises(ConfigError, match="distinct names"):
        cfg(*miles_sglang, "--opd-teacher-urls", "a=http://x", "a=http://y")
    with pytest.raises(ConfigError, match="--opd-teacher-urls is only used with --opd-type sglang"):
        cfg("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", teacher, "--opd-teacher-urls", "a=http://x")


def test_opd_teacher_routing_by_metadata():
    from miles.rollout.on_policy_distillation import parse_teacher_urls, teacher_url

    def args(*extra):
        c = cfg(*extra, validate=False)
        return PluginArgs(c.reward, c.algo)

    assert teacher_url(args("--rm-url", "http://t/generate"), Sample()) == "http://t/generate"
    routed = args("--opd-teacher-urls", "math=http://m/generate", "default=http://d/generate?a=b")
    assert teacher_url(routed, Sample(metadata={"opd_teacher": "math"})) == "http://m/generate"
    assert teacher_url(routed, Sample(metadata={"opd_teacher": "code"})) == "http://d/generate?a=b"
    assert teacher_url(routed, Sample()) == "http://d/generate?a=b"
    with pytest.raises(ValueError, match=r"sample 3: metadata\['opd_teacher'\] = 'code' matches no --opd-teacher-urls name \(math\)"):
        teacher_url(args("--opd-teacher-urls", "math=http://m"), Sample(index=3, metadata={"opd_teacher": "code"}))
    with pytest.raises(ConfigError, match="Duplicate teacher name 'a' in --opd-teacher-urls"):
        parse_teacher_urls(["a=http://x", "a=http://y"])
    with pytest.raises(ConfigError, match="'http://y': expected NAME=URL"):
        parse_teacher_urls(["a=http://x", "http://y"])


# ----------------------------------------------------------------------------- with engines
@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    sup, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("miles_paths") / "engine.log", None, name="student")
    try:
        asyncio.run(wait_engines([(url, sup)]))
        yield url
    finally:
        sup.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(4)))
    return p


def _manager(c, client, tok):
    source = DataSource(PromptDataset(c.data.prompt_data, tok, c.data, 1), seed=1)
    return RolloutManager(c.rollout, c.data, c.reward, client, tok, source, eval_cfg=c.eval, sections=(c.algo,))


@pytest.mark.multiprocess
def test_opd_reward_func_and_post_process_give_the_teachers_log_probs(engine, tok, tiny_model_dir, prompts):
    """The same model serves student and teacher, so the teacher's log-probs equal the engine's rollout
    log-probs (temperature 1) and a reference forward; every task reward is 0.0."""
    c = cfg("--prompt-data", str(prompts), "--label-key", "label", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "6", "--use-opd", "--opd-type", "sglang", "--rm-url", f"{engine}/generate",
            "--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func",
            "--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards")

    async def go():
        async with EngineClient(engine, timeout=60, max_retries=1, concurrency=8) as client:
            return await _manager(c, client, tok).generate_rollout(0)

    result = asyncio.run(go())
    samples = [s for g in result.samples for s in g]
    assert len(samples) == 4 and result.metrics["rollout/raw_reward"] == 0.0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for s in samples:
        assert s.reward == 0.0 and s.metadata["raw_reward"] == 0.0
        t = s.metadata["teacher_log_probs"]
        assert len(t) == s.response_length > 0
        assert t == pytest.approx(s.rollout_log_probs, abs=1e-6)             # measured 4.8e-7 (CPU, 2026-12-07)
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0].float()
        p = s.prompt_length
        ref = torch.log_softmax(logits, -1)[torch.arange(p - 1, len(s.tokens) - 1), torch.tensor(s.tokens[p:])]
        assert t == ref.tolist()                                             # measured: bit for bit


@pytest.mark.multiprocess
def test_opd_teacher_errors_are_named(engine):
    from miles.rollout.on_policy_distillation import post_process_rewards, reward_func

    c = cfg("--rm-url", f"{engine}/generate", "--rm-max-retries", "0", validate=False)
    args = PluginArgs(c.reward, c.algo)
    sample = Sample(tokens=[5, 6, 76, 7, 84, 9, 1], response_length=2, status=SampleStatus.COMPLETED)
    sample.reward = asyncio.run(reward_func(args, sample))
    post_process_rewards(args, [sample])
    assert len(sample.metadata["teacher_log_probs"]) == 2
    wrong = Sample(tokens=[5, 6, 7], response_length=1, reward={"meta_info": {"input_token_logprobs": [[None, 5, None],
                                                                                                       [-1.0, 99, None]]}})
    with pytest.raises(TeacherError, match="share a tokenizer"):
        post_process_rewards(args, [wrong])
    with pytest.raises(TeacherError, match="expects the teacher's answer as the reward"):
        post_process_rewards(args, [Sample(tokens=[1, 2], response_length=1, reward=1.0)])
    down = PluginArgs(cfg("--rm-url", "http://127.0.0.1:9/generate", "--rm-max-retries", "0", "--rm-timeout", "5",
                          validate=False).reward)
    with pytest.raises(TeacherError, match=r"teacher http://127.0.0.1:9/generate failed 1 times"):
        asyncio.run(reward_func(down, sample))


@pytest.mark.multiprocess
def test_reward_post_process_path_answers_are_checked(engine, tok, prompts, tmp_path, monkeypatch):
    (tmp_path / "pp_plugins.py").write_text(textwrap.dedent('''
        def scaled(args, samples):
            raw = [s.get_reward_value(args) for s in samples]
            return raw, [10.0 * r for r in raw]

        def short(args, samples):
            return [0.0], [0.0]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["--prompt-data", str(prompts), "--label-key", "label", "--rollout-max-response-len", "4",
            "--custom-rm-path", "mgr_rewards.one"]
    (tmp_path / "mgr_rewards.py").write_text("def one(args, sample):\n    return {'reward': 0.5}\n")

    async def go(path):
        c = cfg(*base, "--custom-reward-post-process-path", path, "--reward-key", "reward")
        async with EngineClient(engine, timeout=60, max_retries=1, concurrency=8) as client:
            return await _manager(c, client, tok).generate_rollout(0)

    result = asyncio.run(go("pp_plugins.scaled"))
    samples = [s for g in result.samples for s in g]
    assert [s.reward for s in samples] == [5.0, 5.0] and [s.metadata["raw_reward"] for s in samples] == [0.5, 0.5]
    assert result.metrics["rollout/raw_reward"] == 0.5
    with pytest.raises(RewardPostProcessError, match=r"--custom-reward-post-process-path pp_plugins.short returned "
                                                     r"tuple of 2 with lengths \[1, 1\]; expected \(raw_rewards, rewards\), two lists of 2"):
        asyncio.run(go("pp_plugins.short"))


@pytest.mark.multiprocess
def test_generate_hub_functions_run_on_the_engine(engine, tok, prompts):
    """single_turn.generate (Miles's GenerateFnInput form) and sglang_rollout.generate give the default's
    tokens for the same seeds; generate_with_random_osl asks for 32K-64K tokens ignoring EOS."""
    sent: list[dict] = []

    class Recording(EngineClient):
        async def generate(self, input_ids, sampling_params, **kw):
            sent.append(dict(sampling_params))
            return await super().generate(input_ids, sampling_params, **kw)

    async def go(*extra):
        c = cfg("--prompt-data", str(prompts), "--rm-type", "random", "--rollout-max-response-len", "5",
                "--n-samples-per-prompt", "2", *extra)
        async with Recording(engine, timeout=60, max_retries=0, concurrency=8) as client:
            return await _manager(c, client, tok).generate_rollout(0)

    default = asyncio.run(go())
    for path in ("miles.rollout.generate_hub.single_turn.generate", "miles.rollout.sglang_rollout.generate"):
        out = asyncio.run(go("--custom-generate-function-path", path))
        assert [s.tokens for g in out.samples for s in g] == [s.tokens for g in default.samples for s in g], path
        assert all(s.loss_mask == [1] * s.response_length for g in out.samples for s in g)
    sent.clear()
    with pytest.raises(RolloutError, match="exceeds the engine's context of 512 tokens"):  # the tiny engine's limit
        asyncio.run(go("--custom-generate-function-path", "miles.rollout.generate_hub.benchmarkers.generate_with_random_osl"))
    assert len(sent) == 4
    assert all(p["ignore_eos"] is True and 32 * 1024 <= p["max_new_tokens"] < 64 * 1024 for p in sent), sent


@pytest.mark.multiprocess
def test_fully_async_rollout_keeps_generating_between_drains(engine, tok, prompts):
    from miles.rollout.fully_async_rollout import FullyAsyncRollout

    c = cfg("--prompt-data", str(prompts), "--label-key", "label", "--rm-type", "random", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4")

    async def until(cond, what):
        for _ in range(300):  # 30 s
            if cond():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    async def go():
        async with EngineClient(engine, timeout=60, max_retries=1, concurrency=8) as client:
            manager = _manager(c, client, tok)
            fa = FullyAsyncRollout(manager, manager.data_source)
            try:
                first, m0 = await fa.next_rollout(0)
                # nobody drains now, yet the producer finishes the groups it keeps in flight
                await until(lambda: len(fa.waiting) >= 2, "groups finished between drains")
                state = fa.data_state()
                pending = [g.item.index for g, _ in fa.waiting] + [g.item.index for g, _ in fa.active.values()]
                assert len(fa.waiting) + len(fa.active) <= 4  # one rollout waiting + one generating, no more
                drained = {id(g) for g in first}
                assert not any(id(g.samples) in drained for g, _ in fa.waiting)  # drained groups left the waiting list
                fa.pause()
                launched = fa.launched
                await until(lambda: not fa.active, "in-flight groups to finish while paused")
                assert fa.launched == launched  # paused: no new group started
                fa.resume()
                second, m1 = await fa.next_rollout(1)
                return first, second, m0, state, pending
            finally:
                await fa.close()
                assert fa.worker is None and not fa.active

    first, second, m0, state, pending = asyncio.run(go())
    assert len(first) == len(second) == 2 and all(len(g) == 2 for g in first + second)
    assert all(s.rollout_id == 0 for g in first for s in g) and all(s.rollout_id == 1 for g in second for s in g)
    assert all(s.status is SampleStatus.COMPLETED or s.status is SampleStatus.TRUNCATED for g in first + second for s in g)
    indices = [g[0].group_index for g in first + second]
    assert indices[:2] == sorted(indices[:2]) and len(set(indices)) == 4  # launch order within a rollout, no repeats
    assert m0["rollout/num_samples"] == 4 and "rollout/groups_in_flight" in m0
    assert sorted(state["buffer"]) == sorted(pending)  # unfinished prompts (only they) are given back in the state


@pytest.mark.multiprocess
def test_fully_async_rollout_says_when_the_filter_starves_it(engine, tok, prompts):
    from miles.rollout.fully_async_rollout import FullyAsyncRollout

    c = cfg("--prompt-data", str(prompts), "--rm-type", "random", "--rollout-max-response-len", "2",
            "--dynamic-sampling-filter-path", "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")

    async def go():  # one sample per prompt: no deviation, every group is dropped
        async with EngineClient(engine, timeout=60, max_retries=1, concurrency=8) as client:
            manager = _manager(c, client, tok)
            fa = FullyAsyncRollout(manager, manager.data_source)
            try:
                await asyncio.wait_for(fa.next_rollout(0), 60)
            finally:
                await fa.close()

    with pytest.raises(RolloutError, match=r"check_reward_nonzero_std dropped 7 groups in a row .*zero_std_"):
        asyncio.run(go())


# ----------------------------------------------------------------------------- rollout function path
def test_custom_rollout_function_gets_miles_data_buffer(tmp_path, monkeypatch, tok):
    (tmp_path / "ro_plugins.py").write_text(textwrap.dedent('''
        from miles.types import Sample

        def two_of_three(args, rollout_id, data_source, evaluation=False):
            groups = data_source.get_samples(3)
            data_source.add_samples(groups[2:])          # the third prompt is served again first
            again = data_source.get_samples(1)
            assert again[0][0].prompt == groups[2][0].prompt and again[0][0].group_index == 3
            data_source.add_samples(again)
            for g in groups[:2]:
                for s in g:
                    s.tokens = s.tokens + [7, 8]
                    s.response_length = 2
                    s.reward = float(len(s.prompt))
            return groups[:2]

        def not_samples(args, rollout_id, data_source, evaluation=False):
            return [[1, 2]]

        def wrong_signature(args):
            return []
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input": "x" * (i + 1)}) + "\n" for i in range(4)))

    def source(path):
        c = cfg("--prompt-data", str(data), "--rollout-function-path", path, "--n-samples-per-prompt", "2")
        ds = DataSource(build_prompt_dataset(c.data, tok, 0))
        return build_rollout_function(c, ds, tok), ds

    fn, ds = source("ro_plugins.two_of_three")
    groups, metrics = asyncio.run(fn.next_rollout(5))
    assert [[s.prompt for s in g] for g in groups] == [["x", "x"], ["xx", "xx"]]
    assert all(s.status is SampleStatus.COMPLETED and s.rollout_id == 5 and s.tokens[-2:] == [7, 8] for g in groups
               for s in g)
    assert metrics["rollout/raw_reward"] == 1.5 and metrics["rollout/num_samples"] == 4
    assert [it.prompt for it in ds.next_batch(2)] == ["xxx", "xxxx"]  # the given-back prompt first
    with pytest.raises(RolloutFunctionError, match="returned a int among its samples"):
        asyncio.run(source("ro_plugins.not_samples")[0].next_rollout(0))
    with pytest.raises(ConfigError, match=r"--rollout-function-path 'ro_plugins.wrong_signature' has signature \(args\)"):
        source("ro_plugins.wrong_signature")
    from miles.run.preflight import check_plugin  # what --dry-run checks

    with pytest.raises(ConfigError, match=r"'ro_plugins.wrong_signature' has signature \(args\)"):
        check_plugin("rollout_function_path", "ro_plugins.wrong_signature")
    check_plugin("rollout_function_path", "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn")
    check_plugin("custom_generate_function_path", "miles.rollout.generate_hub.single_turn.generate")  # Miles's 1-arg form
    with pytest.raises(ConfigError, match="session server"):
        check_plugin("custom_generate_function_path", "miles.rollout.generate_hub.agentic_tool_call.generate")


# ----------------------------------------------------------------------------- SFT on messages
CONVERSATION = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"}]


def test_sft_rollout_trains_on_assistant_turns_of_messages(tmp_path, tok):
    data = tmp_path / "sft.jsonl"
    skip_first = [dict(m) for m in CONVERSATION]
    skip_first[2]["step_loss_mask"] = 0
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": skip_first}) + "\n")
    c = cfg("--prompt-data", str(data), "--input-key", "messages", "--loss-type", "sft_loss",
            "--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout", "--debug-train-only")
    ds = DataSource(build_prompt_dataset(c.data, tok, 0))  # messages without --apply-chat-template, as Miles runs it
    groups, _ = asyncio.run(build_rollout_function(c, ds, tok).next_rollout(0))
    full, skipped = groups[0][0], groups[1][0]
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok.decode(full.tokens) == text
    trained = [t for t, m in zip(full.tokens[full.prompt_length:], full.loss_mask) if m]
    assert tok.decode(trained) == "2<|im_end|>\n4<|im_end|>\n"
    assert tok.decode(full.tokens[:full.prompt_length]).endswith("<|im_start|>assistant\n")
    assert full.reward == 0.0 and full.status is SampleStatus.COMPLETED
    assert tok.decode([t for t, m in zip(skipped.tokens[skipped.prompt_length:], skipped.loss_mask) if m]) == "4<|im_end|>\n"
    assert skipped.response_length < full.response_length

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    c_bad = cfg("--prompt-data", str(bad), "--input-key", "messages", "--rollout-batch-size", "1",
                "--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout")
    fn = build_rollout_function(c_bad, DataSource(build_prompt_dataset(c_bad.data, tok, 0)), tok)
    with pytest.raises(RolloutFunctionError, match=rf"{bad}:1: the conversation has no assistant message"):
        asyncio.run(fn.next_rollout(0))


def test_miles_example_plugins_import_sample_from_miles_utils_types():
    """15 of Miles v0.1.0's example plugins start with ``from miles.utils.types import Sample``."""
    from miles.types import Sample
    from miles.utils.types import Sample as MilesSample

    assert MilesSample is Sample and MilesSample.Status.COMPLETED == "completed"
