"""sglang-router's flags as ``--router-<flag>``, as Miles v0.1.0 registers them (``add_router_arguments``:
``RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)``).

The flags are data: ``miles/config/sglang_router_args.json`` lists sglang-router 0.3.2's ``--router-*``
actions (written by ``tools/gen_sglang_router_args.py``; a unit test checks it against the installed package),
so the parser works without sglang-router. Each is registered with the router's nargs, choices and value type
and no default: only the flags the user gives are recorded, in ``RolloutConfig.router_args`` (the router's name,
``health_success_threshold`` -> value). ``miles.fleet.router`` passes them to the router miles starts, in the
router's own spelling, over miles's own settings for the same flag.

Checks (``validate_router``, never rewriting a value): ``--router-policy``, ``--router-request-timeout-secs`` and
``--router-api-key`` must equal miles's ``--sglang-router-policy`` (when given), ``--sglang-router-request-timeout-secs``
and ``--sglang-api-key`` (the values miles gives the router, as Miles does); no ``--router-*`` flag with a running
router (``--sglang-router-ip``); sglang-router must be importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.base import ConfigError

if TYPE_CHECKING:
    from miles.config.rollout import RolloutConfig

SPEC_PATH = Path(__file__).with_name("sglang_router_args.json")
DEST = "router_args"
PREFIX = "--router-"
GROUP_TITLE = "sglang-router flags (passed to the router miles starts)"
INSTALL = "pip install 'sglang-router>=0.3.2' (a dependency of miles, in requirements.txt)"
# values never logged or written to config.json
SECRETS = frozenset({"api_key", "oracle_password", "postgres_db_url", "redis_url", "control_plane_api_keys",
                     "oracle_wallet_path", "client_key_path", "tls_key_path"})
# the router flag -> miles's own flag that sets it (RolloutConfig field); both given must agree
PAIRED: dict[str, tuple[str, str]] = {
    "policy": ("--sglang-router-policy", "sglang_router_policy"),
    "request_timeout_secs": ("--sglang-router-request-timeout-secs", "sglang_router_request_timeout_secs"),
    "api_key": ("--sglang-api-key", "sglang_api_key"),
}
_TYPES = {None: str, "str": str, "int": int, "float": float}
# Miles's --sglang-router-policy values that route by the X-SMG-Routing-Key header: under them each sample gets a
# routing key (radixark/miles@v0.1.0:miles/rollout/generate_utils/generate_endpoint_utils.py policy_uses_routing_key).
# sglang-router 0.3.2 has ``manual`` only; ``consistent_hashing`` is accepted for a running router (--sglang-router-ip).
ROUTING_KEY_POLICIES = ("consistent_hashing", "manual")


def uses_routing_key(policy: str | None) -> bool:
    """True when ``--sglang-router-policy`` routes by each request's ``X-SMG-Routing-Key`` (Miles's test)."""
    return policy in ROUTING_KEY_POLICIES


@dataclass(frozen=True)
class RouterArg:
    """One ``--router-*`` action of sglang-router's ``RouterArgs.add_cli_args`` (one entry of the JSON)."""

    name: str                      # the router's spelling without dashes, '-' -> '_' (the key in router_args)
    flag: str                      # --router-health-success-threshold
    router_flag: str               # --health-success-threshold (what launch_router reads)
    kind: str                      # store | store_true | append
    nargs: int | str | None
    type: str | None
    default: Any
    choices: tuple[Any, ...] | None
    help: str | None

    def cli(self, value: Any) -> list[str]:
        """The tokens ``sglang_router.launch_router`` reads back as ``value``."""
        if self.kind == "store_true":
            return [self.router_flag] if value else []
        if self.kind == "append":
            return [t for group in value for t in (self.router_flag, *map(str, group))]
        if self.nargs in ("*", "+") or isinstance(self.nargs, int):
            return [self.router_flag, *map(str, value)]
        text = str(value)
        return [f"{self.router_flag}={text}"] if text.startswith("-") else [self.router_flag, text]


