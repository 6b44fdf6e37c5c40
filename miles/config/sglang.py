"""SGLang server flags: every SGLang ``ServerArgs`` flag as ``--sglang-<flag>``, as Miles registers them.

The flags are data: ``miles/config/sglang_server_args.json`` lists the actions of SGLang 0.5.16's
``ServerArgs.add_cli_args`` (written by ``tools/gen_sglang_server_args.py``); SGLang itself is never
imported. Each one is registered with SGLang's aliases, ``nargs``, choices and value type, and no default:
only the flags the user gives are recorded, in one section ``SGLangConfig.sglang_server_args`` that maps the
flag's SGLang name (its first spelling, dashes as underscores: ``chunked_prefill_size``) to the parsed
value. ``miles.fleet.engines`` passes them to ``sglang.launch_server`` and maps the ones that mean
something to the embedded engine.

Not registered here:

- the fields Miles v0.1.0 sets itself (``SET_BY_MILES``, its ``_SKIPPED_SERVER_ARGS``): giving one, e.g.
  ``--sglang-port``, is one error line saying where miles takes the value from;
- the ``--sglang-*`` flags the rollout section defines with miles's own meaning (``--sglang-mem-fraction-static``,
  ``--sglang-api-key``, the router flags ...): any option string another section already defines is left
  to it, so this module is registered last.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Any

from miles.config.base import ConfigError
from miles.utils.lora import LORA_ADAPTER_NAME  # noqa: F401 - the trained adapter's name on the engines (Miles's)

SPEC_PATH = Path(__file__).with_name("sglang_server_args.json")
DEST = "sglang_server_args"
PREFIX = "--sglang-"
GROUP_TITLE = "SGLang server flags (forwarded to sglang.launch_server)"

# Miles v0.1.0 (radixark/miles@v0.1.0:miles/backends/sglang_utils/arguments.py, _SKIPPED_SERVER_ARGS) does not expose these:
# the engine launcher sets them. Value: why, for the refusal line.
_PLACED = "miles places each engine from --rollout-num-gpus-per-engine and --num-gpus-per-node"
SET_BY_MILES: dict[str, str] = {
    "model_path": "the engine serves --hf-checkpoint",
    "config": "",  # Miles's own --sglang-config (a server-group YAML): refused with its own message
    "trust_remote_code": "miles always passes --trust-remote-code to SGLang",
    "random_seed": "SGLang's --random-seed is left to SGLang",
    "enable_memory_saver": "miles turns SGLang's memory saver on with --colocate",
    "port": "miles picks a free port for each engine",
    "nnodes": _PLACED, "node_rank": _PLACED, "dist_init_addr": _PLACED, "gpu_id_step": _PLACED,
    "base_gpu_id": _PLACED, "nccl_port": _PLACED,
    "skip_server_warmup": "miles always passes --skip-server-warmup",
    "enable_return_routed_experts": "miles sets it with --use-rollout-routing-replay",
    "enable_return_indexer_topk": "Miles sets it with --use-rollout-indexer-replay, which miles does not support",
}
# ServerArgs fields whose --sglang-* flag the rollout section defines (miles/config/rollout.py).
DEFINED_ELSEWHERE = frozenset({"mem_fraction_static", "api_key"})


@dataclass(frozen=True)
class ServerArg:
    """One SGLang ``ServerArgs`` command-line action (one entry of the JSON)."""

    name: str                      # first SGLang spelling without dashes, '-' -> '_' (the key in sglang_server_args)
    flags: tuple[str, ...]         # SGLang's option strings, e.g. ("--tp-size", "--tensor-parallel-size")
    dest: str                      # SGLang's ServerArgs field
    kind: str                      # store | store_true | store_false | boolean_optional | flag (no value)
    nargs: int | str | None
    type: str | None
    default: Any
    choices: tuple[Any, ...] | None
    const: Any
    deprecated: str | bool | None
    help: str | None

    @property
    def miles_flags(self) -> list[str]:
        """How a miles user spells it: ``--sglang-`` + each SGLang spelling (BooleanOptional: ``--no-sglang-x``)."""
        if self.kind == "boolean_optional":
            stem = self.flags[0][2:]
            return [PREFIX + stem, "--no-sglang-" + stem]
        return [PREFIX + f[2:] for f in self.flags if f.startswith("--")]

    @property
    def miles_flag(self) -> str:
        return PREFIX + self.flags[0][2:]

    def cli(self, value: Any) -> list[str]:
        """The tokens SGLang's own parser reads back as ``value``: flags without a value bare, lists as nargs."""
        flag = self.flags[0]
        if self.kind in ("store_true", "store_false", "flag"):
            return [flag]
        if self.kind == "boolean_optional":
            return [flag if value else "--no-" + flag[2:]]
        if self.nargs == "?" and value == self.const:
            return [flag]
        if self.nargs in ("+", "*") or isinstance(self.nargs, int):
            return [flag, *(self.format(v) for v in value)]
        text = self.format(value)
        return [f"{flag}={text}"] if text.startswith("-") else [flag, text]

    def format(self, value: Any) -> str:
        if self.type in JSON_TYPES:
            return json.dumps(value)
        return str(value)


