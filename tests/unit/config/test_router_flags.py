"""--router-<flag>: sglang-router's RouterArgs flags (the JSON kept in the repo), registered as Miles v0.1.0 does,
passed to the router miles starts, and refused in one line where they cannot apply."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, build_parser, parse_args
from miles.config import router as R
from miles.fleet.router import RouterProcess, router_argv
from miles.run.build import plugin_extra

ROOT = Path(__file__).resolve().parents[3]
BASE = ["--num-rollout", "2", "--rollout-batch-size", "4"]
HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None


@pytest.mark.skipif(not HAS_ROUTER, reason="sglang-router not installed")
def test_json_matches_the_installed_sglang_router():
    out = subprocess.run([sys.executable, "tools/gen_sglang_router_args.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(not HAS_ROUTER, reason="sglang-router not installed")
def test_every_prefixed_router_flag_is_registered_as_miles_does():
    from sglang_router.router_args import RouterArgs

    theirs = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(theirs, use_router_prefix=True, exclude_host_port=True)
    ours = {o: a for a in build_parser()._actions for o in a.option_strings}
    for a in theirs._actions:
        for flag in (f for f in a.option_strings if f.startswith("--router-")):
            mine = ours[flag]
            assert mine.dest == "router_args", flag
            assert mine.nargs == (0 if a.nargs == 0 else a.nargs), flag
            assert (list(mine.choices) if mine.choices else None) == (sorted(a.choices, key=str) if a.choices and
                                                                      flag == "--router-tool-call-parser" else
                                                                      list(a.choices) if a.choices else None), flag
    assert len(R.load_spec()) == 95 and R.router_version() == "0.3.2"


def test_given_flags_are_recorded_with_their_types_and_nothing_else():
    cfg = parse_args([*BASE, "--router-health-success-threshold", "2", "--router-cache-threshold", "0.5",
                      "--router-disable-retries", "--router-selector", "a=b", "c=d",
                      "--router-prefill", "http://p:1", "9000", "--router-prefill", "http://q:2"])
    assert cfg.rollout.router_args == {"health_success_threshold": 2, "cache_threshold": 0.5, "disable_retries": True,
                                       "selector": ["a=b", "c=d"], "prefill": [["http://p:1", "9000"], ["http://q:2"]]}
    assert parse_args(BASE).rollout.router_args is None


def test_miles_script_flag_is_accepted():  # Miles's scripts/run_glm45_355b_a32b.py
    cfg = parse_args([*BASE, "--router-health-success-threshold", "1"])
    assert cfg.rollout.router_args == {"health_success_threshold": 1}


@pytest.mark.parametrize("argv, match", [
    (["--router-policy", "fastest"], r"argument --router-policy: invalid choice: 'fastest'"),
    (["--router-health-success-threshold", "two"], r"--router-health-success-threshold: invalid int value: 'two'"),
    (["--router-no-such-thing", "1"], r"unrecognized argument --router-no-such-thing"),
    (["--router-policy", "random", "--sglang-router-policy", "round_robin"],
     r"^--router-policy random conflicts with --sglang-router-policy round_robin .*pass --sglang-router-policy random"),
    (["--router-request-timeout-secs", "60"],
     r"^--router-request-timeout-secs 60 conflicts with --sglang-router-request-timeout-secs 14400, its default"),
    (["--router-request-timeout-secs", "60", "--sglang-router-request-timeout-secs", "30"],
     r"conflicts with --sglang-router-request-timeout-secs 30 "),
    (["--router-api-key", "secret"], r"^--router-api-key \*\*\*: .*pass --sglang-api-key \*\*\* instead"),
    (["--router-api-key", "a", "--sglang-api-key", "b"], r"^--router-api-key \*\*\* conflicts with --sglang-api-key"),
    (["--router-cache-threshold", "0.1", "--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "30000"],
     r"^--router-cache-threshold cannot apply: --sglang-router-ip 10.0.0.1 names a running router"),
])
def test_refusals_are_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_args([*BASE, *argv])
    assert "\n" not in str(e.value) and "secret" not in str(e.value)


def test_equal_pairs_and_policy_alone_are_accepted():
    for argv in (["--router-policy", "random"], ["--router-policy", "random", "--sglang-router-policy", "random"],
                 ["--router-request-timeout-secs", "14400"], ["--router-api-key", "k", "--sglang-api-key", "k"]):
        assert parse_args([*BASE, *argv]).rollout.router_args


def test_missing_package_is_one_line_naming_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name, *a))
    assert parse_args(BASE).rollout.router_args is None  # the parser itself does not need it
    with pytest.raises(ConfigError, match=r"^--router-queue-size needs the sglang-router package, which is not "
                                          r"installed: pip install 'sglang-router>=0.3.2'"):
        parse_args([*BASE, "--router-queue-size", "8"])


def test_secrets_are_masked_in_the_config_dump():
    cfg = parse_args([*BASE, "--router-redis-url", "redis://u:pw@h", "--router-queue-size", "8"])
    dumped = json.loads(cfg.to_json())["rollout"]["router_args"]
    assert dumped == {"redis_url": "***", "queue_size": 8} and cfg.rollout.router_args["redis_url"] == "redis://u:pw@h"


def test_plugins_see_miles_router_attrs():
    cfg = parse_args([*BASE, "--router-queue-size", "8"])
    extra = plugin_extra(cfg)
    assert extra["router_queue_size"] == 8 and extra["router_health_success_threshold"] == 2  # router's default
    assert extra["router_policy"] == "cache_aware"


def test_router_argv_user_flags_override_miles_settings(monkeypatch):
    cfg = parse_args([*BASE, "--router-health-check-interval-secs", "7", "--router-log-level", "debug",
                      "--router-health-success-threshold", "3", "--router-disable-health-check",
                      "--router-prometheus-port", "29123", "--sglang-router-policy", "round_robin"])
    started: list[list[str]] = []

    class Stop(Exception):
        pass

    def fake_popen(argv, **kwargs):
        started.append(argv)
        raise Stop
    monkeypatch.setattr("miles.fleet.router.subprocess.Popen", fake_popen)
    r = cfg.rollout
    with pytest.raises(Stop):
        RouterProcess.start("127.0.0.1", 31000, r.sglang_router_policy, api_key="k",
                            request_timeout_secs=r.sglang_router_request_timeout_secs, router_args=r.router_args,
                            log_path="/dev/null")
    argv = started[0]
    text = " ".join(argv)
    assert argv[1:9] == ["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "31000", "--policy",
                         "round_robin"]
    assert "--health-check-interval-secs 7" in text and "--health-check-interval-secs 5" not in text
    assert "--log-level debug" in text and "warn" not in text
    assert "--prometheus-port 29123" in text and text.count("--prometheus-port") == 1
    assert "--health-success-threshold 3" in text and argv.count("--disable-health-check") == 1
    assert "--request-timeout-secs 14400" in text and "--api-key k" in text
    assert "--health-failure-threshold 2" in text  # miles's own setting where the user gave none
    # the tokens are what launch_router parses back
    if HAS_ROUTER:
        from sglang_router.launch_router import parse_router_args

        parsed = parse_router_args(argv[3:])
        assert (parsed.health_check_interval_secs, parsed.log_level, parsed.health_success_threshold,
                parsed.disable_health_check, parsed.prometheus_port, parsed.policy) == (7, "debug", 3, True, 29123,
                                                                                          "round_robin")


@pytest.mark.skipif(not HAS_ROUTER, reason="sglang-router not installed")
def test_every_kind_of_value_round_trips_through_launch_router():
    from sglang_router.launch_router import parse_router_args

    cfg = parse_args([*BASE, "--router-selector", "app=x", "tier=y", "--router-prefill", "http://p:1", "9000",
                      "--router-prefill", "http://q:2", "--router-decode", "http://d:3", "--router-pd-disaggregation",
                      "--router-retry-jitter-factor", "0.5", "--router-prometheus-duration-buckets", "0.1", "1",
                      "--router-cors-allowed-origins", "--router-balance-abs-threshold", "-1"])
    parsed = parse_router_args(router_argv("127.0.0.1", 1, cfg.rollout.router_args)[3:])
    assert parsed.selector == {"app": "x", "tier": "y"} and parsed.prefill_urls == [("http://p:1", 9000),
                                                                                   ("http://q:2", None)]
    assert parsed.decode_urls == ["http://d:3"] and parsed.pd_disaggregation and parsed.retry_jitter_factor == 0.5
    assert parsed.prometheus_duration_buckets == [0.1, 1.0] and parsed.cors_allowed_origins == []
    assert parsed.balance_abs_threshold == -1
