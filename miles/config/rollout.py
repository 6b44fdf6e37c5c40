"""Rollout plane flags: engines, router, client, sampling."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from miles.config import router


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout engines and router")
    g.add_argument("--rollout-engine", choices=["auto", "embedded", "sglang"], default="auto",
                   help="auto: sglang when importable with a GPU, else the embedded engine.")
    g.add_argument("--sglang-router-ip", type=str, default=None, help="Use a running sglang-router at this address.")
    g.add_argument("--sglang-router-port", type=int, default=None, help="Port of a running sglang-router.")
    g.add_argument("--sglang-router-policy", type=str, default=None,
                   help="sglang-router --policy (default: the router's own, cache_aware): random, round_robin, "
                        "cache_aware, power_of_two or manual (each sample gets a routing key, sent as X-SMG-Routing-Key; "
                        "the router keeps one key's requests on one engine).")
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=14400, help="Router request timeout.")
    g.add_argument("--sglang-server-concurrency", type=int, default=512, help="Concurrent requests per engine.")
    g.add_argument("--sglang-mem-fraction-static", type=float, default=None, help="Passed to SGLang.")
    g.add_argument("--sglang-api-key", type=str, default=None,
                   help="API key for engines (sglang --api-key). Multi-node jobs generate one per run when unset.")
    router.add_arguments(parser)  # every sglang-router flag as --router-<flag> (miles/config/router.py)
    g.add_argument("--engine-max-running-requests", type=int, default=64,
                   help="Embedded engine: requests in the running batch (more queue).")
    g.add_argument("--engine-max-context-len", type=int, default=None,
                   help="Embedded engine: KV cache length per request (default: the model's max_position_embeddings, "
                        "at most 4096).")
    g.add_argument("--rollout-request-timeout", type=float, default=600.0, help="Seconds before one generate request is retried.")
    g.add_argument("--rollout-request-retries", type=int, default=3, help="Retries of a failed request on another engine.")
    g.add_argument("--engine-startup-timeout", type=float, default=600.0, help="Seconds for an engine to become healthy.")

    s = parser.add_argument_group("sampling")
    s.add_argument("--rollout-max-response-len", type=int, default=None,
                   help="max_new_tokens per sample (default: none, generation stops at EOS or the engine's context length).")
    s.add_argument("--rollout-max-context-len", type=int, default=None,
                   help="Prompt + response tokens per sample: max_new_tokens is cut to fit (0 left: no new tokens).")
    s.add_argument("--rollout-temperature", type=float, default=1.0, help="Sampling temperature.")
    s.add_argument("--rollout-top-p", type=float, default=1.0, help="Nucleus sampling.")
    s.add_argument("--rollout-top-k", type=int, default=-1, help="Top-k sampling (-1: off).")
    s.add_argument("--rollout-stop", type=str, nargs="+", default=None, help="Stop strings.")
    s.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None, help="Stop token ids.")
    s.add_argument("--rollout-skip-special-tokens", action="store_true", help="Skip special tokens in response text.")
    s.add_argument("--rollout-seed", type=int, default=42, help="Seed for data shuffling and sampling.")


@dataclass(kw_only=True)
class RolloutConfig:
    rollout_engine: str
    sglang_router_ip: str | None
    sglang_router_port: int | None
    sglang_router_policy: str | None
    sglang_router_request_timeout_secs: int
    # the --router-<flag> sglang-router flags the user gave: router name -> parsed value (None: none given)
    router_args: dict[str, Any] | None
    sglang_server_concurrency: int
    sglang_mem_fraction_static: float | None
    sglang_api_key: str | None
    engine_max_running_requests: int
    engine_max_context_len: int | None
    rollout_request_timeout: float
    rollout_request_retries: int
    engine_startup_timeout: float
    rollout_max_response_len: int | None
    rollout_max_context_len: int | None
    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_stop: list[str] | None
    rollout_stop_token_ids: list[int] | None
    rollout_skip_special_tokens: bool
    rollout_seed: int
