"""--sglang-<flag>: every SGLang ServerArgs flag (the JSON kept in the repo) registered as Miles v0.1.0 does."""

from __future__ import annotations

import json

import pytest

from miles.config import ConfigError, build_parser, parse_args
from miles.config import sglang as S

BASE = ["--num-rollout", "2", "--rollout-batch-size", "4"]

# radixark/miles@v0.1.0:miles/backends/sglang_utils/arguments.py: _SKIPPED_SERVER_ARGS (not exposed as --sglang-*)
MILES_V010_SKIPPED = {"model_path", "config", "trust_remote_code", "random_seed", "enable_memory_saver", "port", "nnodes",
                      "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id", "nccl_port", "skip_server_warmup",
                      "enable_return_routed_experts", "enable_return_indexer_topk"}
# --sglang-* flags miles/config/rollout.py defines with miles's own meaning (Miles v0.1.0 defines the router ones
# and --sglang-server-concurrency itself too)
ROLLOUT_DEFINED = {"--sglang-router-ip", "--sglang-router-port", "--sglang-router-policy",
                   "--sglang-router-request-timeout-secs", "--sglang-server-concurrency", "--sglang-mem-fraction-static",
                   "--sglang-api-key"}


def test_skipped_fields_are_miles_v010s():
    assert set(S.SET_BY_MILES) == MILES_V010_SKIPPED
    assert set(S.load_spec()) >= MILES_V010_SKIPPED | S.DEFINED_ELSEWHERE  # every name is a real ServerArgs field


def test_every_serverargs_flag_is_registered_with_sglangs_spellings():
    spec = json.loads(S.SPEC_PATH.read_text())
    assert len(spec["args"]) == 460 and spec["source"].startswith("sglang 0.5.16")
    parser = build_parser()
    registered = {o: a for a in parser._actions for o in a.option_strings if o.startswith(("--sglang-", "--no-sglang-"))}
    expected: set[str] = set()
    for a in spec["args"]:
        if a["kind"] == "boolean_optional":
            expected |= {"--sglang-" + a["flags"][0][2:], "--no-sglang-" + a["flags"][0][2:]}
        else:
            expected |= {"--sglang-" + f[2:] for f in a["flags"]}
    assert set(registered) - ROLLOUT_DEFINED == expected - ROLLOUT_DEFINED
    for flag in ROLLOUT_DEFINED:  # kept with the rollout section's definition
        assert registered[flag].dest == flag[2:].replace("-", "_"), flag
    for a in spec["args"]:
        action = registered["--sglang-" + a["flags"][0][2:]]
        if a["dest"] in MILES_V010_SKIPPED or "--sglang-" + a["flags"][0][2:] in ROLLOUT_DEFINED:
            continue
        assert action.dest == "sglang_server_args" and action.nargs == (0 if a["kind"] != "store" else a["nargs"])
        assert (list(action.choices) if action.choices else None) == a["choices"], a["flags"]


def test_only_the_given_flags_are_recorded():
    cfg = parse_args(BASE)
    assert cfg.sglang.sglang_server_args is None and cfg.sglang.server_args == {}
    cfg = parse_args(BASE + ["--sglang-chunked-prefill-size", "4096", "--sglang-context-length", "32k",
                             "--sglang-tensor-parallel-size", "2", "--sglang-enable-dp-attention",
                             "--no-sglang-lora-strict-loading", "--sglang-json-model-override-args", '{"a": 1}',
                             "--sglang-model-checksum", "--sglang-cuda-graph-bs", "1", "2", "4"], validate=False)
    assert cfg.sglang.server_args == {"chunked_prefill_size": 4096, "context_length": 32000, "tp_size": 2,
                                      "enable_dp_attention": True, "lora_strict_loading": False,
                                      "json_model_override_args": '{"a": 1}', "model_checksum": "",
                                      "cuda_graph_bs": [1, 2, 4]}
    assert json.loads(cfg.to_json())["sglang"]["sglang_server_args"]["context_length"] == 32000
    again = parse_args(BASE + ["--sglang-dp-size", "2"], validate=False)  # nothing shared between parses
    assert again.sglang.server_args == {"dp_size": 2} and "dp_size" not in cfg.sglang.server_args


def test_a_miles_launch_scripts_sglang_flags_pass_validation():
    # from Miles v0.1.0's launch scripts (e.g. scripts/run-qwen3-30B-A3B.sh, examples/*/run-*.sh); their
    # `--sglang-router-policy consistent_hashing` (scripts/run_glm5_2_744b_a40b.py) is refused by name with the
    # sglang-router miles starts (tests/unit/rollout/test_routing_key.py), so the policy here is `manual`
    cfg = parse_args(BASE + ["--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
                             "--sglang-cuda-graph-bs", "1", "2", "4", "8", "16", "--sglang-enable-dp-attention",
                             "--sglang-dp-size", "1", "--sglang-moe-dense-tp-size", "1", "--sglang-enable-dp-lm-head",
                             "--sglang-server-concurrency", "512", "--sglang-router-policy", "manual",
                             "--sglang-log-level", "warning", "--sglang-enable-metrics", "--sglang-max-running-requests",
                             "128", "--sglang-chunked-prefill-size", "4096", "--sglang-speculative-algorithm", "EAGLE",
                             "--sglang-speculative-num-steps", "3", "--sglang-speculative-eagle-topk", "1",
                             "--sglang-speculative-num-draft-tokens", "4"])
    sa = cfg.sglang.server_args
    assert sa["cuda_graph_bs"] == [1, 2, 4, 8, 16] and sa["speculative_algorithm"] == "EAGLE"
    assert cfg.rollout.sglang_server_concurrency == 512 and "server_concurrency" not in sa