def _human_int(text: str) -> int:
    """SGLang's ``human_readable_int``: an integer, or a number with k/M/G/T (x1000) or Ki/Mi/Gi/Ti (x1024)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", text.strip())
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer (suffixes k, M, G, T, Ki, Mi, Gi, Ti allowed)") from None
    number, suffix = m.groups()
    if suffix.endswith("i"):
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: decimals are not allowed with {suffix}; use an integer")
        return int(number) * 1024 ** ("KMGT".index(suffix[0]) + 1)
    return int(Decimal(number) * 1000 ** ("kMGT".index(suffix) + 1))


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e.msg}); quote the whole JSON value") from e


def _json_object(text: str) -> dict:
    value = _json_value(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object, e.g. '{{\"decode\": {{...}}}}'")
    return value


# SGLang's argparse ``type`` callables (by __name__) -> ours; values of JSON_TYPES go back as JSON text.
TYPES: dict[str | None, Callable[[str], Any]] = {
    None: str, "str": str, "nullable_str": str, "int": int, "float": float, "human_readable_int": _human_int,
    "loads": _json_value, "json_list_type": _json_value, "parse_cuda_graph_config_arg": _json_object,
}
JSON_TYPES = frozenset({"loads", "json_list_type", "parse_cuda_graph_config_arg"})


@lru_cache(maxsize=1)
def load_spec() -> dict[str, ServerArg]:
    """Every SGLang ServerArgs action by name (see ``ServerArg.name``), in SGLang's order."""
    data = json.loads(SPEC_PATH.read_text())
    out: dict[str, ServerArg] = {}
    for a in data["args"]:
        name = a["flags"][0].lstrip("-").replace("-", "_")
        out[name] = ServerArg(
            name=name, flags=tuple(a["flags"]), dest=a["dest"], kind=a["kind"], nargs=a["nargs"], type=a["type"],
            default=a["default"], choices=tuple(a["choices"]) if a["choices"] else None, const=a.get("const"),
            deprecated=a.get("deprecated"), help=a.get("help"))
    return out


@lru_cache(maxsize=1)
def sglang_version() -> str:
    """The SGLang release the JSON was taken from (``"sglang 0.5.16 ..."``)."""
    return json.loads(SPEC_PATH.read_text())["source"]


def exposed_args() -> list[ServerArg]:
    """The ServerArgs actions registered as --sglang-* here (all but SET_BY_MILES and DEFINED_ELSEWHERE)."""
    return [a for a in load_spec().values() if a.dest not in SET_BY_MILES and a.dest not in DEFINED_ELSEWHERE]


