"""Miles flags added for its launch scripts: each value reaches the code that uses it, or is refused by name."""

from __future__ import annotations

import base64

import pytest

from miles.config import ConfigError, parse_args

BASE = ["--num-rollout", "2", "--rollout-batch-size", "4"]


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as ei:
        parse_args(BASE + argv)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("argv, first", [
    (["--lora-rank", "64", "--lora-alpha", "32"], "--lora-rank > 0 needs --target-modules"),
    (["--lora-adapter-path", "a"], "--lora-adapter-path:"),
    (["--use-rollout-indexer-replay"], "--use-rollout-indexer-replay:"),
    (["--use-miles-dashboard"], "--use-miles-dashboard:"),
    (["--optimizer", "sgd"], "--optimizer"),
    (["--train-backend", "megatron", "--fsdp-cpu-offload"], "--fsdp-cpu-offload"),
    (["--custom-tis-function-path", "m.f"], "--custom-tis-function-path"),
    (["--multimodal-keys", '{"image": "images"}'], "--multimodal-keys"),
    (["--use-opd", "--opd-teacher-load", "x"], "--use-opd"),
    (["--train-env-vars", "[1]"], "train.py: argument --train-env-vars"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], "--lr-warmup-fraction"),
    (["--train-backend", "fsdp", "--qkv-format", "bshd"], "--qkv-format"),
])
def test_unsupported_values_are_one_line_naming_the_flag(argv, first):
    assert _refusal(argv).startswith(first)


def test_accepted_miles_flags_land_in_their_sections():
    cfg = parse_args(BASE + [  # --gradient-checkpointing and --attn-implementation are FSDP-backend flags
        "--train-backend", "fsdp", "--optimizer", "adam", "--balance-data", "--gradient-checkpointing", "--attn-implementation", "flash_attention_3",
        "--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "N": 3}',
        "--train-memory-margin-bytes", "0", "--num-critic-only-steps", "2",
        "--disable-compute-advantages-and-returns", "--loss-type", "sft_loss", "--no-offload-train",
        "--offload-rollout", "--wandb-team", "t", "--wandb-host", "https://w", "--wandb-key", "k",
        "--disable-wandb-random-suffix", "--eval-top-p", "0.7", "--eval-top-k", "5", "--eval-input-key", "q",
        "--lr-warmup-fraction", "0.25", "--disable-grpo-std-normalization", "--disable-rewards-normalization"])
    t, c, o, a, e = cfg.train, cfg.cluster, cfg.output, cfg.algo, cfg.eval
    assert (t.optimizer, t.balance_data, t.attn_implementation) == ("adam", True, "flash_attention_3")
    assert t.activation_checkpointing and not t.recompute_activations  # --gradient-checkpointing is the FSDP name
    assert t.train_env_vars == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "N": "3"}
    assert t.train_memory_margin_bytes == 0 and t.num_critic_only_steps == 2
    assert t.warmup_steps(40) == 10 and parse_args(BASE).train.warmup_steps(40) == 0
    assert a.compute_advantages_and_returns is False
    assert a.grpo_std_normalization is False and a.rewards_normalization is False
    assert (c.offload_train, c.offload_rollout) == (False, True)
    assert (o.wandb_team, o.wandb_host, o.wandb_key, o.wandb_random_suffix) == ("t", "https://w", "k", False)
    assert (e.eval_top_p, e.eval_top_k, e.eval_input_key) == (0.7, 5, "q")


def test_no_offload_train_overrides_colocate_in_the_plan():
    from miles.run.resolve import resolve_run

    def plan(*extra: str):
        return resolve_run(parse_args(BASE + ["--colocate", *extra]), num_prompts=None, output_dir="o", world_size=2)

    assert plan().offload_train is True
    assert plan("--no-offload-train").offload_train is False and plan("--no-offload-train").offload_rollout is True


def test_custom_config_sets_flags_and_keeps_plugin_arguments(tmp_path):
    from miles.rollout.plugins import PluginArgs

    p = tmp_path / "c.yaml"
    p.write_text("use_tis: true\ntis_clip: 3.0\ntis_mode: truncate\n")
    cfg = parse_args(BASE + ["--custom-config-path", str(p), "--tis-clip", "1.5"])
    assert cfg.algo.use_tis is True and cfg.algo.tis_clip == 3.0  # the YAML wins, as in Miles
    assert cfg.custom_config == {"tis_mode": "truncate"}
    args = PluginArgs(cfg.algo, cfg.reward, extra=cfg.custom_config)
    assert args.tis_mode == "truncate" and args.use_tis is True
    inline = "base64:" + base64.b64encode(b"eps_clip: 0.3\n").decode()
    assert parse_args(BASE + ["--custom-config-path", inline]).algo.eps_clip == 0.3
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    assert _refusal(["--custom-config-path", str(tmp_path / "bad.yaml")]).startswith("--custom-config-path")
    assert _refusal(["--custom-config-path", str(tmp_path / "missing.yaml")]).startswith("--custom-config-path")


