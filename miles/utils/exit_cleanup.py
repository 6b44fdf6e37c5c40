"""Directories this process removes when it ends, however it ends.

    remove_at_exit(path)     # e.g. a trainer rank's --offload-train-target disk spill directory
    forget(path)             # removed (or handed on) already: nothing to do at exit

A normal end runs them through ``atexit``; ``miles.spmd.errors`` (a known error, a bug, the launcher's SIGTERM, a
second Ctrl-C) leaves with ``os._exit``, which skips ``atexit``, so it calls :func:`run` itself just before. Each
removal ignores every error and waits for nothing (a rank that is leaving must not block). A SIGKILLed rank leaves
its directories behind; whoever owns one empties it when the rank starts again.
"""

from __future__ import annotations

import atexit
import shutil
import threading
from pathlib import Path

_lock = threading.Lock()
_paths: dict[str, None] = {}       # insertion-ordered set
_armed = False


def remove_at_exit(path: str | Path) -> None:
    """Remove the directory ``path`` (and everything in it) when this process ends."""
    global _armed
    with _lock:
        _paths[str(path)] = None
        if not _armed:
            atexit.register(run)
            _armed = True


def forget(path: str | Path) -> None:
    with _lock:
        _paths.pop(str(path), None)


def run() -> None:
    """Remove every registered directory now (errors ignored); called at exit."""
    with _lock:
        paths = list(_paths)
        _paths.clear()
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