class _Forward(argparse.Action):
    """Records ``name -> value`` in the shared ``sglang_server_args`` dict (a new dict each time, never shared)."""

    def __init__(self, option_strings: list[str], dest: str, *, server_arg: ServerArg, **kwargs: Any) -> None:
        self.server_arg = server_arg
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        kind = self.server_arg.kind
        if kind in ("store_true", "store_false", "flag"):
            value: Any = True
        elif kind == "boolean_optional":
            value = not (option_string or "").startswith("--no-")
        else:
            value = values
        recorded = dict(getattr(namespace, self.dest, None) or {})
        recorded[self.server_arg.name] = value
        setattr(namespace, self.dest, recorded)


class _Refuse(argparse.Action):
    """A ServerArgs field miles sets itself: one line naming the flag and where miles takes the value from."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name = (option_string or "").removeprefix(PREFIX).replace("-", "_")
        if name == "config":
            raise ConfigError(
                "--sglang-config (Miles's SGLang server-group YAML: prefill/decode groups, per-group overrides) is "
                "not supported: every engine runs one regular SGLang server; give its flags as --sglang-<flag>.")
        why = SET_BY_MILES.get(name) or SET_BY_MILES.get(_spec_by_flag().get(option_string or "", ""), "")
        raise ConfigError(f"{option_string} is not accepted (Miles does not expose it either): {why}; "
                          f"drop {option_string}.")


@lru_cache(maxsize=1)
def _spec_by_flag() -> dict[str, str]:
    return {PREFIX + f[2:]: a.dest for a in load_spec().values() for f in a.flags}


def _help(a: ServerArg) -> str:
    text = f"SGLang --{a.flags[0][2:]}"
    if a.help:
        text += f": {a.help}"
    if a.default not in (None, False, [], ""):
        text += f" (SGLang's default: {a.default})"
    if a.deprecated:
        text += " [deprecated in SGLang" + (f"; use --sglang-{str(a.deprecated)[2:]}" if isinstance(a.deprecated, str)
                                             and a.deprecated.startswith("--") and "{" not in a.deprecated else "") + "]"
    return text.replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every exposed ServerArgs flag as --sglang-<flag>; register after every other section."""
    g = parser.add_argument_group(GROUP_TITLE, f"Every SGLang ServerArgs flag ({sglang_version().split(' (')[0]}) "
                                               "as --sglang-<flag>; only the ones given are passed on.")
    taken = set(parser._option_string_actions)
    parser.set_defaults(**{DEST: None})
    for a in exposed_args():
        flags = [f for f in a.miles_flags if f not in taken]
        if not flags or a.miles_flag in taken:
            continue
        kwargs: dict[str, Any] = {"dest": DEST, "default": argparse.SUPPRESS, "server_arg": a, "help": _help(a)}
        if a.kind == "store":
            if a.type not in TYPES:
                raise RuntimeError(f"{SPEC_PATH.name}: no converter for SGLang type {a.type!r} of {a.flags[0]}")
            kwargs.update(type=TYPES[a.type], nargs=a.nargs, choices=a.choices, metavar=a.dest.upper())
            if a.nargs == "?":
                kwargs["const"] = a.const
        else:
            kwargs["nargs"] = 0
        g.add_argument(*flags, action=_Forward, **kwargs)
    refused = [PREFIX + f[2:] for a in load_spec().values() if a.dest in SET_BY_MILES for f in a.flags]
    for flag in refused:
        if flag not in taken:
            g.add_argument(flag, action=_Refuse, nargs="*", dest=DEST, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


@dataclass(kw_only=True)
class SGLangConfig:
    # The --sglang-<flag> ServerArgs flags the user gave: SGLang name -> parsed value (None: none given).
    sglang_server_args: dict[str, Any] | None

    @property
    def server_args(self) -> dict[str, Any]:
        """The user-set ServerArgs flags (a copy; empty when none were given)."""
        return dict(self.sglang_server_args or {})

    def miles_attrs(self) -> dict[str, Any]:
        """Miles's ``args.sglang_<ServerArgs field>`` view (what Miles plugins read): the value given, else
        SGLang's default. Value-less deprecated flags that store a constant keep the default."""
        spec = load_spec()
        out = {f"sglang_{a.dest}": a.default for a in exposed_args()}
        for name, value in self.server_args.items():
            a = spec[name]
            if a.kind == "flag" and a.dest != name:
                continue
            out[f"sglang_{a.dest}"] = (not value) if a.kind == "store_false" else value
        return out


def validate_sglang(sglang: SGLangConfig, *, rollout_num_gpus_per_engine: int) -> None:
    """Cross-section checks of the --sglang-* flags (Miles v0.1.0's own checks); never rewrites a value."""
    sa = sglang.server_args
    tp = sa.get("tp_size")
    if tp is not None and tp != rollout_num_gpus_per_engine:
        raise ConfigError(f"--sglang-tp-size {tp} disagrees with --rollout-num-gpus-per-engine {rollout_num_gpus_per_engine} "
                          "(the engine's TP size): drop --sglang-tp-size or make them equal.")
    dp = sa.get("dp_size")
    if dp is not None and dp > 1 and not sa.get("enable_dp_attention"):
        raise ConfigError(f"--sglang-dp-size {dp} needs --sglang-enable-dp-attention (as in Miles): add it, or drop "
                          "--sglang-dp-size.")


# The ServerArgs flags the embedded engine honours (miles.fleet.engines.EMBEDDED_EQUIVALENTS maps each to its own
# option; a test keeps the two equal), and those miles checks against what it sets itself (build_engine_argv).
EMBEDDED_HONOURED = frozenset({
    "max_running_requests", "context_length", "dtype", "max_prefill_tokens", "chunked_prefill_size",
    "max_total_tokens", "cuda_graph_bs", "cuda_graph_bs_decode", "cuda_graph_max_bs", "cuda_graph_max_bs_decode",
    "disable_cuda_graph", "cuda_graph_backend_decode", "disable_overlap_schedule", "max_queued_requests", "log_level",
    "weight_version", "enable_deterministic_inference",
    # LoRA adapters (miles.engine.lora): served, loaded and named as SGLang's
    "enable_lora", "max_lora_rank", "max_loaded_loras", "lora_target_modules", "lora_paths", "experts_shared_outer_loras"})
SET_BY_ENGINE_LAUNCH = frozenset({"tp_size", "host", "device"})
EMBEDDED_GRAPH_BACKENDS = ("disabled", "full")     # --sglang-cuda-graph-backend-decode values the embedded engine has
# Flags Miles's recorded launch commands pass that the embedded engine accepts without effect: they change how fast
# SGLang runs or what it logs, not the samples (docs/flags.md lists them). Every other flag it lacks is refused.
_SPECULATIVE = ("speculative decoding changes SGLang's speed, not its samples (draft tokens are verified against the "
                "model); the embedded engine decodes without it")
EMBEDDED_NO_EFFECT: dict[str, str] = {
    "mem_fraction_static": "SGLang's share of GPU memory for weights and KV cache; the embedded engine sizes its "
                           "cache by --engine-max-running-requests x --engine-max-context-len",
    "attention_backend": "a choice of SGLang attention kernels; the embedded engine runs its own (the same attention)",
    "moe_runner_backend": "a choice of SGLang MoE kernels; the embedded engine runs the model's own experts (the same "
                          "routing and sums)",
    "decode_log_interval": "how often SGLang logs decode batches; the embedded engine logs none",
    "disable_custom_all_reduce": "SGLang's all-reduce kernel between the GPUs of one engine (NCCL's instead); an "
                                 "embedded engine runs on one device",
    "disable_radix_cache": "SGLang's reuse of a cached prompt prefix's KV (the same KV, computed once); the embedded "
                           "engine shares only a whole prompt's KV among its samples",
    "load_format": "how SGLang reads its first weights; the embedded engine reads --hf-checkpoint, and every engine "
                   "gets the trainer's weights before its first request",
    "remote_instance_weight_loader_start_seed_via_transfer_engine": "how SGLang fetches its first weights from "
                                                                    "another instance; see load_format",
    "lora_backend": "a choice of SGLang LoRA kernels; the embedded engine adds each request's adapter as torch "
                    "matmuls (the same sums)",
    "max_lora_chunk_size": "the chunk size of SGLang's chunked LoRA kernel; the embedded engine has no such kernel",
    "max_loras_per_batch": "how many adapters one SGLang batch holds (requests of others wait); the embedded engine "
                           "batches any mix of adapters, each request with its own",
    "lora_eviction_policy": "which adapter SGLang evicts from its batch slots; the embedded engine keeps every loaded "
                            "adapter on its device",
    "enable_lora_overlap_loading": "SGLang's adapter loading overlapped with its forwards (speed only)",
    "lora_use_virtual_experts": "how SGLang's fused MoE kernel lays out the experts' LoRA (a kernel path); the "
                                "embedded engine adds each expert's adapter in its own loop (the same sums)",
    "speculative_algorithm": _SPECULATIVE, "speculative_eagle_topk": _SPECULATIVE,
    "speculative_num_draft_tokens": _SPECULATIVE, "speculative_num_steps": _SPECULATIVE,
}




def serves_lora_adapters(train: Any, sglang: SGLangConfig) -> bool:
    """A LoRA run (``--lora-rank``) whose engines serve the adapters (``--sglang-enable-lora``): the weight sync sends
    the adapters (the base once, unmerged) and the rollouts name them, as Miles does for every LoRA run; without
    ``--sglang-enable-lora`` the engines get the merged weights ``W + (alpha / r) B @ A``."""
    return int(getattr(train, "lora_rank", 0) or 0) > 0 and bool(sglang.server_args.get("enable_lora"))


def check_embedded_engine(sglang: SGLangConfig, *, why: str) -> None:
    """Refuse the --sglang-* flags the embedded engine would ignore (one line naming flag, value and fix). ``why``
    says how the embedded engine was chosen, e.g. "--rollout-engine embedded"."""
    given = sglang.server_args
    for name, value in given.items():
        if name in EMBEDDED_NO_EFFECT or name in SET_BY_ENGINE_LAUNCH:
            continue
        if name == "cuda_graph_backend_decode" and value not in EMBEDDED_GRAPH_BACKENDS:
            lacks = f"has no CUDA-graph backend {value} (it takes {' or '.join(EMBEDDED_GRAPH_BACKENDS)})"
        elif name not in EMBEDDED_HONOURED:
            lacks = "has no such setting"
        else:
            continue
        shown = flag_of(name) if value is True else f"{flag_of(name)} {_shown(value)}"
        raise ConfigError(f"{shown}: the embedded engine ({why}) {lacks} and would ignore it; use --rollout-engine "
                          "sglang (SGLang installed, on GPU) or drop the flag.")


def _shown(value: Any) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, list) else str(value)