def test_dump_details_is_where_rollouts_are_written(tmp_path):
    from miles.run.loop import dump_samples
    from miles.types import Sample

    out = parse_args(BASE + ["--dump-details", str(tmp_path)]).output
    assert out.rollout_dump_path == f"{tmp_path}/rollout_data/{{rollout_id}}.jsonl"
    dump_samples(out.rollout_dump_path.format(rollout_id=3), [[Sample(prompt="p", response="r")]])
    assert (tmp_path / "rollout_data" / "3.jsonl").read_text().count("\n") == 1
    both = parse_args(BASE + ["--dump-details", str(tmp_path), "--save-debug-rollout-data", "x/{rollout_id}.jsonl"])
    assert both.output.rollout_dump_path == "x/{rollout_id}.jsonl"


def test_wandb_run_name_suffix():
    import random

    from miles.run.metrics import wandb_run_name

    name = wandb_run_name(parse_args(BASE + ["--run-name", "r"]).output, random.Random(0))
    assert name.startswith("r_") and len(name) == len("r_") + 6
    assert wandb_run_name(parse_args(BASE + ["--run-name", "r", "--disable-wandb-random-suffix"]).output) == "r"


def test_no_response_limit_by_default_reaches_the_engine_request():
    from miles.rollout.generate import MultiTurn, build_sampling_params
    from miles.types import Sample

    rollout = parse_args(BASE).rollout
    params = build_sampling_params(rollout)
    assert rollout.rollout_max_response_len is None and params["max_new_tokens"] is None
    turn = MultiTurn(Sample(prompt="p", tokens=[1, 2]), tokenizer=None, sampling_params=params)
    assert turn.remaining is None
    limited = MultiTurn(Sample(prompt="p", tokens=[1, 2]), None, build_sampling_params(rollout, max_new_tokens=4))
    assert limited.remaining == 4


def test_eval_keys_and_prompt_limit_reach_the_eval_datasets(tmp_path, tiny_model_dir):
    import json

    from transformers import AutoTokenizer

    from miles.config.eval_datasets import resolve_eval_datasets
    from miles.rollout.data import load_eval_datasets

    p = tmp_path / "eval.jsonl"
    p.write_text("\n".join(json.dumps({"q": "1" * n, "a": str(n)}) for n in (2, 3, 40)) + "\n")
    cfg = parse_args(BASE + ["--eval-prompt-data", "e", str(p), "--eval-input-key", "q", "--eval-label-key", "a",
                             "--eval-max-prompt-len", "10"])
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    items = load_eval_datasets(resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout), cfg.eval, cfg.data, tok)["e"].items
    assert [it.label for it in items] == ["2", "3"]  # the 40-token prompt is over --eval-max-prompt-len
    assert cfg.data.input_key == "input"  # the training data keeps --input-key


def test_train_env_vars_reach_the_environment(monkeypatch):
    import os

    from miles.run.entry import apply_train_env_vars

    monkeypatch.delenv("MILES_TEST_ENV_VAR", raising=False)
    cfg = parse_args(BASE + ["--train-env-vars", '{"MILES_TEST_ENV_VAR": "expandable_segments:True"}'])
    apply_train_env_vars(cfg.train.train_env_vars)
    assert os.environ["MILES_TEST_ENV_VAR"] == "expandable_segments:True"
    monkeypatch.delenv("MILES_TEST_ENV_VAR")


def test_save_retain_interval_keeps_multiples_from_pruning(tmp_path):
    from miles.trainer.checkpoint import list_checkpoints, save_checkpoint

    ckpt = parse_args(BASE + ["--save", str(tmp_path), "--save-retain-interval", "3", "--keep-checkpoints", "1"]).checkpoint
    for step in range(8):
        save_checkpoint(ckpt.save, step, lambda d: (d / "x").write_text("x"), keep=ckpt.keep_checkpoints,
                        retain_interval=ckpt.save_retain_interval)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0, 3, 6, 7]
    assert _refusal(["--save-retain-interval", "0"]).startswith("--save-retain-interval")


