"""``python -m miles.engine --hf-checkpoint DIR --port P``: the embedded engine as a standalone server.

Speaks SGLang's HTTP protocol (docs/engine-protocol.md). Listens on ``--host`` only (default
127.0.0.1; never every interface unless asked). SIGTERM/SIGINT stop it gracefully; whatever it is doing,
the process exits at most ``SHUTDOWN_DEADLINE_S`` seconds after the signal.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading

from miles.utils.logging import configure_logging, get_logger

logger = get_logger("miles.engine")

SHUTDOWN_DEADLINE_S = 3.0
DEFAULT_MAX_SAMPLES_PER_REQUEST = 4096
SWITCH_INTERVAL = 0.0005  # seconds (sys.setswitchinterval; CPython default 0.005); see main()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m miles.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", "--model-path", dest="hf_checkpoint", required=True, help="Local HF model directory.")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default loopback only).")
    p.add_argument("--port", type=int, default=30000, help="Port to listen on.")
    p.add_argument("--api-key", default=os.environ.get("MILES_ENGINE_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' (as sglang --api-key); env MILES_ENGINE_API_KEY.")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N.")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's dtype on GPU, float32 on CPU.")
    p.add_argument("--max-running-requests", type=int, default=64, help="KV slots (requests decoded together); more queue.")
    p.add_argument("--max-context-len", "--context-length", dest="max_context_len", type=int, default=None,
                   help="Tokens per KV slot (prompt + response); default min(max_position_embeddings, 4096).")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="Padded tokens per prefill batch.")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache tokens in all (as sglang): caps --max-running-requests at this / --max-context-len.")
    p.add_argument("--max-samples-per-request", type=int, default=None,
                   help="Most generations (prompts x sampling_params.n) one /generate may ask for; more is a 400 "
                        "(default: 4096, or --max-queued-requests when lower).")
    p.add_argument("--max-queued-requests", type=int, default=65536,
                   help="Most generations the engine holds (running + queued); a request beyond it is a 503 (retry later).")
    p.add_argument("--weight-version", default="default", help="Initial weight_version reported in meta_info.")
    p.add_argument("--random-seed", type=int, default=None, help="Seed for requests that carry no sampling_seed.")
    p.add_argument("--disable-cuda-graph", action="store_true", help="Do not capture the decode step as CUDA graphs.")
    p.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None,
                   help="Decode batch sizes captured as CUDA graphs (as sglang); larger batches run without a graph.")
    p.add_argument("--kv-cache", choices=["auto", "paged", "slots"], default="auto",
                   help="KV cache layout: a page pool with block tables (memory follows the tokens in flight), or one "
                        "static slot of --max-context-len per running request; auto: paged on GPU, slots on CPU.")
    p.add_argument("--page-size", type=int, default=16, choices=[1, 2, 4, 8, 16, 32, 64],
                   help="Tokens per KV page of the paged cache.")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="Largest decode batch captured as a CUDA graph (as sglang); larger batches run without one.")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="Process each decode step's tokens before launching the next (as sglang); by default on CUDA the "
                        "next step runs on the device while the host processes the last one.")
    p.add_argument("--enable-overlap-schedule", action="store_true",
                   help="The overlap scheduler on CPU too (the default there is off: nothing runs alongside the host).")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="Batch-invariant outputs (as sglang): a request's tokens and log-probs do not depend on which "
                        "other requests share its batches. Each prompt is prefilled on its own and every decode step "
                        "runs all --max-running-requests rows over the whole context (one shape, one CUDA graph); "
                        "non-greedy requests need a sampling_seed to be reproducible. Costs throughput "
                        "(docs/engine-protocol.md).")
    p.add_argument("--no-activation-func-clamp-shared-expert", action="store_true",
                   help="Serve the model's shared experts with an unclamped SwiGLU (DeepSeek-V4: its routed experts "
                        "keep swiglu_limit), as the trainer computes them with Miles's flag of this name.")
    p.add_argument("--generic-forward", action="store_true",
                   help="Use the HF forward (one request at a time) even for Llama/Qwen/Mistral models.")
    p.add_argument("--weight-update-timeout", type=float, default=600.0,
                   help="Seconds a weight-update group may take to form or to finish a broadcast.")
    p.add_argument("--pick-cpu-threads", action="store_true",
                   help="On CPU: at start, time a one-token forward on the process's threads (OMP_NUM_THREADS) and on "
                        "one, and run every forward on the faster (the launcher passes it with its share of the "
                        "cores: a tiny model decodes faster on one thread). The choice follows timings, so two runs "
                        "may differ in it; --enable-deterministic-inference or a fixed OMP_NUM_THREADS turns it off.")
    p.add_argument("--enable-lora", action="store_true",
                   help="Serve LoRA adapters (as sglang): /load_lora_adapter, /load_lora_adapter_from_tensors, "
                        "/unload_lora_adapter, and lora_path on /generate (decode then runs without CUDA graphs).")
    p.add_argument("--max-lora-rank", type=int, default=None, help="Refuse adapters of a larger rank (as sglang).")
    p.add_argument("--max-loaded-loras", type=int, default=None, help="Most adapters loaded at once (as sglang).")
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="The linears adapters may target, e.g. q_proj v_proj, or all (as sglang).")
    p.add_argument("--lora-paths", nargs="+", default=None,
                   help="Adapters loaded at the start, each NAME=PATH or PATH (a PEFT directory; as sglang); implies "
                        "--enable-lora.")
    p.add_argument("--experts-shared-outer-loras", action="store_true",
                   help="MoE experts' adapters share one gate/up lora_A and one down lora_B per layer (as sglang): "
                        "checked at load, kept once.")
    p.add_argument("--log-level", default=os.environ.get("MILES_LOG_LEVEL", "INFO"), help="DEBUG, INFO, WARNING, ...")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags that need no model; a bad value exits 2 with argparse's one-line usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is out of range: give a port in 1..65535")
    if args.weight_update_timeout <= 0:
        parser.error(f"--weight-update-timeout {args.weight_update_timeout:g} must be positive (seconds)")
    if args.max_prefill_tokens < 1:
        parser.error(f"--max-prefill-tokens {args.max_prefill_tokens} must be at least 1")
    if args.max_samples_per_request is None:
        args.max_samples_per_request = min(DEFAULT_MAX_SAMPLES_PER_REQUEST, args.max_queued_requests)
    for name in ("max_total_tokens", "cuda_graph_max_bs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value} must be at least 1")
    if args.cuda_graph_bs is not None and min(args.cuda_graph_bs) < 1:
        parser.error(f"--cuda-graph-bs {' '.join(map(str, args.cuda_graph_bs))}: every batch size must be at least 1")
    if args.disable_overlap_schedule and args.enable_overlap_schedule:
        parser.error("--disable-overlap-schedule and --enable-overlap-schedule contradict each other: give one")
    if args.max_samples_per_request < 1:
        parser.error(f"--max-samples-per-request {args.max_samples_per_request} must be at least 1")
    if args.max_queued_requests < args.max_samples_per_request:
        parser.error(f"--max-queued-requests {args.max_queued_requests} must be at least --max-samples-per-request "
                     f"({args.max_samples_per_request})")
    return args


def _start_exit_watchdog(signame: str) -> None:
    def expire() -> None:
        logger.error("%s: the engine did not stop within %.0fs; exiting now", signame, SHUTDOWN_DEADLINE_S)
        logging.shutdown()
        os._exit(1)
    timer = threading.Timer(SHUTDOWN_DEADLINE_S, expire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(role="engine", level=args.log_level.upper())
    if args.host in ("0.0.0.0", "::"):
        logger.warning("--host %s listens on every interface; use --api-key on a shared network", args.host)
    from miles.engine.engine import Engine, EngineArgs
    from miles.engine.server import serve

    # The scheduler thread and the HTTP event loop share the GIL. Whenever the scheduler releases it (a copy to the
    # GPU, the wait for a step's tokens) the loop may take it, and with CPython's default 5 ms switch interval the
    # scheduler can then wait up to 5 ms to get it back while the GPU idles. A short interval bounds that wait.
    raw = os.environ.get("MILES_ENGINE_SWITCH_INTERVAL", str(SWITCH_INTERVAL))
    try:
        sys.setswitchinterval(float(raw))
    except ValueError:
        logger.error("MILES_ENGINE_SWITCH_INTERVAL=%r is not a positive number of seconds (default %g); unset it or "
                     "give e.g. 0.005", raw, SWITCH_INTERVAL)
        return 2
    # the prompt tokens of riders (refills prefilled inside decode steps) one step carries on CUDA with graphs, to
    # measure the trade-off (docs/engine-protocol.md); SGLang has no such setting, hence no flag
    raw = os.environ.get("MILES_ENGINE_MIX_STEP_TOKENS")
    mix_step_tokens = None
    if raw is not None:
        if not raw.isdigit() or int(raw) < 1:
            logger.error("MILES_ENGINE_MIX_STEP_TOKENS=%r is not a positive number of tokens; unset it (default "
                         "1024) or give e.g. 256", raw)
            return 2
        mix_step_tokens = int(raw)

    try:
        engine = Engine(EngineArgs(
            hf_checkpoint=args.hf_checkpoint, host=args.host, port=args.port, api_key=args.api_key, device=args.device,
            dtype=args.dtype, max_running_requests=args.max_running_requests, max_context_len=args.max_context_len,
            max_prefill_tokens=args.max_prefill_tokens, weight_version=args.weight_version, random_seed=args.random_seed,
            cuda_graph=not args.disable_cuda_graph, native=not args.generic_forward,
            weight_update_timeout=args.weight_update_timeout, max_samples_per_request=args.max_samples_per_request,
            max_queued_requests=args.max_queued_requests, max_total_tokens=args.max_total_tokens,
            cuda_graph_bs=args.cuda_graph_bs, cuda_graph_max_bs=args.cuda_graph_max_bs,
            kv_cache=args.kv_cache, page_size=args.page_size, deterministic=args.enable_deterministic_inference,
            clamp_shared_expert=not args.no_activation_func_clamp_shared_expert, mix_step_tokens=mix_step_tokens,
            pick_cpu_threads=args.pick_cpu_threads, enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
            max_loaded_loras=args.max_loaded_loras, lora_target_modules=args.lora_target_modules,
            lora_paths=args.lora_paths, experts_shared_outer_loras=args.experts_shared_outer_loras,
            overlap_schedule=False if args.disable_overlap_schedule else (True if args.enable_overlap_schedule else None)))
    except ValueError as e:
        logger.error("%s", e)
        return 2

    async def run() -> None:
        task = asyncio.ensure_future(serve(engine, args.host, args.port))
        loop = asyncio.get_running_loop()

        def on_signal(signum: int, _frame) -> None:
            # A plain signal handler runs in the main thread at the next bytecode even when the event loop is
            # busy; the watchdog thread ends the process if the graceful stop has not finished in time.
            _start_exit_watchdog(signal.Signals(signum).name)
            loop.call_soon_threadsafe(task.cancel)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        try:
            await task
        except asyncio.CancelledError:
            logger.info("shutting down")

    try:
        asyncio.run(run())
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 2
    return 0


if __name__ == "__main__":
    rc = main()
    # The server is shut down cleanly by now; skip interpreter finalization (torch/transformers teardown
    # takes seconds), so a supervisor's restart of this engine is not delayed by it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