def unknown_flag_line(flag: str, close: str | None) -> str:
    """The refusal of a --sglang-* flag that is not in SGLang's ServerArgs (the JSON)."""
    stem = flag.removeprefix("--no-sglang-").removeprefix("--sglang-")
    hint = f"; did you mean {close}?" if close else "; see docs/flags.md"
    return (f"unrecognized argument {flag}: {sglang_version().split(' (')[0]}'s ServerArgs (the SGLang server miles "
            f"starts) has no --{stem}, so it cannot be forwarded{hint} (flags only a patched SGLang has are not "
            "in the list)")


def is_server_flag(stem: str, *, negated: bool = False) -> bool:
    """Whether ``--<stem>`` is one of SGLang's ServerArgs option strings; ``negated``: ``--no-<stem>`` of a boolean
    one (Miles makes every boolean ServerArgs flag negatable under its ``--eval-sglang-`` prefix)."""
    booleans = ("boolean_optional", "store_true", "store_false")
    return any(("--" + stem) in a.flags and (not negated or a.kind in booleans) for a in load_spec().values())


def flag_of(name: str) -> str:
    """The miles spelling of a ServerArgs flag name: ``chunked_prefill_size`` -> ``--sglang-chunked-prefill-size``."""
    spec = load_spec().get(name)
    return spec.miles_flag if spec is not None else PREFIX + name.replace("_", "-")