@pytest.mark.parametrize("argv, match", [
    (["--sglang-port", "3000"], r"^--sglang-port is not accepted \(Miles does not expose it either\): miles picks a free "
                                r"port for each engine; drop --sglang-port\.$"),
    (["--sglang-model-path", "/m"], "the engine serves --hf-checkpoint; drop --sglang-model-path"),
    (["--sglang-model", "/m"], "the engine serves --hf-checkpoint; drop --sglang-model"),
    (["--sglang-nccl-init-addr=h:1"], "--rollout-num-gpus-per-engine and --num-gpus-per-node"),
    (["--sglang-enable-memory-saver"], "memory saver on with --colocate"),
    (["--sglang-enable-return-routed-experts"], "--use-rollout-routing-replay"),
    (["--sglang-config", "groups.yaml"], "--sglang-config .*is not supported.*--sglang-<flag>"),
])
def test_flags_miles_sets_itself_are_refused_in_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as ei:
        parse_args(BASE + argv)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("argv, match", [
    (["--sglang-dtype", "fp8"], r"--sglang-dtype: invalid choice: 'fp8' \(choose from 'auto', 'half'"),
    (["--sglang-context-length", "4.5Ki"], "--sglang-context-length: '4.5Ki': decimals are not allowed"),
    (["--sglang-chunked-prefill-size", "lots"], "--sglang-chunked-prefill-size: invalid int value: 'lots'"),
    (["--sglang-preferred-sampling-params", "{bad"], "--sglang-preferred-sampling-params: '{bad' is not valid JSON"),
    (["--sglang-cuda-graph-config", "[1]"], "--sglang-cuda-graph-config: '\\[1\\]' must be a JSON object"),
    (["--sglang-chunked-prefil-size", "1"], "did you mean --sglang-chunked-prefill-size"),
])
def test_bad_values_are_one_line_naming_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match) as ei:
        parse_args(BASE + argv)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("text, value", [("12", 12), ("4k", 4000), ("25.6k", 25600), ("1Ki", 1024), ("2Mi", 2 << 20),
                                         ("1G", 10**9)])
def test_human_readable_ints_as_sglang_reads_them(text, value):
    assert parse_args(BASE + ["--sglang-max-total-tokens", text]).sglang.server_args == {"max_total_tokens": value}


def test_cli_spelling_of_each_kind():
    spec = S.load_spec()
    assert spec["enable_dp_attention"].cli(True) == ["--enable-dp-attention"]
    assert spec["lora_strict_loading"].cli(False) == ["--no-lora-strict-loading"]
    assert spec["cuda_graph_bs"].cli([1, 2]) == ["--cuda-graph-bs", "1", "2"]
    assert spec["model_checksum"].cli("") == ["--model-checksum"]
    assert spec["model_checksum"].cli("sums.json") == ["--model-checksum", "sums.json"]
    assert spec["chunked_prefill_size"].cli(-1) == ["--chunked-prefill-size=-1"]
    assert spec["preferred_sampling_params"].cli({"a": 1}) == ["--preferred-sampling-params", '{"a": 1}']
    assert spec["tp_size"].miles_flags == ["--sglang-tp-size", "--sglang-tensor-parallel-size"]


def test_cross_checks_for_validate_config():
    def check(*argv: str, gpus: int = 2) -> None:
        S.validate_sglang(parse_args(BASE + list(argv), validate=False).sglang, rollout_num_gpus_per_engine=gpus)

    check("--sglang-tp-size", "2")
    check("--sglang-dp-size", "2", "--sglang-enable-dp-attention")
    with pytest.raises(ConfigError, match=r"^--sglang-tp-size 4 disagrees with --rollout-num-gpus-per-engine 2 "):
        check("--sglang-tp-size", "4")
    with pytest.raises(ConfigError, match="--sglang-dp-size 2 needs --sglang-enable-dp-attention"):
        check("--sglang-dp-size", "2")


def test_a_flag_sglang_does_not_have_is_one_line_naming_it():
    with pytest.raises(ConfigError, match=r"^unrecognized argument --sglang-enable-ep-moe: sglang 0\.5\.16's ServerArgs "
                                          r"\(the SGLang server miles starts\) has no --enable-ep-moe") as ei:
        parse_args(BASE + ["--sglang-enable-ep-moe"])
    assert "\n" not in str(ei.value)


