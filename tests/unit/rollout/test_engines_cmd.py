"""Engine kind resolution and launch command lines (embedded engine and SGLang)."""

from __future__ import annotations

import argparse
import sys

import pytest

from miles.config import rollout as rollout_flags
from miles.config.base import ConfigError, section_from_namespace
from miles.config.rollout import RolloutConfig
from miles.rollout import engines
from miles.rollout.engines import (
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
def _sglang_reference_parser() -> argparse.ArgumentParser:
    """The SGLang ServerArgs flags we emit, with their documented spellings and aliases
    (docs/advanced_features/server_arguments.md of sglang); SGLang itself is not installed here."""
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--tensor-parallel-size", "--tp-size", dest="tp_size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--dist-init-addr", "--nccl-init-addr", default=None)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--nccl-port", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--skip-server-warmup", action="store_true")
    return p


def _parse_sglang(argv: list[str]) -> argparse.Namespace:
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    ns, unknown = _sglang_reference_parser().parse_known_args(argv[3:])
    assert unknown == [], f"flags SGLang does not document: {unknown}"
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