@lru_cache(maxsize=1)
def load_spec() -> dict[str, RouterArg]:
    data = json.loads(SPEC_PATH.read_text())
    out: dict[str, RouterArg] = {}
    for a in data["args"]:
        name = a["router_flag"][2:].replace("-", "_")
        out[name] = RouterArg(name=name, flag=a["flag"], router_flag=a["router_flag"], kind=a["kind"],
                              nargs=a["nargs"], type=a["type"], default=a["default"],
                              choices=tuple(a["choices"]) if a["choices"] else None, help=a["help"])
    return out


@lru_cache(maxsize=1)
def router_version() -> str:
    """The sglang-router release the JSON was taken from (``"0.3.2"``)."""
    return json.loads(SPEC_PATH.read_text())["version"]


class _Record(argparse.Action):
    """Records ``name -> value`` in the ``router_args`` dict (a new dict each time, never shared)."""

    def __init__(self, option_strings: list[str], dest: str, *, router_arg: RouterArg, **kwargs: Any) -> None:
        self.router_arg = router_arg
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        a = self.router_arg
        recorded = dict(getattr(namespace, self.dest, None) or {})
        if a.kind == "store_true":
            recorded[a.name] = True
        elif a.kind == "append":
            recorded[a.name] = [*recorded.get(a.name, []), list(values)]
        else:
            recorded[a.name] = values
        setattr(namespace, self.dest, recorded)


def _help(a: RouterArg) -> str:
    text = f"sglang-router {a.router_flag}" + (f": {a.help}" if a.help else "")
    if a.default not in (None, False, [], {}, ""):
        text += f" (router's default: {a.default})"
    return text.replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every ``--router-*`` flag of the JSON (called by the rollout section)."""
    g = parser.add_argument_group(GROUP_TITLE, f"Every sglang-router {router_version()} flag as --router-<flag> "
                                               "(as Miles); only the ones given are passed on.")
    parser.set_defaults(**{DEST: None})
    for a in load_spec().values():
        kwargs: dict[str, Any] = {"dest": DEST, "default": argparse.SUPPRESS, "router_arg": a, "help": _help(a)}
        if a.kind == "store_true":
            kwargs["nargs"] = 0
        else:
            kwargs.update(type=_TYPES[a.type], nargs=a.nargs, choices=a.choices, metavar=a.name.upper())
        g.add_argument(a.flag, action=_Record, **kwargs)


def router_cli(args: Mapping[str, Any]) -> list[str]:
    """launch_router tokens for ``args`` (router names as in ``RolloutConfig.router_args``)."""
    spec = load_spec()
    out: list[str] = []
    for name, value in args.items():
        if name not in spec:
            raise ConfigError(f"{PREFIX}{name.replace('_', '-')}: sglang-router {router_version()} has no "
                              f"--{name.replace('_', '-')}; see `python -m sglang_router.launch_router --help`.")
        if value is not None:
            out += spec[name].cli(value)
    return out


def shown(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with secret values as ``***`` (for logs and config.json)."""
    return {k: ("***" if k in SECRETS and v else v) for k, v in args.items()}


def router_policy(r: RolloutConfig) -> str | None:
    """The policy of the router the run sends to: ``--sglang-router-policy``, else ``--router-policy`` (None: the
    router's default, or whatever a running router has)."""
    return r.sglang_router_policy or (r.router_args or {}).get("policy")


def router_policies() -> tuple[str, ...]:
    """The ``--policy`` values of the sglang-router release the JSON was taken from."""
    return tuple(load_spec()["policy"].choices or ())