def test_miles_attribute_view_for_plugins():
    view = parse_args(BASE + ["--sglang-cuda-graph-max-bs", "16", "--sglang-enable-dp-attention"]).sglang.miles_attrs()
    assert view["sglang_cuda_graph_max_bs_decode"] == 16 and view["sglang_enable_dp_attention"] is True
    assert view["sglang_chunked_prefill_size"] is None and view["sglang_max_prefill_tokens"] == 16384  # SGLang's
    assert "sglang_port" not in view and "sglang_mem_fraction_static" not in view  # not --sglang-* flags of this section


def test_parse_args_runs_the_sglang_cross_checks():
    """``validate_sglang`` is part of every parse (so a --dry-run that passes has checked it)."""
    from miles.config import parse_args

    base = ["--num-rollout", "1", "--rollout-batch-size", "1", "--rollout-num-gpus-per-engine", "2"]
    with pytest.raises(ConfigError, match=r"^--sglang-tp-size 4 disagrees with --rollout-num-gpus-per-engine 2"):
        parse_args([*base, "--sglang-tp-size", "4"])
    with pytest.raises(ConfigError, match=r"^--sglang-dp-size 2 needs --sglang-enable-dp-attention"):
        parse_args([*base, "--sglang-dp-size", "2"])
    parse_args([*base, "--sglang-tp-size", "2", "--sglang-dp-size", "2", "--sglang-enable-dp-attention"])


def test_p2p_with_sglang_engines_is_one_line():
    from miles.config import parse_args

    with pytest.raises(ConfigError, match=r"^--update-weight-transfer-mode p2p needs the embedded engine"):
        parse_args(["--num-rollout", "1", "--rollout-batch-size", "1", "--rollout-engine", "sglang",
                    "--update-weight-transfer-mode", "p2p"])


def test_plugins_see_miles_sglang_attributes():
    """A Miles plugin reads ``args.sglang_<field>`` (the rollout manager's PluginArgs gets ``plugin_extra``)."""
    from miles.rollout.plugins import PluginArgs
    from miles.run.build import plugin_extra

    cfg = parse_args(BASE + ["--sglang-chunked-prefill-size", "4096"])
    args = PluginArgs(cfg.rollout, cfg.data, extra=plugin_extra(cfg))
    assert args.sglang_chunked_prefill_size == 4096 and args.sglang_max_prefill_tokens == 16384
    assert args.sglang_mem_fraction_static == cfg.rollout.sglang_mem_fraction_static  # the section's own flag wins


def test_embedded_engine_honours_what_config_says_it_honours():
    from miles.config.sglang import EMBEDDED_HONOURED
    from miles.fleet.engines import EMBEDDED_EQUIVALENTS

    assert set(EMBEDDED_EQUIVALENTS) == EMBEDDED_HONOURED


@pytest.mark.parametrize("argv, first", [
    (["--sglang-speculative-draft-model-path", "/d"], "--sglang-speculative-draft-model-path /d: the embedded engine"),
    (["--sglang-enable-dp-attention"], "--sglang-enable-dp-attention: the embedded engine"),
    (["--sglang-cuda-graph-backend-decode", "breakable"],
     "--sglang-cuda-graph-backend-decode breakable: the embedded engine (--rollout-engine embedded) has no CUDA-graph "
     "backend breakable (it takes disabled or full)"),
])
def test_embedded_engine_refuses_sglang_flags_it_would_ignore(argv, first):
    with pytest.raises(ConfigError) as ei:
        parse_args(["--num-rollout", "2", "--rollout-batch-size", "4", "--rollout-engine", "embedded", *argv])
    msg = str(ei.value)
    assert msg.startswith(first) and "\n" not in msg and "--rollout-engine sglang" in msg, msg
    # the same flags are SGLang's to take with --rollout-engine sglang, and left to the start with auto
    for engine in ("sglang", "auto"):
        parse_args(["--num-rollout", "2", "--rollout-batch-size", "4", "--rollout-engine", engine, *argv])


def test_embedded_engine_accepts_the_no_effect_flags_of_miles_scripts():
    cfg = parse_args(["--num-rollout", "2", "--rollout-batch-size", "4", "--rollout-engine", "embedded",
                      "--sglang-attention-backend", "fa3", "--sglang-decode-log-interval", "1000",
                      "--sglang-moe-runner-backend", "triton", "--sglang-mem-fraction-static", "0.7", "--sglang-load-format", "dummy",
                      "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "2",
                      "--sglang-chunked-prefill-size", "4096", "--sglang-cuda-graph-backend-decode", "full"])
    assert cfg.sglang.server_args["attention_backend"] == "fa3"


def test_auto_resolving_to_embedded_is_checked_the_same_way():
    from miles.config.sglang import check_embedded_engine

    cfg = parse_args(["--num-rollout", "2", "--rollout-batch-size", "4", "--sglang-enable-dp-lm-head"])
    with pytest.raises(ConfigError, match=r"^--sglang-enable-dp-lm-head: the embedded engine \(--rollout-engine auto"):
        check_embedded_engine(cfg.sglang, why="--rollout-engine auto chose it: no GPU, or SGLang not importable")
