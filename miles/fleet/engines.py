"""Engine launch commands: which engine serves rollouts, and the exact command line that starts it.

Two engines speak the same HTTP protocol (SGLang's, see ``docs/engine-protocol.md``):

- ``sglang``: ``python -m sglang.launch_server`` (GPU clusters). SGLang is never imported here; we only
  check that it is importable (``importlib.util.find_spec``) and build its command line.
- ``embedded``: ``python -m miles.engine``, our own HF-transformers engine (CPU, CI, GPU boxes without
  SGLang).

The ``--sglang-<flag>`` flags the user gave (``miles.config.sglang``, SGLang's ``ServerArgs`` kept as data) go
to SGLang's command line as SGLang's parser reads them; the embedded engine maps those that mean something
to it (``EMBEDDED_EQUIVALENTS``) and logs once, in one line, the ones it ignores.

The engine supervisor (``miles.spmd.supervisor``) runs the argv built here as a child process.
Engines listen on loopback when the whole job is on one node, else on this host's routable address,
never on every interface unless asked; multi-node jobs protect them with a per-run API key.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from miles.config.base import ConfigError
from miles.config.rollout import RolloutConfig
from miles.config.sglang import SGLangConfig, flag_of, load_spec, server_args_cli
from miles.utils.logging import get_logger, warn_once
from miles.utils.net import host_address
from miles.utils.optional import MissingDependencyError

logger = get_logger(__name__)

ENGINE_KINDS = ("embedded", "sglang")
LOOPBACK = "127.0.0.1"
SGLANG_INSTALL_HINT = "pip install 'miles[sglang]'"


def sglang_importable() -> bool:
    """True when ``import sglang`` would find the package (without importing it)."""
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


def resolve_engine_kind(rollout: RolloutConfig, has_gpu: bool) -> str:
    """``"sglang"`` or ``"embedded"`` from ``--rollout-engine`` (auto|embedded|sglang).

    auto picks SGLang when it is importable and a GPU is present, else the embedded engine.
    Asking for SGLang explicitly when it is not installed is an error naming the pip extra.
    """
    choice = rollout.rollout_engine
    if choice == "embedded":
        return "embedded"
    if choice == "sglang":
        if not sglang_importable():
            raise MissingDependencyError(
                "--rollout-engine sglang was given but the Python package 'sglang' is not importable. "
                f"Install it on the engine nodes with: {SGLANG_INSTALL_HINT} (GPU only), "
                "or use --rollout-engine embedded (or auto).")
        if not has_gpu:
            warn_once(logger, "--rollout-engine sglang on a node without a CUDA GPU: SGLang's CPU backend is "
                              "experimental; --rollout-engine embedded is the tested CPU path.")
        return "sglang"
    if choice == "auto":
        kind = "sglang" if (has_gpu and sglang_importable()) else "embedded"
        logger.info("--rollout-engine auto -> %s (gpu=%s, sglang importable=%s)", kind, has_gpu, sglang_importable())
        return kind
    raise ConfigError(f"--rollout-engine {choice!r} is not one of auto, embedded, sglang.")


def engine_host(num_nodes: int, address: str | None = None) -> str:
    """The address an engine on this node listens on.

    Loopback when the whole job runs on one node (nothing else needs to reach it); otherwise this
    host's address as other nodes see it (``address`` if given, else ``miles.utils.net.host_address``).
    Never ``0.0.0.0``: pass it as ``address`` explicitly to listen on every interface.
    """
    if num_nodes < 1:
        raise ValueError(f"engine_host: num_nodes must be >= 1, got {num_nodes}")
    if num_nodes == 1:
        return address if address is not None else LOOPBACK
    addr = address or host_address()
    if addr.startswith("127.") or addr == "::1":
        raise ConfigError(
            f"this job spans {num_nodes} nodes but this host's address resolves to loopback ({addr}); other "
            "nodes could not reach its engines. Fix the host's name resolution or set --master-addr / the "
            "launcher's address so that `hostname` resolves to a routable IP.")
    return addr


def make_api_key() -> str:
    """A fresh random API key (URL-safe, 256 bits) for one run's engines, router and client."""
    return secrets.token_urlsafe(32)


