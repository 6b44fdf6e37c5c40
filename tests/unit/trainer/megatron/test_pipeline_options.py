"""Pipeline-parallel flags on the Megatron backend: the layer split (megatron-core's rule, checked before any
rank starts), what is refused by name in one line (interleaved stages, the PPO critic), and sequence parallelism
accepted with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options
from miles.trainer.megatron.pipeline import stage_layer_counts


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def test_stage_layer_counts_follow_megatron_core() -> None:
    assert stage_layer_counts(8, 1) == [8]
    assert stage_layer_counts(8, 2) == [4, 4]
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(3, 2, first=2) == [2, 1]
    assert stage_layer_counts(3, 2, last=2) == [1, 2]
    assert stage_layer_counts(10, 4, first=1, last=3) == [1, 3, 3, 3]
    assert stage_layer_counts(6, 3, first=1, last=1) == [1, 4, 1]


@pytest.mark.parametrize("args,message", [
    ((8, 1, 2, None), "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1 (got 1)"),
    ((8, 1, None, 2), "--decoder-last-pipeline-num-layers needs --pipeline-model-parallel-size > 1"),
    ((2, 3, None, None), "--pipeline-model-parallel-size 3 is more than config.json's num_hidden_layers 2"),
    ((7, 2, None, None), "--pipeline-model-parallel-size 2 cannot split config.json's num_hidden_layers 7"),
    ((8, 3, 1, None), "--pipeline-model-parallel-size 3 with --decoder-first-pipeline-num-layers 1 cannot split"),
    ((4, 2, 4, None), "--decoder-first-pipeline-num-layers 4 leaves no layer for the other stages"),
    ((4, 2, 1, 1), "--pipeline-model-parallel-size 2 with --decoder-first-pipeline-num-layers 1, "
                   "--decoder-last-pipeline-num-layers 1 cannot split"),
], ids=["first_without_pp", "last_without_pp", "more_stages_than_layers", "uneven", "uneven_rest", "first_all",
        "both_ends_leave_layers"])
def test_bad_splits_are_one_line(args, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        stage_layer_counts(*args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_pipeline_in_the_preflight(tiny_model_dir: Path) -> None:
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    options.preflight_check(_cfg(tiny_model_dir, "--pipeline-model-parallel-size", "2"), hf)       # 2 layers: 1 + 1
    o = options.resolve(_cfg(tiny_model_dir, "--pipeline-model-parallel-size", "2",
                             "--decoder-last-pipeline-num-layers", "1").megatron)
    assert (o.pp, o.first_stage_layers, o.last_stage_layers) == (2, None, 1)
    for flags, message in (
            (["--pipeline-model-parallel-size", "2", "--advantage-estimator", "ppo"],
             "--advantage-estimator ppo (the PPO critic) with --pipeline-model-parallel-size 2 is not supported"),
            (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"],
             "--decoder-first-pipeline-num-layers 2 leaves no layer for the other stages")):
        with pytest.raises(ConfigError) as e:
            options.preflight_check(_cfg(tiny_model_dir, *flags), hf)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_sequence_and_context_parallelism_with_pipeline_pass_the_checks(tiny_model_dir: Path) -> None:
    """The layouts tests/multiprocess/test_megatron_pp.py trains (TP 2 x PP 2 with SP:
    test_pp_sequence_parallel_matches_without; PP 2 x CP 2: test_pp_parity_with_fsdp[pp2_cp2_...])."""
    from transformers import AutoConfig

    shape = options.shape_of(AutoConfig.from_pretrained(tiny_model_dir))
    for flags in (["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--context-parallel-size", "2"]):
        options.check_static(options.resolve(_cfg(tiny_model_dir, "--pipeline-model-parallel-size", "2",
                                                  *flags).megatron), shape)


@pytest.mark.parametrize("flag", ["--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"])
def test_interleaved_pipeline_is_refused_by_name(tiny_model_dir: Path, flag: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(tiny_model_dir, "--pipeline-model-parallel-size", "2", flag, "1")
    assert str(e.value).startswith(flag) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("flag", ["--use-routing-replay", "--use-rollout-routing-replay"])
def test_routing_replay_with_pipeline_is_accepted(tiny_model_dir: Path, flag: str) -> None:
    """Routing replay runs through the pipeline (tests/multiprocess/test_routing_replay.py, pp2)."""
    cfg = _cfg(tiny_model_dir, "--pipeline-model-parallel-size", "2", flag)
    options.check_pipeline_algo(options.resolve(cfg.megatron, cfg.train), cfg.algo)
