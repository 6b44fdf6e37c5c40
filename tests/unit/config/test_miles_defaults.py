"""Defaults equal Miles v0.1.0's for the backend in use, and the backend in use is megatron unless named.

The tables were read from Miles v0.1.0: ``radixark/miles@v0.1.0:miles/utils/arguments.py`` (``--train-backend`` defaults to
megatron; its ``reset_arg`` overrides, e.g. ``--lr`` 1e-6 after either backend's parser),
``radixark/miles@v0.1.0:miles/backends/fsdp_utils/arguments.py`` (FSDPArgs) for ``--train-backend fsdp``, and Megatron-LM's
``megatron/training/arguments.py`` with ``radixark/miles@v0.1.0:miles/backends/megatron_utils/arguments.py``'s
``set_default_megatron_args`` for ``megatron``. ``DEPARTURES`` are the defaults kept different on purpose;
docs/flags.md lists them with the reason.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import MilesConfig, parse_args
from miles.trainer.megatron.options import resolve

REPO = Path(__file__).resolve().parents[3]

BASE: list[str] = []  # nothing given (parsed without the checks that need --num-rollout and friends)

MILES_V010 = {
    # cluster
    "actor_num_nodes": 1, "actor_num_gpus_per_node": 8, "critic_num_nodes": None, "critic_num_gpus_per_node": None,
    "rollout_num_gpus": None, "rollout_num_gpus_per_engine": 1, "num_gpus_per_node": 8, "colocate": False,
    "offload": False, "offload_train": None, "offload_rollout": None, "debug_train_only": False,
    "debug_rollout_only": False, "distributed_backend": "nccl", "distributed_timeout_minutes": 10,
    # rollout and sampling
    "rollout_max_response_len": None, "rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1,
    "rollout_stop": None, "rollout_stop_token_ids": None, "rollout_skip_special_tokens": False, "rollout_seed": 42,
    "sglang_router_policy": None,
    # data, reward, eval
    "prompt_data": None, "input_key": "input", "label_key": None, "metadata_key": "metadata", "tool_key": "tools",
    "multimodal_keys": None, "apply_chat_template": False, "chat_template_path": None, "rollout_shuffle": False,
    "rollout_max_prompt_len": None,
    "num_epoch": None, "num_rollout": None, "n_samples_per_prompt": 1, "global_batch_size": None,
    "num_steps_per_rollout": None, "over_sampling_batch_size": None, "dynamic_sampling_filter_path": None,
    "custom_generate_function_path": None, "rm_type": None, "custom_rm_path": None, "group_rm": False,
    "rm_url": None, "reward_key": None, "custom_config_path": None, "eval_prompt_data": None, "eval_interval": None,
    "n_samples_per_eval_prompt": 1, "eval_max_response_len": None, "eval_temperature": None, "eval_top_p": None,
    "eval_top_k": None, "eval_min_new_tokens": None, "eval_max_prompt_len": None, "eval_max_context_len": None,
    "eval_input_key": None, "eval_label_key": None, "eval_tool_key": None, "skip_eval_before_train": False,
    # trainer (backend-independent)
    "optimizer": "adam", "lr": 1e-6, "min_lr": 0.0, "lr_warmup_iters": 0, "lr_warmup_fraction": None,
    "lr_decay_iters": None, "adam_beta1": 0.9, "adam_eps": 1e-8, "clip_grad": 1.0, "micro_batch_size": 1,
    "use_dynamic_batch_size": False, "max_tokens_per_gpu": None, "balance_data": False, "log_probs_chunk_size": -1,
    "gradient_checkpointing": False, "fsdp_cpu_offload": False, "train_env_vars": {},
    "train_memory_margin_bytes": 1024**3, "megatron_to_hf_mode": "raw", "seed": 1234, "deterministic_mode": False,
    "hf_checkpoint": None, "ref_load": None, "critic_load": None, "critic_lr": None, "critic_lr_warmup_iters": 0, "num_critic_only_steps": 0,
    "mfu_peak_tflops": None, "save": None, "load": None, "no_save_optim": False, "save_hf": None,
    "attn_implementation": "flash_attention_2", "qkv_format": "thd",
    # algorithm
    "advantage_estimator": "grpo", "loss_type": "policy_loss", "custom_loss_function_path": None, "eps_clip": 0.2,
    "eps_clip_high": None, "eps_clip_c": None, "value_clip": 0.2, "kl_coef": 0.0, "use_kl_loss": False,
    "kl_loss_coef": 0.0, "kl_loss_type": "k1", "entropy_coef": 0.0, "gamma": 1.0, "lambd": 1.0,
    "normalize_advantages": False, "grpo_std_normalization": True, "rewards_normalization": True,
    "compute_advantages_and_returns": True, "calculate_per_token_loss": False, "use_rollout_logprobs": False,
    "use_tis": False, "tis_clip": 2.0, "tis_clip_low": 0.0, "custom_tis_function_path": None, "use_opd": False,
    "opd_type": None, "opd_kl_coef": 1.0, "opd_teacher_load": None,
    # fault tolerance and output
    "use_fault_tolerance": False, "rollout_health_check_interval": 30.0, "rollout_health_check_timeout": 30.0,
    "rollout_health_check_first_wait": 0.0,
    "use_wandb": False, "wandb_project": None, "wandb_group": None, "wandb_team": None, "wandb_host": None,
    "wandb_key": None, "wandb_random_suffix": True, "use_tensorboard": False, "save_debug_rollout_data": None,
    "dump_details": None,
}

# Miles v0.1.0 values that differ by backend: (fsdp, megatron)
MILES_V010_BY_BACKEND = {
    "adam_beta2": (0.95, 0.999),
    "weight_decay": (0.0, 0.01),
    "lr_decay_style": ("constant", "linear"),
}

# Miles v0.1.0's Megatron side, as the Megatron trainer resolves its flags (miles.trainer.megatron.options)
MILES_V010_MEGATRON = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "sequence_parallel": False,
                       "recompute_granularity": None, "attention_backend": "auto", "vocab_divisible_by": 128,
                       "cp_comm_type": "p2p", "distributed_optimizer": True}  # set_default_megatron_args: Adam

# kept different on purpose (docs/flags.md, "Departures from Miles"): dest -> (Miles v0.1.0, here)
DEPARTURES = {
    "save_interval": (None, 100),
}
# the same for the Megatron trainer's resolved options: field -> (flag, Miles v0.1.0, here)
MEGATRON_DEPARTURES = {
    "hidden_dropout": ("--hidden-dropout", 0.1, 0.0),                # Megatron-LM's; Miles's scripts pass 0.0
    "attention_dropout": ("--attention-dropout", 0.1, 0.0),
}


def _values(cfg: MilesConfig) -> dict:
    out: dict = {}
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sec):
            out.update({k.name: getattr(sec, k.name) for k in dataclasses.fields(sec)})
    return out


@pytest.mark.parametrize("argv", [BASE, BASE + ["--train-backend", "megatron"]], ids=["no-backend", "megatron"])
def test_defaults_equal_miles_v010_with_megatron(argv):
    """Naming no backend is naming megatron: Miles's default backend with its Megatron-side defaults."""
    cfg = parse_args(argv, validate=False)
    got = _values(cfg)
    assert got["train_backend"] == "megatron"
    wrong = {k: (got[k], v) for k, v in MILES_V010.items() if got[k] != v or type(got[k]) is not type(v)
             and not (isinstance(v, float) and isinstance(got[k], (int, float)))}
    assert not wrong, f"dest: (here, Miles v0.1.0) {wrong}"
    assert {k: got[k] for k in MILES_V010_BY_BACKEND} == {k: m for k, (_, m) in MILES_V010_BY_BACKEND.items()}
    opts = resolve(cfg.megatron, cfg.train)
    assert {k: getattr(opts, k) for k in MILES_V010_MEGATRON} == MILES_V010_MEGATRON