def resolve_api_key(rollout: RolloutConfig, num_nodes: int) -> str | None:
    """``--sglang-api-key`` if given; a fresh key for multi-node jobs; None (no key) on one node.

    The driver calls this once and hands the key to every engine, the router and the client.
    """
    if rollout.sglang_api_key:
        return rollout.sglang_api_key
    if num_nodes > 1:
        logger.info("multi-node job without --sglang-api-key: generated a per-run engine API key")
        return make_api_key()
    return None


def engine_url(host: str, port: int) -> str:
    """``http://host:port`` (IPv6 hosts in brackets)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"http://{host}:{port}"


def build_engine_argv(
    kind: str,
    *,
    hf_checkpoint: str,
    host: str,
    port: int,
    api_key: str | None = None,
    num_gpus: int = 1,
    base_gpu_id: int = 0,
    device: str = "cpu",
    colocate: bool = False,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    mem_fraction_static: float | None = None,
    max_running_requests: int | None = None,
    max_context_len: int | None = None,
    dtype: str | None = None,
    nccl_port: int | None = None,
    server_args: Mapping[str, Any] | None = None,
    python: str = sys.executable,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line that starts one engine (one node's share of it for a multi-node engine).

    ``server_args``: the user's ``--sglang-<flag>`` values (``SGLangConfig.sglang_server_args``), passed to
    SGLang as given; for the embedded engine, mapped to its own options where they mean the same.

    ``num_gpus`` is the engine's tensor-parallel size (``--rollout-num-gpus-per-engine``); a multi-node
    SGLang engine runs this on each of its ``nnodes`` nodes with its own ``node_rank`` and a common
    ``dist_init_addr`` (host:port of node 0). ``colocate`` turns on SGLang's memory saver so the engine
    can release its GPU memory while the trainer runs.
    """
    if kind not in ENGINE_KINDS:
        raise ConfigError(f"engine kind {kind!r} is not one of {', '.join(ENGINE_KINDS)} (--rollout-engine).")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"engine device {device!r} is not 'cpu' or 'cuda' (--device).")
    if not hf_checkpoint:
        raise ConfigError("the engine needs a model: set --hf-checkpoint to a local HF model directory.")
    if not (0 < port < 65536):
        raise ConfigError(f"engine port {port} is out of range 1..65535.")
    if num_gpus < 1:
        raise ConfigError(f"--rollout-num-gpus-per-engine {num_gpus} must be >= 1.")
    if base_gpu_id < 0:
        raise ConfigError(f"engine base GPU id {base_gpu_id} must be >= 0.")
    if nnodes < 1 or not (0 <= node_rank < nnodes):
        raise ConfigError(f"engine node_rank {node_rank} must be in [0, nnodes={nnodes}).")
    if nnodes > 1 and not dist_init_addr:
        raise ConfigError(f"a multi-node engine (nnodes={nnodes}) needs dist_init_addr (host:port of its node 0).")
    user = _user_server_args(server_args, {
        "tp_size": (num_gpus, "--rollout-num-gpus-per-engine"),
        "host": (host, "the engine address miles picks (loopback on one node, else this node's address)"),
        "device": (device, "this rank's device"),
        "max_running_requests": (max_running_requests, "max_running_requests"),
        "context_length": (max_context_len, "max_context_len"), "dtype": (dtype, "dtype")})
    if kind == "embedded":
        return _embedded_argv(
            hf_checkpoint=hf_checkpoint, host=host, port=port, api_key=api_key, num_gpus=num_gpus,
            base_gpu_id=base_gpu_id, device=device, nnodes=nnodes, mem_fraction_static=mem_fraction_static,
            max_running_requests=max_running_requests, max_context_len=max_context_len, dtype=dtype,
            server_args=user, python=python, extra=extra)
    return _sglang_argv(
        hf_checkpoint=hf_checkpoint, host=host, port=port, api_key=api_key, num_gpus=num_gpus,
        base_gpu_id=base_gpu_id, device=device, colocate=colocate, nnodes=nnodes, node_rank=node_rank,
        dist_init_addr=dist_init_addr, mem_fraction_static=mem_fraction_static,
        max_running_requests=max_running_requests, max_context_len=max_context_len, dtype=dtype,
        nccl_port=nccl_port, server_args=user, python=python, extra=extra)


