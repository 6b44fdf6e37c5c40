"""What Miles's launch scripts need besides their flags: a generate function that sets the reward itself
(tau-bench: no reward flag), the task index as the prompt (tau-bench's data), the Miles example plugins'
signatures, and one line for the eval-fleet flags (--eval-num-gpus, --eval-sglang-*)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.types import Sample, SampleStatus

BASE = ["--num-rollout", "1", "--rollout-batch-size", "2"]
PLUGINS = Path(__file__).resolve().parents[2] / "fixtures" / "miles_scripts" / "plugins"


def _reward(*flags: str):
    return parse_args(BASE + list(flags), validate=False).reward


def test_a_generate_function_may_set_the_reward_itself():
    """Miles scores only the samples whose reward is None: a custom generate function that sets it (tau-bench)
    needs no --rm-type; a sample it left unscored fails, one line naming why."""
    from miles.rollout.rewards import Rewarder

    with pytest.raises(ConfigError, match="^no reward chosen"):
        Rewarder(_reward())
    r = Rewarder(_reward(), rewards_from_generate=True)
    scored, unscored = Sample(reward=1.0, status=SampleStatus.COMPLETED), Sample(status=SampleStatus.COMPLETED)
    assert asyncio.run(r.score_sample(scored)) is True and scored.reward == 1.0
    assert asyncio.run(r.score_sample(unscored)) is False and unscored.status is SampleStatus.FAILED
    assert "left sample.reward unset" in unscored.metadata["reward_error"]
    # with a reward function too, the generate function's reward is kept (Miles: samples_need_reward)
    both = Rewarder(_reward("--rm-type", "exact_match"), rewards_from_generate=True)
    kept = Sample(reward=0.25, label="x", response="y", status=SampleStatus.COMPLETED)
    assert asyncio.run(both.score_sample(kept)) is True and kept.reward == 0.25
    fresh = Sample(label="x", response="x", status=SampleStatus.COMPLETED)
    assert asyncio.run(both.score_sample(fresh)) is True and fresh.reward == 1.0


def test_dry_run_without_a_reward_needs_the_generate_function(tiny_model_dir, tmp_path, monkeypatch):
    from miles.run.entry import dry_run

    data = tmp_path / "tasks.jsonl"  # Miles's tau-bench data: the task index is the prompt
    data.write_text("".join(json.dumps({"index": i, "metadata": {}}) + "\n" for i in range(4)))
    argv = ["--train-backend", "fsdp", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data),
            "--input-key", "index", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--colocate", "--output-dir", str(tmp_path / "out"), "--dry-run"]
    with pytest.raises(ConfigError, match="no reward chosen"):
        dry_run(parse_args(argv))
    monkeypatch.syspath_prepend(str(PLUGINS / "examples" / "experimental" / "tau-bench"))
    plan = dry_run(parse_args(argv + ["--custom-generate-function-path", "generate_with_tau.generate"]))
    assert "role plan" in plan


def test_the_tau_stand_in_scores_as_tau_bench(monkeypatch):
    """The replay's tau-bench stand-in (plugins/.../generate_with_tau.py) rewards as tau-bench's
    Env.calculate_reward: the database must equal the ground truth's and every task output must have been said to
    the customer (case-insensitive, commas removed); the reward comes only when the customer ends the episode."""
    monkeypatch.syspath_prepend(str(PLUGINS / "examples" / "experimental" / "tau-bench"))
    import generate_with_tau as tau

    def episode(task: int, *actions) -> tuple[float, bool]:
        env = tau.RetailEnv(task)
        res = None
        for a in actions:
            res = env.step(a)
        return res.reward, res.done

    say = lambda text: tau.Action(tau.RESPOND, {"content": text})  # noqa: E731
    look = tau.Action("get_order_details", {"order_id": "#W2"})
    cancel = tau.Action("cancel_pending_order", {"order_id": "#W2", "reason": "no longer needed"})
    assert episode(0, look, say("It has 2 items.")) == (1.0, True)
    assert episode(0, say("x2y")) == (1.0, True)              # an output is a substring, as in tau-bench
    assert episode(0, say("It has two items.")) == (0.0, True)
    assert episode(0, cancel, say("2 items")) == (0.0, True)  # a write the task did not ask for: database differs
    assert episode(1, cancel, say("Done.")) == (1.0, True)
    assert episode(1, say("Done.")) == (0.0, True)            # the cancellation was not made
    assert episode(1, cancel) == (0.0, False)                 # no reward before the customer ends the episode
    assert tau._parse('<tool_call>{"name": "get_order_details", "arguments": {"order_id": "#W1"}}</tool_call>') \
        == tau.Action("get_order_details", {"order_id": "#W1"})
    assert tau._parse("<tool_call>{not json</tool_call>") is None   # Miles aborts a sample its parser cannot read


def test_numeric_prompts_load_as_miles_loads_them(tiny_model_dir, tmp_path):
    """A number under --input-key (tau-bench's task index) is kept as the prompt and tokenized as its text when
    a --custom-generate-function-path reads it; without one, or with --apply-chat-template, it is refused."""
    from miles.rollout.data import DataError, PromptDataset
    from miles.utils.model_dir import load_tokenizer

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"index": i}) + "\n" for i in (3, 14)))
    tok = load_tokenizer(tiny_model_dir)
    gen = ["--custom-generate-function-path", "generate_with_tau.generate"]
    with pytest.raises(DataError, match="got int .a number is a prompt only for a --custom-generate-function-path"):
        PromptDataset(str(data), tok, parse_args(BASE + ["--prompt-data", str(data), "--input-key", "index"]).data)
    cfg = parse_args(BASE + ["--prompt-data", str(data), "--input-key", "index", *gen]).data
    ds = PromptDataset(str(data), tok, cfg, seed=0)
    items = sorted(ds.items, key=lambda it: it.prompt)
    assert [it.prompt for it in items] == [3, 14]
    assert [tok.decode(it.prompt_ids) for it in items] == ["3", "14"]
    chat = parse_args(BASE + ["--prompt-data", str(data), "--input-key", "index", "--apply-chat-template", *gen]).data
    with pytest.raises(DataError, match="must be a string or a list of chat messages, got int"):
        PromptDataset(str(data), tok, chat, seed=0)


@pytest.mark.parametrize("argv, first", [
    (["--eval-num-gpus", "2"], "--eval-num-gpus:"),
    (["--eval-hf-dir", "/dev/shm/x"], "--eval-hf-dir:"),
    (["--eval-sglang-mem-fraction-static", "0.9"], "--eval-sglang-mem-fraction-static:"),
    (["--no-eval-sglang-enable-metrics"], "--no-eval-sglang-enable-metrics:"),
])
def test_eval_fleet_flags_are_one_line(argv, first):
    with pytest.raises(ConfigError) as ei:
        parse_args(BASE + argv)
    msg = str(ei.value)
    assert msg.startswith(first) and "\n" not in msg and "eval engine fleet" in msg, msg


def test_an_eval_sglang_typo_gets_the_usual_hint():
    with pytest.raises(ConfigError, match="^unrecognized argument --eval-sglang-mem-fracton-static"):
        parse_args(BASE + ["--eval-sglang-mem-fracton-static", "0.9"])


def test_miles_example_plugins_have_miles_signatures(monkeypatch):
    """The fixture plugins pass the checks the dry run makes for the flags that name them."""
    from miles.run.preflight import check_plugin

    for folder in (PLUGINS, PLUGINS / "examples" / "experimental" / "search-r1",
                   PLUGINS / "examples" / "experimental" / "tau-bench"):
        monkeypatch.syspath_prepend(str(folder))
    check_plugin("custom_generate_function_path", "generate_with_search.generate")
    check_plugin("custom_generate_function_path", "generate_with_tau.generate")
    check_plugin("custom_tis_function_path",
                 "examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_fsdp")
    from miles.rollout.rewards import Rewarder

    Rewarder(_reward("--custom-rm-path", "generate_with_search.reward_func"))
    import generate_with_search as g

    answer = Sample(response="<answer>Paris</answer>", label={"ground_truth": {"target": ["paris"]}})
    wrong = Sample(response="<answer>Lyon</answer>", label={"ground_truth": {"target": ["paris"]}})
    assert asyncio.run(g.reward_func(None, answer)) == 1.0 and asyncio.run(g.reward_func(None, wrong)) == g.FORMAT_SCORE
