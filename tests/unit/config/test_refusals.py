"""Flags miles does not accept are refused in one line naming the flag (never argparse's usage dump)."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, megatron_flags, parse_args

BASE = ["--num-rollout", "2", "--rollout-batch-size", "4"]


def test_megatron_flags_are_refused_by_name():
    with pytest.raises(ConfigError) as ei:
        parse_args(BASE + ["--train-backend", "fsdp", "--tensor-model-parallel-size", "2", "--num-layers", "36",
                           "--sequence-parallel"])
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("--tensor-model-parallel-size (and 2 more Megatron flags) needs --train-backend megatron")


def test_megatron_table_never_shadows_a_defined_flag():
    assert "--lr" in megatron_flags() and "--seed" in megatron_flags()
    assert parse_args(BASE + ["--lr", "3e-4"]).train.lr == 3e-4


def test_unrecognized_flag_is_one_line_with_the_closest_miles_flag(capsys):
    with pytest.raises(ConfigError) as ei:
        parse_args(BASE + ["--rollout-temprature", "0.5"])
    assert str(ei.value) == "unrecognized argument --rollout-temprature; did you mean --rollout-temperature?"
    assert capsys.readouterr().err == ""  # no usage dump


def test_bad_value_is_one_line_not_a_usage_dump(capsys):
    with pytest.raises(ConfigError, match=r"argument --advantage-estimator: invalid choice: 'dpo'"):
        parse_args(BASE + ["--advantage-estimator", "dpo"])
    assert capsys.readouterr().err == ""
