"""Write miles/config/sglang_server_args.json: SGLang's ServerArgs command-line flags, kept as data.

    pip download sglang==0.5.16 --no-deps -d /tmp/sgl && (cd /tmp/sgl && unzip -q sglang-0.5.16-*.whl 'sglang/*')
    python tools/gen_sglang_server_args.py /tmp/sgl 0.5.16

SGLang is not installed here (it needs a GPU stack), so its ``server_args`` module is imported from the
unpacked wheel with the heavy modules it imports only for runtime work replaced by empty stand-ins;
``ServerArgs.add_cli_args`` then fills a plain parser and every action is written out: its option strings,
dest, kind, nargs, type (the converter's name), default, choices, const (``nargs='?'``), deprecated (the
replacement flag SGLang names) and help (first sentence). ``miles.config.sglang`` registers them as
``--sglang-<flag>``. Miles v0.1.0 runs SGLang 0.5.16 (its Dockerfile's base image) rebuilt from Miles's
``sglang-miles`` branch; flags only that branch has are not in the PyPI wheel, so not in this list.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types
import typing
from pathlib import Path
from unittest import mock

OUT = Path(__file__).resolve().parents[1] / "miles" / "config" / "sglang_server_args.json"
# modules server_args imports for runtime work only (kernels, tokenizer parsers, HF config helpers)
STUBS = ("psutil", "pybase64", "triton", "IPython", "zmq", "torchvision", "sglang.kernels.ops.attention.fla",
         "sglang.srt.configs", "sglang.srt.function_call", "sglang.srt.parser", "sglang.srt.entrypoints",
         "sglang.srt.utils.hf_transformers_utils", "sglang.srt.utils.hf_transformers")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if any(fullname == s or fullname.startswith(s + ".") for s in STUBS):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return None


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "store_true"
    if isinstance(action, argparse._StoreFalseAction):
        return "store_false"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "boolean_optional"
    if action.nargs == 0:
        return "flag"  # SGLang's deprecated-flag actions take no value
    return "store"


def _short_help(text: str | None) -> str | None:
    """The first sentence of an action's help (at most 200 characters), or None when hidden/absent."""
    if not text or text == argparse.SUPPRESS:
        return None
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return first if len(first) <= 200 else first[:197] + "..."


def _choices(a: argparse.Action):
    if not a.choices or isinstance(a.choices, mock.MagicMock):
        return None
    values = list(a.choices)
    if isinstance(a.choices, (set, frozenset)):  # a set's order changes between runs
        values = sorted(values, key=str)
    return _jsonable(values)


def _deprecated(a: argparse.Action):
    """SGLang's deprecated actions: the replacement flag they name, or True when they name none."""
    if not type(a).__name__.startswith("Deprecated"):
        return None
    return getattr(a, "new_flag", None) or True


def dump(sglang_dir: str, version: str) -> dict:
    sys.path.insert(0, sglang_dir)
    sys.meta_path.insert(0, _StubFinder())
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    args = []
    for a in parser._actions:
        if not a.option_strings:
            continue
        args.append({
            "flags": list(a.option_strings), "dest": a.dest, "kind": _kind(a),
            "nargs": a.nargs if isinstance(a.nargs, (int, str)) else None,
            "type": getattr(a.type, "__name__", None) if a.type is not None else None,
            "default": _jsonable(a.default) if a.default is not argparse.SUPPRESS else None,
            "choices": _choices(a),
            "const": _jsonable(a.const) if a.nargs == "?" else None,
            "deprecated": _deprecated(a),
            "help": _short_help(a.help),
        })
    return {"source": f"sglang {version} (PyPI wheel), python/sglang/srt/server_args.py: ServerArgs.add_cli_args",
            "generated_by": "tools/gen_sglang_server_args.py", "args": args}


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    data = dump(sys.argv[1], sys.argv[2])
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(data['args'])} flags to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
