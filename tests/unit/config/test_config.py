"""The typed config: every flag lands in exactly one section; deprecations; validation messages."""

from __future__ import annotations

import dataclasses

import pytest

from miles.config import ConfigError, MilesConfig, build_parser, parse_args
from miles.config import _section_fields as section_fields

BASE = ["--num-rollout", "2", "--rollout-batch-size", "4"]


def test_every_dest_lands_in_exactly_one_section():
    parser = build_parser()
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    owners: dict[str, list[str]] = {}
    for sf in section_fields():
        for f in dataclasses.fields(sf.type_cls):
            owners.setdefault(f.name, []).append(sf.name)
    homeless = sorted(d for d in dests if d not in owners)
    doubled = sorted(d for d, o in owners.items() if len(o) > 1)
    unknown = sorted(d for d in owners if d not in dests)
    assert not homeless, f"flags without a config section: {homeless}"
    assert not doubled, f"fields in several sections: {doubled}"
    assert not unknown, f"section fields no flag defines: {unknown}"


def test_values_are_copied_not_rewritten():
    cfg = parse_args(BASE + ["--rollout-temperature", "0.7", "--colocate", "--lr", "3e-4"])
    assert isinstance(cfg, MilesConfig)
    assert cfg.rollout.rollout_temperature == 0.7
    assert cfg.cluster.colocate is True
    assert cfg.train.lr == 3e-4
    assert cfg.checkpoint.save_interval == 100  # Miles 0.1.0 default
    assert cfg.cluster.offload_train is None  # not silently derived from --colocate


def test_rollout_router_ip_maps_with_warning(caplog):
    with caplog.at_level("WARNING", logger="miles"):
        cfg = parse_args(BASE + ["--rollout-router-ip", "10.0.0.1", "--rollout-router-port=3000"])
    assert cfg.rollout.sglang_router_ip == "10.0.0.1"
    assert cfg.rollout.sglang_router_port == 3000
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for old, new in (("--rollout-router-ip", "--sglang-router-ip"), ("--rollout-router-port", "--sglang-router-port")):
        assert [w for w in warned if w.startswith(f"{old} is deprecated") and f"use {new}" in w], warned


def test_rm_path_is_refused_naming_the_new_flag():
    with pytest.raises(ConfigError, match="--custom-rm-path"):
        parse_args(BASE + ["--rm-path", "my.rm"])


def test_num_rollout_is_required():
    with pytest.raises(ConfigError, match="--num-rollout is required"):
        parse_args(["--rollout-batch-size", "4"])
    cfg = parse_args(["--rollout-batch-size", "4", "--num-epoch", "1"])
    assert cfg.data.num_rollout is None and cfg.data.num_epoch == 1


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--global-batch-size", "3", "--num-steps-per-rollout", "2"], "must equal --global-batch-size"),
        (["--global-batch-size", "3"], "must divide"),
        (["--debug-train-only", "--debug-rollout-only"], "exclude each other"),
        (["--loss-type", "custom_loss"], "--custom-loss-function-path"),
        (["--update-weight-transfer-mode", "disk-delta"], "--update-weight-disk-dir"),
        (["--update-weight-transfer-mode", "tensor"], "--colocate"),
        (["--sglang-router-ip", "1.2.3.4"], "pass both or neither"),
        (["--eps-clip-c", "0.5"], "must be > 1.0"),
    ],
)
def test_bad_combinations_name_the_flag(extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(BASE + extra)


def test_async_refuses_colocate():
    with pytest.raises(ConfigError, match="does not support --colocate"):
        parse_args(BASE + ["--colocate"], is_async=True)


def test_config_round_trips_to_json():
    cfg = parse_args(BASE)
    assert '"rollout_batch_size": 4' in cfg.to_json()


def test_flag_reference_is_current():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "tools/gen_flag_docs.py", "--check"], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
