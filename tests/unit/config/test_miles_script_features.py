"""What Miles's launch scripts need besides their flags: a generate function that sets the reward itself
(tau-bench: no reward flag), the task index as the prompt (tau-bench's data), the Miles example plugins'
signatures, and one line for the eval-fleet flags (--eval-num-gpus, --eval-sglang-*)."""

from __future__ import annotations

import asyncio
import json
import sys
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
    check_plugin("custom_tis_function_path",
                 "examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp")
    check_plugin("custom_generate_function_path",
                 "examples.experimental.multi_agent.rollout_with_multi_agents.generate_with_multi_agents")
    check_plugin("custom_generate_function_path", "examples.experimental.strands_sglang.generate_with_strands.generate")
    for path in ("examples.experimental.strands_sglang.generate_with_strands.reward_func",
                 "examples.experimental.formal_math.single_round.reward_fn.reward_fn"):
        check_plugin("custom_rm_path", path)
    from miles.rollout.rewards import Rewarder

    Rewarder(_reward("--custom-rm-path", "generate_with_search.reward_func"))
    import generate_with_search as g

    answer = Sample(response="<answer>Paris</answer>", label={"ground_truth": {"target": ["paris"]}})
    wrong = Sample(response="<answer>Lyon</answer>", label={"ground_truth": {"target": ["paris"]}})
    assert asyncio.run(g.reward_func(None, answer)) == 1.0 and asyncio.run(g.reward_func(None, wrong)) == g.FORMAT_SCORE


def test_the_formal_math_stand_in_scores_on_the_lean_stand_in(monkeypatch):
    """The formal-math reward stand-in (plugins/.../formal_math/single_round/reward_fn.py) assembles the prompt's
    theorem and the response's proof as Miles's does and scores kimina's analysis of the Lean server's answer; the
    replay's Lean server stand-in (tests/miles_fixtures.py, lean_stand_in) speaks kimina's /api/check."""
    from miles_fixtures import lean_rows, lean_stand_in

    from miles.utils.http_utils import close_http_client

    monkeypatch.syspath_prepend(str(PLUGINS))
    from examples.experimental.formal_math.single_round import reward_fn as rf

    prompt = lean_rows(4)[3]["prompt"]            # theorem add_3 : (3 : ℕ) + 1 = 4 := by sorry

    def score(response: str) -> dict:
        async def go() -> dict:
            try:
                return await rf.reward_fn(None, Sample(prompt=prompt, response=response))
            finally:
                await close_http_client()
        return asyncio.run(go())

    with lean_stand_in() as url:
        monkeypatch.setenv("LEAN_SERVER_URL", url)
        whole = score("```lean4\ntheorem add_3 : (3 : ℕ) + 1 = 4 := by norm_num\n```")
        assert (whole["reward_value"], whole["reward_cat"]) == (1.0, "success")
        assert whole["extracted_code"].startswith("import Mathlib") and whole["extracted_code"].endswith(":= by norm_num\n")
        assert score("```lean\ndecide\n```")["reward_value"] == 1.0     # a bare tactic proof: ':= by' put before it
        assert score("```lean4\n:= by\n  sorry\n```")["reward_cat"] == "lean_sorry"
        assert score("```lean4\n:= by simp [foo]\n```")["reward_cat"] == "lean_lean_error"
        assert score("the answer is 4") == {"reward_value": 0.0, "reward_cat": "no_code"}
    monkeypatch.setenv("LEAN_SERVER_URL", url)                       # the server gone: 0, in its own category
    down = score("```lean4\n:= by norm_num\n```")
    assert (down["reward_value"], down["reward_cat"]) == (0.0, "python_error") and down["error_details"]
    assert rf._status({"error": "Lean REPL timed out", "response": None}) == "timeout_error"
    assert rf._status({"error": None, "response": {"message": "unknown environment"}}) == "repl_error"


def test_the_strands_stand_in_scores_and_runs_its_tool(monkeypatch):
    """The strands stand-in (plugins/.../strands_sglang/generate_with_strands.py) needs none of strands' packages;
    its reward is Miles's (DAPO math score, a wrong answer at most -0.6, raised by tool rounds) and its one tool runs
    Python in a subprocess."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    from examples.experimental.strands_sglang import generate_with_strands as st

    def reward(response: str, label: str, rounds: int) -> float:
        sample = Sample(response=response, label=label, metadata={"tool_iterations": rounds})
        return asyncio.run(st.reward_func(None, sample))

    assert reward("so the answer is \\boxed{42}", "42", 0) == 1.0
    assert reward("Answer: 41", "42", 0) == pytest.approx(-1.1)        # -1 + (0 - 2) / 2 * 0.1
    assert reward("Answer: 41", "42", 5) == pytest.approx(-0.85)
    assert reward("Answer: 41", "42", 12) == pytest.approx(-0.6)        # capped at -0.6
    call = '<tool_call>{"name": "execute_python_code", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    assert st._tool_calls("let me compute " + call) == ["print(6 * 7)"]
    assert st._tool_calls('<tool_call>{"name": "search"}</tool_call><tool_call>{bad</tool_call>') == [None, None]
    assert st.execute_python_code("print(6 * 7)") == "42"
    assert "ZeroDivisionError" in st.execute_python_code("1 / 0")
    assert not {"strands", "strands_sglang", "camel"} & {m.split(".")[0] for m in sys.modules}
