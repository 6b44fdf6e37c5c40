"""The routing-replay flags (--use-rollout-routing-replay / --use-routing-replay): accepted for a MoE model on both
backends (the dry run passes), one line naming the flag for a dense model or a pair that cannot work, and the
SGLang engine started with --enable-return-routed-experts as Miles starts it. The indexer-replay flags stay
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.run.entry import dry_run
from miles.utils.tiny_model import build_tiny_moe_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_moe_model(tmp_path_factory.mktemp("moe"))


def _cfg(model: Path, tmp_path: Path, *extra: str):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(4)))
    return parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
                       "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "2",
                       "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
                       "--output-dir", str(tmp_path / "out"), "--dry-run", *extra])


def _one_line(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        dry_run(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_moe_model_dry_run_passes(moe_dir, tmp_path, backend, flag):
    pytest.importorskip("megatron.core") if backend == "megatron" else None
    cfg = _cfg(moe_dir, tmp_path, "--train-backend", backend, flag)
    assert "role plan" in dry_run(cfg)


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_dense_model_is_one_line_naming_the_flag(tiny_model_dir, tmp_path, backend, flag):
    pytest.importorskip("megatron.core") if backend == "megatron" else None
    msg = _one_line(_cfg(tiny_model_dir, tmp_path, "--train-backend", backend, flag))
    assert msg.startswith(f"{flag}: --hf-checkpoint's model (qwen3) has no MoE layers"), msg


def test_r2_without_the_old_log_prob_pass_is_refused(moe_dir, tmp_path):
    msg = _one_line(_cfg(moe_dir, tmp_path, "--train-backend", "fsdp", "--use-routing-replay",
                         "--use-rollout-logprobs"))
    assert msg.startswith("--use-routing-replay records the routing of the old log-prob forward"), msg


@pytest.mark.parametrize("flag", ["--use-indexer-replay", "--use-rollout-indexer-replay"])
def test_indexer_replay_stays_refused(flag):
    with pytest.raises(ConfigError, match=f"^{flag}: indexer replay"):
        parse_args(["--num-rollout", "1", "--rollout-batch-size", "1", flag])


def test_sglang_engines_start_with_enable_return_routed_experts(tmp_path):
    from miles.fleet.engines import engine_argv_from_config, replay_server_flags

    cfg = parse_args(["--num-rollout", "1", "--rollout-batch-size", "1", "--use-rollout-routing-replay"])
    extra = replay_server_flags("sglang", cfg.algo)
    argv = engine_argv_from_config("sglang", cfg.rollout, hf_checkpoint=str(tmp_path), host="127.0.0.1", port=3000,
                                   api_key=None, num_gpus=1, base_gpu_id=0, device="cuda", colocate=False,
                                   sglang=cfg.sglang, extra=extra)
    assert argv[argv.index("sglang.launch_server") - 1:][:2] == ["-m", "sglang.launch_server"]
    assert "--enable-return-routed-experts" in argv
    assert replay_server_flags("embedded", cfg.algo) == []      # the embedded engine records them for MoE models
    plain = parse_args(["--num-rollout", "1", "--rollout-batch-size", "1"])
    assert replay_server_flags("sglang", plain.algo) == []
    assert plain.algo.use_rollout_routing_replay is False and plain.algo.use_routing_replay is False