def validate_router(r: RolloutConfig) -> None:
    """``--sglang-router-policy`` is one the router miles starts has; the ``--router-*`` flags given: package
    present, no running router, agreement with miles's own flags."""
    policy = r.sglang_router_policy
    if policy is not None and r.sglang_router_ip is None and policy not in router_policies():
        why = (" (Miles's hashing routing-key policy, in newer sglang-router releases; `manual` also sends every request "
               "of one routing key to the same engine)") if policy == "consistent_hashing" else ""
        raise ConfigError(f"--sglang-router-policy {policy}: sglang-router {router_version()}, which miles starts, has no "
                          f"such policy{why}; pass one of {', '.join(router_policies())}, or point "
                          "--sglang-router-ip/--sglang-router-port at a running router that has it.")
    given = r.router_args or {}
    if not given:
        return
    first = load_spec()[next(iter(given))].flag
    if r.sglang_router_ip is not None:
        raise ConfigError(f"{first} cannot apply: --sglang-router-ip {r.sglang_router_ip} names a running router, "
                          f"which miles does not start; set {first} on that router, or drop --sglang-router-ip/"
                          "--sglang-router-port to let miles start one with it.")
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError(f"{first} needs the sglang-router package, which is not installed: {INSTALL}.")
    for name, (miles_flag, field) in PAIRED.items():
        if name not in given:
            continue
        ours, theirs = getattr(r, field), given[name]
        if ours == theirs or (ours is None and name == "policy"):  # --router-policy alone: the router's policy
            continue
        flag = load_spec()[name].flag
        value = "***" if name in SECRETS else theirs
        if ours is None:  # --router-api-key alone: the router would refuse miles's own client and engines' calls
            raise ConfigError(f"{flag} {value}: miles's client, router and engines share one key, "
                              f"{miles_flag}; pass {miles_flag} {value} instead of {flag}.")
        mine = "***" if name in SECRETS else ours
        default = ", its default" if name == "request_timeout_secs" and ours == 14400 else ""
        raise ConfigError(f"{flag} {value} conflicts with {miles_flag} {mine}{default} (miles gives the router "
                          f"{miles_flag}, as Miles does): drop {flag} and pass {miles_flag} {value}, or make them equal.")


def miles_attrs(r: RolloutConfig) -> dict[str, Any]:
    """Miles's ``args.router_<name>`` view (what Miles plugins read): the value given, else the router's default."""
    out = {f"router_{a.name}": a.default for a in load_spec().values()}
    out.update({f"router_{k}": v for k, v in (r.router_args or {}).items()})
    return out


def flag_docs() -> list[str]:
    """The docs/flags.md text for this group: one paragraph and one row per flag."""
    lines = [
        f"Every `--router-*` flag of sglang-router {router_version()} (`RouterArgs.add_cli_args` with",
        "`use_router_prefix=True, exclude_host_port=True`, as Miles v0.1.0 registers them; the list is data in",
        "`miles/config/sglang_router_args.json`, written by `tools/gen_sglang_router_args.py`), with the router's",
        "value type, `nargs` and choices. Only the flags given are recorded (`cfg.rollout.router_args`) and passed",
        "to the router miles starts, without the prefix, over miles's own settings for the same router flag (miles",
        "starts it with `--health-check-interval-secs 5 --health-failure-threshold 2 --retry-max-retries 3",
        "--worker-startup-timeout-secs 120 --shutdown-grace-period-secs 5 --log-level warn` and its Prometheus",
        "endpoint on the router's host and a free port). `--router-policy`, `--router-request-timeout-secs` and",
        "`--router-api-key` must equal `--sglang-router-policy` (when given), `--sglang-router-request-timeout-secs`",
        "(default 14400) and `--sglang-api-key`, which miles gives the router (as Miles does). With a running router",
        "(`--sglang-router-ip/--sglang-router-port`) no `--router-*` flag is accepted. A `--router-*` flag without",
        f"sglang-router installed is one line: {INSTALL}.",
        "",
        "| flag | router's default | meaning |", "|---|---|---|",
    ]
    for a in load_spec().values():
        names = f"`{a.flag}`" + (" {" + "\\|".join(str(c) for c in a.choices) + "}" if a.choices else "")
        if a.nargs in ("*", "+") or a.kind == "append":
            names += f" (nargs {a.nargs}{', repeatable' if a.kind == 'append' else ''})"
        default = "" if a.default in (None, False, [], {}) else f"`{a.default}`"
        lines.append(f"| {names} | {default} | {(a.help or '').replace('|', '/')} |")
    return lines