def test_fsdp_backend_takes_miles_fsdp_defaults():
    got = _values(parse_args(BASE + ["--train-backend", "fsdp"], validate=False))
    wrong = {k: (got[k], v) for k, v in MILES_V010.items() if got[k] != v}
    assert not wrong, f"dest: (here, Miles v0.1.0) {wrong}"
    assert {k: got[k] for k in MILES_V010_BY_BACKEND} == {k: f for k, (f, _) in MILES_V010_BY_BACKEND.items()}
    assert got["lr"] == 1e-6 and got["optimizer"] == "adam"


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_a_given_value_wins_over_the_backend_default(backend):
    got = _values(parse_args(BASE + ["--train-backend", backend, "--adam-beta2", "0.98", "--weight-decay", "0.1",
                                     "--lr-decay-style", "cosine"], validate=False))
    assert (got["adam_beta2"], got["weight_decay"], got["lr_decay_style"]) == (0.98, 0.1, "cosine")


def test_departures_are_the_only_differences_and_are_documented():
    from pathlib import Path

    got = _values(parse_args(BASE, validate=False))
    doc = (Path(__file__).resolve().parents[3] / "docs" / "flags.md").read_text()
    section = doc.split("## Departures from Miles", 1)[1]
    for dest, (miles, here) in DEPARTURES.items():
        assert got[dest] == here, dest
        assert miles != here
        assert f"`--{dest.replace('_', '-')}`" in section, dest
    opts = resolve(parse_args(BASE, validate=False).megatron)
    for field, (flag, miles, here) in MEGATRON_DEPARTURES.items():
        assert getattr(opts, field) == here and miles != here, field
        assert f"`{flag}`" in section, flag
    assert "`--train-backend`" not in section  # megatron, as in Miles


# ------------------------------------------------------------------ without megatron-core
HIDDEN = ("import runpy, sys; sys.modules['megatron'] = None; sys.argv[0] = 'train.py'; "
          "runpy.run_path('train.py', run_name='__main__')")


def _dry_run_without_megatron(tmp_path: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    """``train.py --dry-run`` in a fresh interpreter where ``import megatron`` fails, as without the package."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    argv = ["--dry-run", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
            "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "1", "--actor-num-gpus-per-node", "1",
            "--rollout-num-gpus", "1", "--num-gpus-per-node", "2", "--output-dir", str(tmp_path / "out"), *extra]
    return subprocess.run([sys.executable, "-c", HIDDEN, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_no_backend_without_megatron_core_is_one_line_at_the_dry_run(tmp_path: Path, tiny_model_dir: Path):
    out = _dry_run_without_megatron(tmp_path, tiny_model_dir)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["[miles] error: --train-backend megatron (the default, as in Miles) needs megatron-core, which "
                      "is not installed: pip install 'miles[megatron]' (megatron-core 0.16.1), or train with "
                      "--train-backend fsdp."], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "resolved config" not in out.stdout


def test_fsdp_backend_needs_no_megatron_core(tmp_path: Path, tiny_model_dir: Path):
    out = _dry_run_without_megatron(tmp_path, tiny_model_dir, "--train-backend", "fsdp")
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"train_backend": "fsdp"' in out.stdout
