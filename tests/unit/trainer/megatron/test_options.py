"""The Megatron flags (miles/config/megatron.py) and their checks (miles/trainer/megatron/options.py):
accepted with --train-backend megatron, refused by name otherwise; shape flags against config.json;
unsupported values one line naming flag and value; the preflight hook runs the same checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options

QWEN3_FULL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--swiglu",
              "--normalization", "RMSNorm", "--qk-layernorm", "--disable-bias-linear", "--rotary-base", "10000",
              "--use-rotary-position-embeddings", "--position-embedding-type", "rope"]


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2", *extra])


def _hf(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def test_megatron_flags_need_the_megatron_backend(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size \(and 1 more Megatron flags\) needs "
                                          r"--train-backend megatron \(got --train-backend fsdp\)"):
        _cfg(tiny_model_dir, "--train-backend", "fsdp", "--tensor-model-parallel-size", "2", "--sequence-parallel")
    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
               "--use-distributed-optimizer", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
               "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash",
               "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
               *QWEN3_FULL)
    assert cfg.megatron.tensor_model_parallel_size == 2 and cfg.megatron.use_distributed_optimizer
    options.preflight_check(cfg, _hf(tiny_model_dir))             # the full Qwen3 shape matches config.json
    o = options.resolve(cfg.megatron, cfg.train)
    assert (o.tp, o.recompute_granularity, o.recompute_method, o.recompute_num_layers) == (2, "full", "uniform", 1)


@pytest.mark.parametrize("flags,message", [
    (["--num-layers", "3"], "--num-layers 3 does not match --hf-checkpoint's config.json (num_hidden_layers 2)"),
    (["--hidden-size", "128"], "--hidden-size 128 does not match --hf-checkpoint's config.json (hidden_size 64)"),
    (["--group-query-attention", "--num-query-groups", "4"], "--num-query-groups 4 does not match --hf-checkpoint's "
                                                             "config.json (num_key_value_heads 2)"),
    (["--normalization", "LayerNorm"], "--normalization LayerNorm does not match"),
    (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights (given) does not match"),
    ([a for a in QWEN3_FULL if a != "--qk-layernorm"], "--qk-layernorm is missing but --hf-checkpoint's config.json "
                                                       "has q_norm/k_norm present"),
], ids=["num_layers", "hidden_size", "num_query_groups", "normalization", "untie", "missing_qk_layernorm"])
def test_shape_flags_are_checked_against_config_json(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron", *flags)
    with pytest.raises(ConfigError) as e:
        options.preflight_check(cfg, _hf(tiny_model_dir))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags,message", [
    (["--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size 3 is more than config.json's "
                                              "num_hidden_layers 2"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], "--cp-comm-type a2a"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs an MoE model"),
    (["--decoder-first-pipeline-num-layers", "1"], "--decoder-first-pipeline-num-layers needs"),
    (["--num-experts", "4"], "--num-experts is given but --hf-checkpoint's config.json describes a dense model"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide config.json's "
                                            "num_attention_heads 4"),
], ids=["pp3", "cp2", "ep2", "pipeline_split", "moe", "tp3"])
def test_unsupported_values_are_one_line(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron", *flags)
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        options.preflight_check(cfg, _hf(tiny_model_dir))


def test_device_dependent_refusals(tiny_model_dir: Path) -> None:
    import torch

    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
               "--sequence-parallel")
    from transformers import AutoConfig

    shape = options.shape_of(AutoConfig.from_pretrained(tiny_model_dir))
    cpu = torch.device("cpu")
    # --sequence-parallel runs on the local spec too (model.SequenceParallelNorm; tests/multiprocess/test_megatron_cp.py)
    options.check_supported(options.resolve(cfg.megatron, cfg.train), shape, cpu, 1)
    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron", "--use-distributed-optimizer", "--recompute-activations")
    o = options.resolve(cfg.megatron, cfg.train)
    assert o.distributed_optimizer and o.recompute_granularity == "selective"
    options.check_supported(o, shape, cpu, 2)                  # ZeRO-1 over 2 DP ranks, selective recompute


def test_preflight_runs_the_megatron_checks(tiny_model_dir: Path) -> None:
    from miles.run import preflight

    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron", "--num-layers", "5")
    checks = preflight.backend_checks("megatron")
    assert options.preflight_check in checks
    with pytest.raises(ConfigError, match=r"^--num-layers 5 does not match"):
        options.preflight_check(cfg, _hf(tiny_model_dir))


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    cfg_dir = tmp_path / "m"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    cfg = _cfg(cfg_dir, "--train-backend", "megatron")
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: --train-backend megatron does not build model_type 'gpt2'; "
                                          r"the nearest family it builds is none close to it \(all: "):
        options.preflight_check(cfg, {"model_type": "gpt2", "n_layer": 2})


def test_distributed_optimizer_is_on_by_default_as_in_miles(tiny_model_dir: Path) -> None:
    """Miles's set_default_megatron_args turns the distributed optimizer on with Adam: not giving the flag means
    on; the value stays None in the typed section (not given), and is not given under --train-backend fsdp."""
    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron")
    assert cfg.megatron.use_distributed_optimizer is None and "--use-distributed-optimizer" not in cfg.megatron.given()
    assert options.resolve(cfg.megatron, cfg.train).distributed_optimizer
    assert _cfg(tiny_model_dir, "--train-backend", "fsdp").megatron.given() == []
    # with EP > 1 too (the experts' state sharded over the expert-DP group: parallel.ExpertShardedAdamW)
    cfg = _cfg(tiny_model_dir, "--train-backend", "megatron", "--expert-model-parallel-size", "2")
    assert options.resolve(cfg.megatron, cfg.train).distributed_optimizer


def test_expert_sharded_adamw_runs_step_post_hooks_once_per_step() -> None:
    """The run's progress line registers a step post-hook on the trainer's optimizer (``run/build.py``); the
    distributed optimizer under expert parallelism (two parts) runs it once per step, after both parts stepped,
    and its handle removes it."""
    import torch

    from miles.trainer.megatron.parallel import ExpertShardedAdamW

    dense, expert = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = ExpertShardedAdamW(torch.optim.AdamW([dense], lr=0.1), torch.optim.AdamW([expert], lr=0.1))
    seen = []
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append((o, bool((dense < 1).all()),
                                                                             bool((expert < 1).all()))))
    dense.grad, expert.grad = torch.ones(2), torch.ones(3)
    opt.step()
    assert seen == [(opt, True, True)]
    handle.remove()
    opt.step()
    assert len(seen) == 1
