"""Engine kind resolution and launch command lines (embedded engine and SGLang)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import pytest

from miles.config import rollout as rollout_flags
from miles.config.base import ConfigError, section_from_namespace
from miles.config.rollout import RolloutConfig
from miles.fleet import engines
from miles.fleet.engines import (
    build_engine_argv,
    engine_argv_from_config,
    engine_host,
    engine_url,
    make_api_key,
    resolve_api_key,
    resolve_engine_kind,
)
from miles.utils.optional import MissingDependencyError


def rollout_cfg(*argv: str) -> RolloutConfig:
    p = argparse.ArgumentParser()
    rollout_flags.add_arguments(p)
    return section_from_namespace(RolloutConfig, p.parse_args(list(argv)))


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """An importable package named ``sglang`` that fails if anything imports it."""
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('the trainer imported sglang')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    assert "sglang" not in sys.modules


# --- engine kind --------------------------------------------------------------------------------------
def test_kind_embedded_always_when_asked(fake_sglang):
    assert resolve_engine_kind(rollout_cfg("--rollout-engine", "embedded"), has_gpu=True) == "embedded"


def test_kind_auto_without_sglang_is_embedded():
    assert not engines.sglang_importable()  # CI has no SGLang
    assert resolve_engine_kind(rollout_cfg(), has_gpu=True) == "embedded"
    assert resolve_engine_kind(rollout_cfg(), has_gpu=False) == "embedded"


def test_kind_auto_with_sglang_needs_gpu(fake_sglang):
    assert resolve_engine_kind(rollout_cfg(), has_gpu=True) == "sglang"
    assert resolve_engine_kind(rollout_cfg(), has_gpu=False) == "embedded"


def test_kind_sglang_explicit(fake_sglang):
    assert resolve_engine_kind(rollout_cfg("--rollout-engine", "sglang"), has_gpu=True) == "sglang"


def test_kind_sglang_missing_names_the_extra():
    with pytest.raises(MissingDependencyError, match=r"pip install 'miles\[sglang\]'") as ei:
        resolve_engine_kind(rollout_cfg("--rollout-engine", "sglang"), has_gpu=True)
    assert "--rollout-engine sglang" in str(ei.value)


def test_kind_unknown_value():
    cfg = rollout_cfg()
    cfg.rollout_engine = "vllm"
    with pytest.raises(ConfigError, match="--rollout-engine 'vllm'"):
        resolve_engine_kind(cfg, has_gpu=False)


# --- addresses and keys -------------------------------------------------------------------------------
def test_engine_host_loopback_on_one_node():
    assert engine_host(1) == "127.0.0.1"


def test_engine_host_multi_node_is_routable_never_wildcard():
    assert engine_host(2, address="10.1.2.3") == "10.1.2.3"
    with pytest.raises(ConfigError, match="loopback"):
        engine_host(2, address="127.0.1.1")
    if not engines.host_address().startswith("127."):
        host = engine_host(2)
        assert host == engines.host_address() and host != "0.0.0.0"


def test_api_keys():
    a, b = make_api_key(), make_api_key()
    assert a != b and len(a) >= 40
    assert resolve_api_key(rollout_cfg(), num_nodes=1) is None
    k1, k2 = resolve_api_key(rollout_cfg(), num_nodes=2), resolve_api_key(rollout_cfg(), num_nodes=2)
    assert k1 and k2 and k1 != k2
    assert resolve_api_key(rollout_cfg("--sglang-api-key", "abc"), num_nodes=4) == "abc"


def test_engine_url_brackets_ipv6():
    assert engine_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert engine_url("::1", 8000) == "http://[::1]:8000"
    assert engine_url("node-3", 8000) == "http://node-3:8000"


# --- the embedded engine's command line ---------------------------------------------------------------
def _embedded_parser() -> argparse.ArgumentParser:
    from miles.engine.__main__ import build_parser  # the engine's own parser

    return build_parser()


def test_embedded_argv_parses_with_the_engines_own_parser(tmp_path):
    argv = build_engine_argv("embedded", hf_checkpoint=str(tmp_path), host="127.0.0.1", port=31000, api_key="k",
                             device="cpu", max_running_requests=8, max_context_len=512, dtype="float32")
    assert argv[:3] == [sys.executable, "-m", "miles.engine"]
    ns = _embedded_parser().parse_args(argv[3:])
    assert (ns.hf_checkpoint, ns.host, ns.port, ns.api_key) == (str(tmp_path), "127.0.0.1", 31000, "k")
    assert (ns.device, ns.max_running_requests, ns.max_context_len, ns.dtype) == ("cpu", 8, 512, "float32")


def test_embedded_argv_on_gpu_places_the_device(tmp_path):
    argv = build_engine_argv("embedded", hf_checkpoint=str(tmp_path), host="10.0.0.2", port=31001, device="cuda",
                             base_gpu_id=3)
    ns = _embedded_parser().parse_args(argv[3:])
    assert ns.device == "cuda:3" and ns.api_key is None


def test_embedded_rejects_tensor_parallel(tmp_path):
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine"):
        build_engine_argv("embedded", hf_checkpoint=str(tmp_path), host="127.0.0.1", port=1, num_gpus=2)


def test_argv_from_config_embedded(tmp_path):
    cfg = rollout_cfg("--engine-max-running-requests", "16", "--engine-max-context-len", "300")
    argv = engine_argv_from_config("embedded", cfg, hf_checkpoint=str(tmp_path), host="127.0.0.1", port=2000,
                                   api_key=None, num_gpus=1, base_gpu_id=0, device="cpu", colocate=False)
    ns = _embedded_parser().parse_args(argv[3:])
    assert (ns.max_running_requests, ns.max_context_len) == (16, 300)


# --- SGLang's command line ------------------------------------------------------------------------------
SPEC = json.loads(Path(rollout_flags.__file__).with_name("sglang_server_args.json").read_text())
_CONVERT = {None: str, "str": str, "nullable_str": str, "int": int, "float": float, "human_readable_int": int,
            "loads": json.loads, "json_list_type": json.loads, "parse_cuda_graph_config_arg": json.loads}


@functools.lru_cache(maxsize=1)
def _sglang_reference_parser() -> argparse.ArgumentParser:
    """SGLang 0.5.16's ServerArgs parser rebuilt from the JSON kept in the repo (SGLang is not installed here):
    the same option strings, dests, nargs, choices and kinds. Value-less deprecated flags store their own name."""
    p = argparse.ArgumentParser(exit_on_error=False, add_help=False, allow_abbrev=False)
    for a in SPEC["args"]:
        kind, flags = a["kind"], a["flags"]
        if kind == "store":
            extra = {"const": a["const"]} if a["nargs"] == "?" else {}
            p.add_argument(*flags, dest=a["dest"], type=_CONVERT[a["type"]], nargs=a["nargs"], choices=a["choices"],
                           default=a["default"], **extra)
        elif kind in ("store_true", "store_false"):
            p.add_argument(*flags, dest=a["dest"], action=kind, default=a["default"])
        elif kind == "boolean_optional":
            p.add_argument(flags[0], dest=a["dest"], action=argparse.BooleanOptionalAction, default=a["default"])
        else:
            p.add_argument(*flags, dest=a["dest"], action="store_const", const=flags[0], default=a["default"])
    return p


def _parse_sglang(argv: list[str]) -> argparse.Namespace:
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    ns, unknown = _sglang_reference_parser().parse_known_args(argv[3:])
    assert unknown == [], f"flags SGLang 0.5.16's ServerArgs does not have: {unknown}"
    return ns


def test_sglang_argv_single_node():
    argv = build_engine_argv("sglang", hf_checkpoint="/m/Qwen3-0.6B", host="10.0.0.5", port=15000, api_key="key",
                             num_gpus=2, base_gpu_id=4, device="cuda", mem_fraction_static=0.7)
    ns = _parse_sglang(argv)
    assert (ns.model_path, ns.tp_size, ns.base_gpu_id, ns.host, ns.port) == ("/m/Qwen3-0.6B", 2, 4, "10.0.0.5", 15000)
    assert (ns.api_key, ns.device, ns.mem_fraction_static) == ("key", "cuda", 0.7)
    assert ns.skip_server_warmup and not ns.enable_memory_saver and ns.nnodes == 1 and ns.dist_init_addr is None


def test_sglang_argv_colocated_uses_memory_saver():
    argv = build_engine_argv("sglang", hf_checkpoint="/m", host="127.0.0.1", port=15000, device="cuda",
                             colocate=True)
    ns = _parse_sglang(argv)
    assert ns.enable_memory_saver and ns.api_key is None


def test_sglang_argv_multi_node():
    argvs = [build_engine_argv("sglang", hf_checkpoint="/m", host=f"10.0.0.{r + 1}", port=15000, api_key="k",
                               num_gpus=16, base_gpu_id=0, device="cuda", nnodes=2, node_rank=r,
                               dist_init_addr="10.0.0.1:20000", nccl_port=20001) for r in (0, 1)]
    for rank, argv in enumerate(argvs):
        ns = _parse_sglang(argv)
        assert (ns.tp_size, ns.nnodes, ns.node_rank, ns.dist_init_addr) == (16, 2, rank, "10.0.0.1:20000")
        assert ns.nccl_port == 20001


def test_sglang_from_config_passes_only_sglang_flags():
    cfg = rollout_cfg("--sglang-mem-fraction-static", "0.6", "--engine-max-context-len", "300")
    argv = engine_argv_from_config("sglang", cfg, hf_checkpoint="/m", host="127.0.0.1", port=2000, api_key=None,
                                   num_gpus=1, base_gpu_id=0, device="cuda", colocate=True)
    ns = _parse_sglang(argv)
    assert ns.mem_fraction_static == 0.6 and ns.context_length is None and ns.max_running_requests is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(nnodes=2), "dist_init_addr"),
    (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
    (dict(num_gpus=3, nnodes=2, dist_init_addr="h:1"), "not divisible"),
    (dict(device="tpu"), "device 'tpu'"),
    (dict(port=0), "port 0"),
    (dict(num_gpus=0), "--rollout-num-gpus-per-engine 0"),
])
def test_sglang_argv_errors(kwargs, match):
    base = dict(hf_checkpoint="/m", host="127.0.0.1", port=15000, device="cuda")
    with pytest.raises(ConfigError, match=match):
        build_engine_argv("sglang", **{**base, **kwargs})


def test_unknown_kind_and_missing_model():
    with pytest.raises(ConfigError, match="engine kind 'vllm'"):
        build_engine_argv("vllm", hf_checkpoint="/m", host="h", port=1)
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        build_engine_argv("embedded", hf_checkpoint="", host="h", port=1)


# --- the user's --sglang-* flags on SGLang's command line -------------------------------------------------
MANAGED = {"host", "tp_size", "device"}  # SGLang flags miles fills in itself (a user value must agree)


def _sample(a: dict) -> tuple[list[str], object]:
    """For one JSON action: (the values a user writes after the --sglang- flag, what SGLang's parser reads back)."""
    kind, nargs, many = a["kind"], a["nargs"], a["nargs"] in ("+", "*")
    if kind in ("store_true", "store_false"):
        return [], kind == "store_true"
    if kind == "flag":
        return [], a["flags"][0]
    if kind == "boolean_optional":
        return [], False  # given as --no-sglang-<flag>
    if nargs == "?":
        return [], a["const"]
    if a["choices"]:
        c = a["choices"][-1]
        return [str(c)], [c] if many else c
    text, value = {"int": (["7", "-3"], [7, -3]), "float": (["0.25", "1.5"], [0.25, 1.5]),
                   "human_readable_int": (["2k"], [2000]), "loads": (['{"a": [1, "x y"]}'], [{"a": [1, "x y"]}]),
                   "json_list_type": (["[1, 2]"], [[1, 2]]),
                   "parse_cuda_graph_config_arg": (['{"decode": {"max_bs": 8}}'], [{"decode": {"max_bs": 8}}])}.get(
        a["type"], (["abc", "x y"], ["abc", "x y"]))
    return (text, value) if many else (text[:1], value[0])


def _exposed_actions() -> list[dict]:
    from miles.config.sglang import DEFINED_ELSEWHERE, SET_BY_MILES

    return [a for a in SPEC["args"] if a["dest"] not in SET_BY_MILES and a["dest"] not in DEFINED_ELSEWHERE]


def test_every_sglang_flag_reaches_sglangs_command_line_as_its_parser_reads_it():
    from miles.config import SGLangConfig, build_parser
    from miles.config.base import section_from_namespace

    parser, checked = build_parser(), 0
    for a in _exposed_actions():
        if a["dest"] in MANAGED:
            continue
        values, expected = _sample(a)
        flag = ("--no-sglang-" if a["kind"] == "boolean_optional" else "--sglang-") + a["flags"][0][2:]
        sglang = section_from_namespace(SGLangConfig, parser.parse_args(["--hf-checkpoint", "/m", flag, *values]))
        argv = build_engine_argv("sglang", hf_checkpoint="/m", host="127.0.0.1", port=15000, device="cuda",
                                 server_args=sglang.server_args)
        ns = _parse_sglang(argv)
        assert getattr(ns, a["dest"]) == expected, (flag, values, argv[-4:])
        assert ns.model_path == "/m" and ns.port == 15000 and ns.skip_server_warmup  # miles's own flags intact
        checked += 1
    assert checked > 400, checked


def test_chunked_prefill_and_lists_and_bare_flags():
    from miles.config import parse_args

    cfg = parse_args(["--hf-checkpoint", "/m", "--sglang-chunked-prefill-size", "4096", "--sglang-cuda-graph-bs", "1", "2",
                      "4", "--sglang-enable-deterministic-inference", "--sglang-dp-size", "2",
                      "--sglang-mem-fraction-static", "0.7"], validate=False)
    assert cfg.sglang.server_args == {"chunked_prefill_size": 4096, "cuda_graph_bs": [1, 2, 4],
                                      "enable_deterministic_inference": True, "dp_size": 2}
    assert cfg.rollout.sglang_mem_fraction_static == 0.7  # the rollout section's flag keeps its definition
    argv = engine_argv_from_config("sglang", cfg.rollout, sglang=cfg.sglang, hf_checkpoint="/m", host="127.0.0.1",
                                   port=2000, api_key=None, num_gpus=2, base_gpu_id=0, device="cuda", colocate=False)
    tail = argv[argv.index("--skip-server-warmup") + 1:]
    assert tail == ["--chunked-prefill-size", "4096", "--cuda-graph-bs", "1", "2", "4",
                    "--enable-deterministic-inference", "--dp-size", "2"]
    ns = _parse_sglang(argv)
    assert (ns.chunked_prefill_size, ns.cuda_graph_bs_decode, ns.dp_size, ns.tp_size) == (4096, [1, 2, 4], 2, 2)
    assert ns.enable_deterministic_inference and ns.mem_fraction_static == 0.7 and ns.trust_remote_code


def test_values_that_look_like_flags():
    from miles.config import parse_args

    cfg = parse_args(["--hf-checkpoint", "/m", "--sglang-chunked-prefill-size", "-1", "--sglang-chat-template=-odd"],
                     validate=False)
    argv = build_engine_argv("sglang", hf_checkpoint="/m", host="127.0.0.1", port=15000, device="cuda",
                             server_args=cfg.sglang.server_args)
    assert "--chunked-prefill-size=-1" in argv and "--chat-template=-odd" in argv
    ns = _parse_sglang(argv)
    assert ns.chunked_prefill_size == -1 and ns.chat_template == "-odd"


def test_flags_miles_fills_in_must_agree():
    base = dict(hf_checkpoint="/m", host="10.0.0.5", port=15000, num_gpus=2, device="cuda")
    argv = build_engine_argv("sglang", **base, server_args={"tp_size": 2, "host": "10.0.0.5"})
    assert argv.count("--tp-size") == 1 and argv.count("--host") == 1 and _parse_sglang(argv).tp_size == 2
    with pytest.raises(ConfigError, match=r"--sglang-tp-size 4 disagrees with --rollout-num-gpus-per-engine \(2\)"):
        build_engine_argv("sglang", **base, server_args={"tp_size": 4})
    with pytest.raises(ConfigError, match="--sglang-host 0.0.0.0 disagrees"):
        build_engine_argv("sglang", **base, server_args={"host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="--sglang-no-such-flag is not an SGLang server flag"):
        build_engine_argv("sglang", **base, server_args={"no_such_flag": 1})


# --- the embedded engine honours what means something to it ----------------------------------------------
EMBEDDED_FLAGS = ["--sglang-max-running-requests", "8", "--sglang-context-length", "256",
                  "--sglang-chunked-prefill-size", "512", "--sglang-max-prefill-tokens", "1024",
                  "--sglang-max-total-tokens", "768", "--sglang-cuda-graph-bs", "1", "2", "8",
                  "--sglang-cuda-graph-max-bs", "2", "--sglang-dtype", "float", "--sglang-max-queued-requests", "100",
                  "--sglang-weight-version", "v3", "--sglang-attention-backend", "triton",
                  "--sglang-mem-fraction-static", "0.5"]


def _embedded_from_flags(tmp_path, *flags: str) -> list[str]:
    from miles.config import parse_args

    cfg = parse_args(["--hf-checkpoint", str(tmp_path), *flags], validate=False)
    return engine_argv_from_config("embedded", cfg.rollout, sglang=cfg.sglang, hf_checkpoint=str(tmp_path),
                                   host="127.0.0.1", port=2000, api_key=None, num_gpus=1, base_gpu_id=0, device="cpu",
                                   colocate=False)


def test_embedded_maps_sglang_flags_to_its_own_options(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="miles"):
        argv = _embedded_from_flags(tmp_path, *EMBEDDED_FLAGS)
        _embedded_from_flags(tmp_path, *EMBEDDED_FLAGS)
    from miles.engine.__main__ import parse_args as engine_parse_args

    ns = engine_parse_args(argv[3:])
    assert (ns.max_running_requests, ns.max_context_len, ns.max_total_tokens) == (8, 256, 768)
    assert ns.max_prefill_tokens == 512  # a prefill forward takes at most --chunked-prefill-size tokens
    assert (ns.cuda_graph_bs, ns.cuda_graph_max_bs, ns.dtype) == ([1, 2, 8], 2, "float32")
    assert (ns.max_queued_requests, ns.max_samples_per_request, ns.weight_version) == (100, 100, "v3")
    assert not ns.disable_cuda_graph and argv.count("--max-running-requests") == 1  # --engine-max-running-requests not passed
    assert not ns.enable_deterministic_inference
    argv = _embedded_from_flags(tmp_path, "--sglang-enable-deterministic-inference")
    assert engine_parse_args(argv[3:]).enable_deterministic_inference   # batch-invariant outputs, as SGLang's
    ignored = [r.getMessage() for r in caplog.records if "embedded engine ignores" in r.getMessage()]
    assert len(ignored) == 1 and "\n" not in ignored[0], ignored  # said once, in one line
    listed = ignored[0].split("ignores these SGLang-only flags: ", 1)[1].split(" (it honours", 1)[0]
    assert listed.split(", ") == ["--sglang-mem-fraction-static", "--sglang-attention-backend"]


def test_embedded_disable_cuda_graph_and_context_conflict(tmp_path):
    from miles.engine.__main__ import parse_args as engine_parse_args

    for flags in (["--sglang-disable-cuda-graph"], ["--sglang-cuda-graph-backend-decode", "disabled"]):
        assert engine_parse_args(_embedded_from_flags(tmp_path, *flags)[3:]).disable_cuda_graph
    ns = engine_parse_args(_embedded_from_flags(tmp_path, "--sglang-disable-overlap-schedule")[3:])
    assert ns.disable_overlap_schedule and not ns.enable_overlap_schedule
    assert not engine_parse_args(_embedded_from_flags(tmp_path)[3:]).disable_overlap_schedule
    no_chunking = _embedded_from_flags(tmp_path, "--sglang-chunked-prefill-size", "-1")  # SGLang: no chunked prefill
    assert "--max-prefill-tokens" not in no_chunking and engine_parse_args(no_chunking[3:]).max_prefill_tokens == 16384
    with pytest.raises(ConfigError, match="--engine-max-context-len 300 disagrees with --sglang-context-length 256"):
        _embedded_from_flags(tmp_path, "--engine-max-context-len", "300", "--sglang-context-length", "256")
    ns = engine_parse_args(_embedded_from_flags(tmp_path, "--engine-max-context-len", "256", "--sglang-context-length",
                                                "256")[3:])
    assert ns.max_context_len == 256
    with pytest.raises(ConfigError, match="--sglang-tp-size 2 disagrees"):
        _embedded_from_flags(tmp_path, "--sglang-tp-size", "2")


def test_embedded_engine_serves_with_the_mapped_values(tiny_model_dir, tmp_path):
    """The real engine, started from the command line built here: /get_server_info reports the values."""
    import subprocess
    import time

    import requests

    from miles.utils.net import find_free_port

    port = find_free_port()
    from miles.config import parse_args

    cfg = parse_args(["--hf-checkpoint", str(tiny_model_dir), *EMBEDDED_FLAGS], validate=False)
    argv = engine_argv_from_config("embedded", cfg.rollout, sglang=cfg.sglang, hf_checkpoint=str(tiny_model_dir),
                                   host="127.0.0.1", port=port, api_key=None, num_gpus=1, base_gpu_id=0, device="cpu",
                                   colocate=False)
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, info = time.monotonic() + 180, None
        while info is None:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, f"engine did not come up in 180 s: {log.read_text()[-2000:]}"
            try:
                info = requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=5).json()
            except requests.RequestException:
                time.sleep(0.2)
        assert info["context_length"] == 256
        assert info["max_running_requests"] == 3  # --sglang-max-total-tokens 768 / 256 tokens per request caps 8
        assert info["max_prefill_tokens"] == 512 and info["dtype"] == "float32" and info["weight_version"] == "v3"
        assert info["cuda_graph_bs"] == [1, 2] and info["cuda_graph_max_bs"] == 2  # capped by 2 and by the 3 slots
        assert info["max_queued_requests"] == 100
        r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                          json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, (r.text, log.read_text()[-2000:])
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_honoured_flags_are_sglang_flags_and_documented():
    from miles.config.sglang import flag_docs, flag_of, load_spec

    text = " ".join(flag_docs())
    rollout_doc = (Path(__file__).resolve().parents[3] / "docs" / "rollout.md").read_text()
    for name in engines.EMBEDDED_EQUIVALENTS:
        assert name in load_spec(), name
        short = flag_of(name).removesuffix("-decode")
        assert short in text and short in rollout_doc, short


def test_graph_batch_sizes_and_max_total_tokens_in_the_engine(tiny_model_dir):
    import torch

    from miles.engine.model_runner import ModelRunner, RunnerOptions, graph_batch_sizes

    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]  # the default buckets
    assert graph_batch_sizes(100, max_bs=20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(6, sizes=[8, 1, 4, 4]) == [1, 4]  # never above the slots
    runner = ModelRunner(tiny_model_dir, RunnerOptions(max_running_requests=8, max_context_len=64, max_total_tokens=200,
                                                       cuda_graph_bs=[1, 2]))
    assert runner.max_slots == 3 and runner.graph_batch_sizes == [1, 2]  # 200 // 64 slots
    impl = runner.impl
    impl.use_graphs = True  # as on a GPU: a batch of 3 is larger than every captured size, so it runs eagerly
    impl._capture = lambda bs, L: pytest.fail(f"captured a graph for batch {bs}")
    runner.prefill(0, [[5, 6], [7, 8], [9, 10]], [False] * 3)
    tokens, positions = torch.tensor([11, 12, 13]), torch.tensor([2, 2, 2])
    logits = runner.decode(tokens, positions, 3)
    impl.use_graphs = False
    assert logits.shape[0] == 3
    with pytest.raises(ValueError, match="--max-total-tokens 32 is less than one request's context"):
        ModelRunner(tiny_model_dir, RunnerOptions(max_context_len=64, max_total_tokens=32))


def test_the_embedded_engine_on_cpu_picks_its_threads_under_the_plan_only():
    """--pick-cpu-threads: the embedded engine on CPU with the launcher's share of the cores; not SGLang, not on a
    GPU, not when the user's OMP_NUM_THREADS fixes the count (threads None)."""
    from miles.fleet.engines import cpu_threads_server_flags

    assert cpu_threads_server_flags("embedded", "cpu", 2) == ["--pick-cpu-threads"]
    assert cpu_threads_server_flags("embedded", "cpu", None) == []
    assert cpu_threads_server_flags("embedded", "cuda", 2) == []
    assert cpu_threads_server_flags("sglang", "cpu", 2) == []


def test_embedded_maps_the_sglang_lora_flags(tmp_path):
    """The SGLang LoRA serving flags the embedded engine honours reach its own options (miles.engine.lora); the
    kernel choices (and ``--sglang-lora-use-virtual-experts``, SGLang's MoE-LoRA kernel path) are accepted as changing
    nothing there; ``--sglang-experts-shared-outer-loras`` reaches the engine's option (miles.engine.lora_experts)."""
    from miles.config import ConfigError, parse_args
    from miles.engine.__main__ import parse_args as engine_parse_args

    argv = _embedded_from_flags(tmp_path, "--sglang-enable-lora", "--sglang-max-lora-rank", "16",
                                "--sglang-max-loaded-loras", "3", "--sglang-lora-target-modules", "q_proj", "v_proj",
                                "--sglang-lora-paths", "a=/x", "--sglang-lora-backend", "triton",
                                "--sglang-max-loras-per-batch", "2")
    ns = engine_parse_args(argv[3:])
    assert ns.enable_lora and (ns.max_lora_rank, ns.max_loaded_loras) == (16, 3)
    assert ns.lora_target_modules == ["q_proj", "v_proj"] and ns.lora_paths == ["a=/x"]
    base = ["--num-rollout", "2", "--rollout-batch-size", "4", "--rollout-engine", "embedded"]
    parse_args(base + ["--sglang-enable-lora", "--sglang-lora-backend", "triton", "--sglang-max-lora-rank", "16"])
    parse_args(base + ["--sglang-enable-lora", "--sglang-lora-use-virtual-experts"])
    argv = _embedded_from_flags(tmp_path, "--sglang-enable-lora", "--sglang-experts-shared-outer-loras",
                                "--sglang-lora-use-virtual-experts")
    ns = engine_parse_args(argv[3:])
    assert ns.enable_lora and ns.experts_shared_outer_loras
    assert not engine_parse_args(_embedded_from_flags(tmp_path, "--sglang-enable-lora")[3:]).experts_shared_outer_loras
    with pytest.raises(ConfigError, match=r"^--sglang-enable-metrics: the embedded engine "
                                          r"\(--rollout-engine embedded\) has no such setting"):
        parse_args(base + ["--sglang-enable-metrics"])