def server_args_cli(server_args: Mapping[str, Any]) -> list[str]:
    """SGLang command-line tokens for ``server_args`` (names as in ``SGLangConfig.sglang_server_args``)."""
    spec = load_spec()
    out: list[str] = []
    for name, value in server_args.items():
        if name not in spec:
            raise ConfigError(f"{flag_of(name)}: SGLang {sglang_version().split(' (')[0]} has no --{name.replace('_', '-')}; "
                              "see `python -m sglang.launch_server --help` for its flags.")
        out += spec[name].cli(value)
    return out



def flag_docs() -> list[str]:
    """The docs/flags.md text for this group (tools/gen_flag_docs.py writes it instead of one row per flag)."""
    refused = ", ".join(f"`--sglang-{n.replace('_', '-')}`" for n in SET_BY_MILES if n != "config")
    return [
        f"Every flag of SGLang's `ServerArgs` ({sglang_version().split(' (')[0]}: the list is data in",
        "`miles/config/sglang_server_args.json`, written by `tools/gen_sglang_server_args.py`) is accepted as",
        "`--sglang-<flag>`, with SGLang's aliases, value type, `nargs` and choices, as Miles registers them;",
        "boolean-optional ones also as `--no-sglang-<flag>`. `--help-all` lists them all. Only the flags given are",
        "recorded (`cfg.sglang.sglang_server_args`, SGLang name -> value) and passed to `sglang.launch_server`",
        "in SGLang's own spelling (value-less flags bare, lists as several values); SGLang's defaults apply to",
        "the rest. The router flags, `--sglang-server-concurrency`, `--sglang-mem-fraction-static` and",
        "`--sglang-api-key` keep the definitions in the table above.",
        "",
        f"Refused in one line, as Miles does not expose them either (miles sets them itself): {refused};",
        "and Miles's `--sglang-config` (a server-group YAML for prefill/decode groups), which miles does not support.",
        "`--sglang-tp-size`, `--sglang-host` and `--sglang-device` must agree with what miles sets",
        "(`--rollout-num-gpus-per-engine`, the engine's address, the rank's device).",
        "",
        "The embedded engine honours `--sglang-max-running-requests`, `--sglang-context-length`,",
        "`--sglang-chunked-prefill-size` / `--sglang-max-prefill-tokens` (its prefill token budget: the smaller),",
        "`--sglang-max-total-tokens`, `--sglang-cuda-graph-bs` / `--sglang-cuda-graph-max-bs` (and their",
        "`-decode` spellings), `--sglang-disable-cuda-graph` / `--sglang-cuda-graph-backend-decode disabled`,",
        "`--sglang-disable-overlap-schedule`, `--sglang-enable-deterministic-inference` (batch-invariant outputs,",
        "docs/engine-protocol.md), `--sglang-dtype`, `--sglang-max-queued-requests`, `--sglang-log-level`,",
        "`--sglang-weight-version` and the LoRA serving flags `--sglang-enable-lora`, `--sglang-max-lora-rank`,",
        "`--sglang-max-loaded-loras`, `--sglang-lora-target-modules`, `--sglang-lora-paths` (adapters named by",
        "`lora_path`, docs/engine-protocol.md), `--sglang-experts-shared-outer-loras` (MoE experts' shared outer",
        "LoRA factors, checked and kept once). Any other `--sglang-*` flag is refused in one line with the embedded engine",
        "(at parse and `--dry-run` with `--rollout-engine embedded`; at the start when `--rollout-engine auto` picks",
        "it), and so is `--sglang-cuda-graph-backend-decode` other than `disabled` or `full`, except these, which",
        "Miles's scripts pass and which change SGLang's speed or logs, not the samples (the engine logs them once",
        "as ignored):",
        "",
        "| flag | why it changes nothing with the embedded engine |",
        "|---|---|",
        *(f"| `{flag_of(n)}` | {why} |" for n, why in EMBEDDED_NO_EFFECT.items()),
    ]