def test_other_miles_flags_are_refused_as_not_implemented_not_guessed():
    msg = _refusal(["--custom-eval-rollout-log-function-path", "m.f", "--custom-rollout-log-function-path", "m.g"])
    assert msg.startswith("--custom-eval-rollout-log-function-path (and 1 more): a Miles v0.1.0 flag that miles does "
                          "not implement")
    assert "did you mean" not in msg  # a Miles flag is named as such, not guessed
    assert _refusal(["--rollout-temprature", "1"]).endswith("did you mean --rollout-temperature?")


def test_apply_chat_template_kwargs_reach_the_template(tmp_path, tiny_model_dir):
    import json

    from transformers import AutoTokenizer

    from miles.rollout.data import PromptDataset

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"input": "ab"}) + "\n")
    plain = parse_args(BASE + ["--apply-chat-template"]).data
    loud = parse_args(BASE + ["--apply-chat-template", "--apply-chat-template-kwargs", '{"shout": true}']).data
    assert loud.apply_chat_template_kwargs == {"shout": True}
    ids = [PromptDataset(str(p), tok, d, 0).items[0].prompt_ids for d in (plain, loud)]
    assert tok.decode(ids[0]) == "ab" and tok.decode(ids[1]) == "ab!"


def test_max_context_len_cuts_max_new_tokens():
    from miles.rollout.manager import RolloutManager

    def fit(argv, prompt_len, stream="train"):
        cfg = parse_args(BASE + argv)
        m = RolloutManager.__new__(RolloutManager)  # only the sampling-parameter helper is exercised
        m.rollout, m.eval_cfg = cfg.rollout, cfg.eval
        from miles.rollout.generate import build_sampling_params

        return m._fit_context(build_sampling_params(cfg.rollout), prompt_len, stream)["max_new_tokens"]

    assert fit([], 10) is None
    assert fit(["--rollout-max-context-len", "32"], 10) == 22
    assert fit(["--rollout-max-context-len", "32", "--rollout-max-response-len", "8"], 10) == 8
    assert fit(["--rollout-max-context-len", "8"], 10) == 0
    assert fit(["--rollout-max-context-len", "32", "--eval-max-context-len", "16"], 10, "eval:x") == 6
    assert fit(["--rollout-max-context-len", "32", "--eval-max-context-len", "16"], 10, "train") == 22


def test_secrets_are_not_written_out():
    cfg = parse_args(BASE + ["--wandb-key", "k-123", "--sglang-api-key", "s-456"])
    text = cfg.to_json()
    assert "k-123" not in text and "s-456" not in text
    assert cfg.output.wandb_key == "k-123"  # the value itself is kept for wandb.login


def test_dynamic_global_batch_size_is_one_step_of_what_arrives(monkeypatch):
    """--use-dynamic-global-batch-size (Miles's run_kimi_k25.py): one optimizer step per rollout over every sample it
    gives; the trainer gets no expected count (it normalises by what arrives). Needs --use-dynamic-batch-size, as in
    Miles; a step count or global batch that would be dropped is refused in one line."""
    from types import SimpleNamespace

    from miles.run.resolve import derive_steps
    from miles.trainer import build

    dyn = ["--use-dynamic-global-batch-size", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512",
           "--n-samples-per-prompt", "8"]
    cfg = parse_args(BASE + dyn + ["--global-batch-size", "32"])
    assert cfg.data.use_dynamic_global_batch_size and derive_steps(cfg) == (1, 32, 32)
    seen = {}
    monkeypatch.setattr(build, "build_trainer", lambda *a, **kw: seen.update(kw))   # what the trainer is handed
    plan = SimpleNamespace(num_rollout=2, global_batch_size=32, num_steps_per_rollout=1)
    ctx = SimpleNamespace(groups=SimpleNamespace(trainer_group=None, trainer_mesh=None),
                          world=SimpleNamespace(device="cpu"))
    build.build_run_trainer(cfg, ctx, plan)
    assert seen["global_batch_size"] is None and seen["num_steps_per_rollout"] == 1
    for argv, first in ((dyn[:1], "--use-dynamic-global-batch-size needs --use-dynamic-batch-size"),
                        (dyn + ["--num-steps-per-rollout", "2"], "--num-steps-per-rollout 2 with "
                                                                 "--use-dynamic-global-batch-size"),
                        (dyn + ["--global-batch-size", "16"], "--global-batch-size 16 with "
                                                              "--use-dynamic-global-batch-size")):
        assert _refusal(argv).startswith(first)