def _user_server_args(server_args: Mapping[str, Any] | None, fixed: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """The user's ServerArgs flags less those miles fills in itself (``fixed``: name -> (value or None, source));
    a user value that differs from miles's is a ConfigError naming both."""
    user = dict(server_args or {})
    unknown = [n for n in user if n not in load_spec()]
    if unknown:
        raise ConfigError(f"{flag_of(unknown[0])} is not an SGLang server flag (sglang_server_args.json); "
                          "see docs/flags.md for the --sglang-* flags miles forwards.")
    for name, (value, source) in fixed.items():
        if value is not None and name in user and user[name] != value:
            raise ConfigError(f"{flag_of(name)} {user[name]} disagrees with {source} ({value}): "
                              f"drop {flag_of(name)} or make them equal.")
        if value is not None:
            user.pop(name, None)
    return user


# SGLang ServerArgs flag -> the embedded engine's option with the same meaning (values converted by
# _embedded_options). Every other --sglang-* flag configures SGLang only and is ignored by the embedded engine.
EMBEDDED_EQUIVALENTS: dict[str, str] = {
    "max_running_requests": "--max-running-requests",
    "context_length": "--max-context-len",
    "dtype": "--dtype",
    "max_prefill_tokens": "--max-prefill-tokens",
    "chunked_prefill_size": "--max-prefill-tokens",  # tokens per prefill forward (the engine never splits a prompt)
    "max_total_tokens": "--max-total-tokens",
    "cuda_graph_bs": "--cuda-graph-bs",
    "cuda_graph_bs_decode": "--cuda-graph-bs",
    "cuda_graph_max_bs": "--cuda-graph-max-bs",
    "cuda_graph_max_bs_decode": "--cuda-graph-max-bs",
    "disable_cuda_graph": "--disable-cuda-graph",
    "cuda_graph_backend_decode": "--disable-cuda-graph",  # 'disabled'; 'full' is what the engine does anyway
    "disable_overlap_schedule": "--disable-overlap-schedule",
    "max_queued_requests": "--max-queued-requests",
    "log_level": "--log-level",
    "weight_version": "--weight-version",
    "enable_deterministic_inference": "--enable-deterministic-inference",  # batch-invariant outputs, as SGLang's
    "enable_lora": "--enable-lora",            # LoRA adapters (miles.engine.lora)
    "max_lora_rank": "--max-lora-rank",
    "max_loaded_loras": "--max-loaded-loras",
    "lora_target_modules": "--lora-target-modules",
    "lora_paths": "--lora-paths",
    "experts_shared_outer_loras": "--experts-shared-outer-loras",   # MoE experts' shared outer LoRA factors
}
_EMBEDDED_DTYPES = {"half": "float16", "float": "float32"}  # SGLang's spellings -> the engine's


def _embedded_options(user: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the engine's own options for the mapped --sglang-* flags, the given flags it ignores)."""
    argv: list[str] = []
    ignored = [flag_of(n) for n in user if n not in EMBEDDED_EQUIVALENTS]
    for name, opt in (("max_running_requests", "--max-running-requests"), ("context_length", "--max-context-len"),
                      ("max_total_tokens", "--max-total-tokens"), ("max_queued_requests", "--max-queued-requests"),
                      ("log_level", "--log-level"), ("weight_version", "--weight-version")):
        if name in user:
            argv += [opt, str(user[name])]
    if "dtype" in user:
        argv += ["--dtype", _EMBEDDED_DTYPES.get(user["dtype"], user["dtype"])]
    # SGLang: a prefill forward takes at most chunked_prefill_size tokens (-1: no chunking) of max_prefill_tokens
    budgets = [user[n] for n in ("max_prefill_tokens", "chunked_prefill_size") if n in user and user[n] > 0]
    if budgets:
        argv += ["--max-prefill-tokens", str(min(budgets))]
    graph_bs = user.get("cuda_graph_bs_decode", user.get("cuda_graph_bs"))
    if graph_bs is not None:
        argv += ["--cuda-graph-bs", *(str(b) for b in graph_bs)]
    graph_max = user.get("cuda_graph_max_bs_decode", user.get("cuda_graph_max_bs"))
    if graph_max is not None:
        argv += ["--cuda-graph-max-bs", str(graph_max)]
    backend = user.get("cuda_graph_backend_decode")
    if backend not in (None, "disabled", "full"):
        ignored.append(f"{flag_of('cuda_graph_backend_decode')} {backend}")
    if user.get("disable_cuda_graph") or backend == "disabled":
        argv.append("--disable-cuda-graph")
    if user.get("disable_overlap_schedule"):
        argv.append("--disable-overlap-schedule")
    if user.get("enable_deterministic_inference"):
        argv.append("--enable-deterministic-inference")
    if user.get("enable_lora"):
        argv.append("--enable-lora")
    if user.get("experts_shared_outer_loras"):       # --sglang-no-experts-shared-outer-loras: per-expert, the default
        argv.append("--experts-shared-outer-loras")
    for name in ("max_lora_rank", "max_loaded_loras"):
        if user.get(name) is not None:
            argv += [EMBEDDED_EQUIVALENTS[name], str(user[name])]
    for name in ("lora_target_modules", "lora_paths"):
        if user.get(name):
            argv += [EMBEDDED_EQUIVALENTS[name], *(str(v) for v in user[name])]
    return argv, ignored


def _embedded_argv(*, hf_checkpoint, host, port, api_key, num_gpus, base_gpu_id, device, nnodes,
                   mem_fraction_static, max_running_requests, max_context_len, dtype, server_args,
                   python, extra) -> list[str]:
    if num_gpus != 1 or nnodes != 1:
        raise ConfigError(
            f"the embedded engine runs on one device, but --rollout-num-gpus-per-engine is {num_gpus} "
            f"(nodes per engine: {nnodes}). Use --rollout-num-gpus-per-engine 1, or --rollout-engine sglang "
            "for tensor-parallel engines.")
    mapped, ignored = _embedded_options(server_args)
    if mem_fraction_static is not None:  # its KV cache is sized by max running requests x context length
        ignored.insert(0, "--sglang-mem-fraction-static")
    if ignored:
        warn_once(logger, f"the embedded engine ignores these SGLang-only flags: {', '.join(ignored)} "
                          f"(it honours {', '.join(sorted({flag_of(n) for n in EMBEDDED_EQUIVALENTS}))})")
    dev = f"cuda:{base_gpu_id}" if device == "cuda" else "cpu"
    argv = [python, "-m", "miles.engine", "--hf-checkpoint", str(hf_checkpoint), "--host", host, "--port", str(port),
            "--device", dev]
    if api_key:
        argv += ["--api-key", api_key]
    if dtype:
        argv += ["--dtype", dtype]
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
    if max_context_len is not None:
        argv += ["--max-context-len", str(max_context_len)]
    return argv + mapped + list(extra)


def _sglang_argv(*, hf_checkpoint, host, port, api_key, num_gpus, base_gpu_id, device, colocate, nnodes, node_rank,
                 dist_init_addr, mem_fraction_static, max_running_requests, max_context_len, dtype, nccl_port,
                 server_args, python, extra) -> list[str]:
    # Flag names are SGLang's ServerArgs (docs/advanced_features/server_arguments.md).
    if num_gpus % nnodes != 0:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {num_gpus} is not divisible by the engine's {nnodes} nodes; "
            "a multi-node SGLang engine uses the same number of GPUs on every node.")
    argv = [python, "-m", "sglang.launch_server",
            "--model-path", str(hf_checkpoint),
            "--tp-size", str(num_gpus),
            "--base-gpu-id", str(base_gpu_id),
            "--host", host, "--port", str(port),
            "--device", device,
            "--trust-remote-code"]  # as Miles: checkpoints with their own modeling code load
    if api_key:
        argv += ["--api-key", api_key]
    if colocate:
        argv.append("--enable-memory-saver")
    if nnodes > 1:
        argv += ["--dist-init-addr", dist_init_addr, "--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(mem_fraction_static)]
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
    if max_context_len is not None:
        argv += ["--context-length", str(max_context_len)]
    if dtype:
        argv += ["--dtype", dtype]
    argv.append("--skip-server-warmup")
    return argv + server_args_cli(server_args) + list(extra)


def cpu_threads_server_flags(kind: str, device: str, threads: int | None) -> list[str]:
    """The embedded engine on CPU under the launcher's share of the cores (``threads``, miles.spmd.threads): that
    share is an upper bound, the engine keeps the faster of it and one thread (``--pick-cpu-threads``; a tiny
    model decodes faster on one). None: the user's OMP_NUM_THREADS fixes the count."""
    return ["--pick-cpu-threads"] if kind != "sglang" and device == "cpu" and threads is not None else []


def replay_server_flags(kind: str, algo: Any) -> list[str]:
    """Server flags routing replay needs: SGLang returns routed experts only when started with
    ``--enable-return-routed-experts`` (Miles sets it with --use-rollout-routing-replay); the embedded engine
    records them for every MoE model and needs none."""
    if kind == "sglang" and getattr(algo, "use_rollout_routing_replay", False):
        return ["--enable-return-routed-experts"]
    return []


def weight_backup_server_flags(kind: str, weights: Any) -> list[str]:
    """``--lora-base-cpu-backup`` (as Miles): SGLang engines keep their weights in host memory across
    ``release_memory_occupation`` (``--enable-weights-cpu-backup``), since the syncs after the first no longer re-send
    the frozen ones; the embedded engine always keeps a host copy of released weights and needs none."""
    if kind == "sglang" and weights.lora_base_cpu_backup:
        return ["--enable-weights-cpu-backup"]
    return []


def chat_template_server_flags(kind: str, data: Any, server_args: Mapping[str, Any] | None) -> list[str]:
    """``--chat-template-path`` (as Miles, which sets ``--sglang-chat-template`` to it): SGLang engines template their
    ``/v1/chat/completions`` requests with the same file, unless ``--sglang-chat-template`` already gives it (the
    config refuses a different one). The embedded engine serves no chat endpoint and needs none."""
    path = getattr(data, "chat_template_path", None)
    if kind == "sglang" and path and "chat_template" not in (server_args or {}):
        return ["--chat-template", str(path)]
    return []


def model_server_flags(kind: str, megatron: Any) -> list[str]:
    """Engine flags that make the engines compute the model as the trainer does: with Miles's
    ``--no-activation-func-clamp-shared-expert`` the embedded engine serves the shared experts unclamped too. SGLang
    gets nothing (as from Miles): its own DeepSeek-V4 model decides how its shared experts clamp."""
    if kind == "embedded" and getattr(megatron, "no_activation_func_clamp_shared_expert", False):
        return ["--no-activation-func-clamp-shared-expert"]
    return []


def engine_argv_from_config(
    kind: str,
    rollout: RolloutConfig,
    *,
    hf_checkpoint: str,
    host: str,
    port: int,
    api_key: str | None,
    num_gpus: int,
    base_gpu_id: int,
    device: str,
    colocate: bool,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    sglang: SGLangConfig | None = None,
    python: str = sys.executable,
    extra: Sequence[str] = (),
) -> list[str]:
    """``build_engine_argv`` with the rollout section's engine flags and the user's ``--sglang-*`` flags filled in.

    For the embedded engine ``--sglang-max-running-requests`` / ``--sglang-context-length``, when given, are what
    it uses (``--engine-max-running-requests`` is then not passed); ``--engine-max-context-len`` and
    ``--sglang-context-length`` given together must agree.
    """
    user = sglang.server_args if sglang is not None else {}
    max_running = max_ctx = None
    if kind == "embedded":
        max_running = None if "max_running_requests" in user else rollout.engine_max_running_requests
        max_ctx = rollout.engine_max_context_len
        if max_ctx is not None and user.get("context_length", max_ctx) != max_ctx:
            raise ConfigError(f"--engine-max-context-len {max_ctx} disagrees with --sglang-context-length "
                              f"{user['context_length']}: give one of them.")
        if "context_length" in user:
            max_ctx = None
    return build_engine_argv(
        kind, hf_checkpoint=hf_checkpoint, host=host, port=port, api_key=api_key, num_gpus=num_gpus,
        base_gpu_id=base_gpu_id, device=device, colocate=colocate, nnodes=nnodes, node_rank=node_rank,
        dist_init_addr=dist_init_addr, mem_fraction_static=rollout.sglang_mem_fraction_static,
        max_running_requests=max_running, max_context_len=max_ctx, server_args=user, python=python, extra=extra)
