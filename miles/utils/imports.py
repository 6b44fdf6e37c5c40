"""``module.function`` paths named by flags (``--custom-rm-path``, ``--custom-loss-function-path``, ...):
imported with one line naming the flag, the value and the fix for every way that can fail, never a
traceback. Shared by the rollout plugins and the trainer's loss plugins."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from typing import Any

from miles.config.base import ConfigError

UNSUPPORTED_ATTR = "__miles_unsupported__"


def unsupported(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a Miles plugin path whose feature is absent here: naming it fails at start-up with ``reason``."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, UNSUPPORTED_ATTR, reason)
        return fn

    return mark


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import ``module.function`` (or ``module.Class.method``-free ``module.attr``) named by ``flag``."""
    if not isinstance(path, str) or "." not in path.strip(".") or path != path.strip():
        raise ConfigError(f"{flag} {path!r} must be a dotted path 'package.module.function'.")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{flag} {path!r}: cannot import module '{module_name}' ({e}). Put the module on PYTHONPATH "
            f"(e.g. run from its folder or `export PYTHONPATH=DIR:$PYTHONPATH`) or fix the path.") from e
    except Exception as e:  # the user's module raised while importing: name it and where, not a traceback
        text = (e.msg if isinstance(e, SyntaxError) else str(e)).splitlines() or [""]
        raise ConfigError(f"{flag} {path!r}: importing module '{module_name}' raised {type(e).__name__}: "
                          f"{text[0]} (at {_raise_site(e)}); fix that module.") from None
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"{flag} {path!r}: module '{module_name}' has no attribute '{attr}'; callables there: "
                          f"{', '.join(public[:20]) or '(none)'}.")
    fn = getattr(module, attr)
    refusal = getattr(fn, UNSUPPORTED_ATTR, None)
    if refusal:  # a Miles path whose feature this project does not have: one line saying so
        raise ConfigError(f"{flag} {path}: {refusal}")
    if not callable(fn):
        raise ConfigError(f"{flag} {path!r} names a {type(fn).__name__}, not a function.")
    return fn


def _raise_site(e: BaseException) -> str:
    """``file:line`` of the innermost frame of ``e`` (a SyntaxError's own file and line)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown location"
