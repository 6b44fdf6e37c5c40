"""Write miles/config/sglang_router_args.json: sglang-router's ``--router-*`` flags, kept as data.

    python tools/gen_sglang_router_args.py          # rewrite the JSON from the installed sglang-router
    python tools/gen_sglang_router_args.py --check  # exit 1 if the JSON differs from the installed package

Miles v0.1.0 registers them with ``RouterArgs.add_cli_args(parser, use_router_prefix=True,
exclude_host_port=True)``; this runs the same call on a plain parser and writes out every ``--router-*``
action: its option string, the router's own spelling (the prefix dropped), kind, nargs, type, default,
choices and help (first sentence). sglang-router 0.3.2 also adds ``--worker-urls`` without the prefix (a
bug in its ``add_cli_args``); that one is not a ``--router-*`` flag and is left out.
``miles.config.router`` registers the list, so the parser works without sglang-router installed; the unit
tests check that the file matches the installed package.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "miles" / "config" / "sglang_router_args.json"
PREFIX = "--router-"


def _kind(a: argparse.Action) -> str:
    if isinstance(a, argparse._StoreTrueAction):
        return "store_true"
    if isinstance(a, argparse._AppendAction):
        return "append"
    if isinstance(a, argparse._StoreAction):
        return "store"
    raise SystemExit(f"{a.option_strings}: action {type(a).__name__} is not handled; extend miles/config/router.py")


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v)
        return v
    except TypeError:
        return None


def _choices(a: argparse.Action) -> list[Any] | None:
    """The choices in the router's order; sorted for --tool-call-parser, whose list comes from the Rust
    binary in a different order on every call."""
    if not a.choices:
        return None
    values = list(a.choices)
    return _jsonable(sorted(values, key=str) if a.dest.endswith("tool_call_parser") else values)


def _short_help(text: str | None) -> str | None:
    if not text or text == argparse.SUPPRESS:
        return None
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return first if len(first) <= 200 else first[:197] + "..."


def dump() -> dict[str, Any]:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    args = []
    for a in parser._actions:
        flags = [f for f in a.option_strings if f.startswith(PREFIX)]
        if not flags:
            continue
        args.append({
            "flag": flags[0], "router_flag": "--" + flags[0].removeprefix(PREFIX), "kind": _kind(a),
            "nargs": a.nargs if isinstance(a.nargs, (int, str)) else None,
            "type": getattr(a.type, "__name__", None) if a.type is not None else None,
            "default": _jsonable(a.default), "choices": _choices(a),
            "help": _short_help(a.help),
        })
    version = importlib.metadata.version("sglang-router")
    return {"source": f"sglang-router {version} (PyPI), sglang_router/router_args.py: RouterArgs.add_cli_args"
                      "(use_router_prefix=True, exclude_host_port=True)",
            "generated_by": "tools/gen_sglang_router_args.py", "version": version, "args": args}


def render() -> str:
    return json.dumps(dump(), indent=1, sort_keys=True) + "\n"


def main() -> int:
    text = render()
    if sys.argv[1:] == ["--check"]:
        if OUT.read_text() != text:
            print(f"{OUT} differs from the installed sglang-router: run python tools/gen_sglang_router_args.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {len(json.loads(text)['args'])} flags to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
