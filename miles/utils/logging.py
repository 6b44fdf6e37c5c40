"""One logger for the whole job, with a plane-and-rank prefix: ``[miles trainer r3] ...``.

Use ``get_logger(__name__)`` everywhere; call ``configure_logging`` once per process after the rank
is known. Ranks other than 0 log WARNING and above to stderr by default, and everything to their
per-rank log file when ``log_dir`` is given.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_ROOT = "miles"
_state = {"rank": None, "role": "main", "configured": False}
_warned: set[str] = set()


class _PrefixFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = _state["rank"]
        prefix = f"[miles {_state['role']}" + (f" r{rank}]" if rank is not None else "]")
        record.miles_prefix = prefix
        return super().format(record)


def get_logger(name: str = _ROOT) -> logging.Logger:
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def configure_logging(
    rank: int | None = None,
    role: str = "main",
    log_dir: str | os.PathLike | None = None,
    level: str | int | None = None,
    all_ranks: bool = False,
) -> None:
    """(Re)configure the ``miles`` logger for this process.

    rank 0 (or every rank with ``all_ranks``) prints INFO to stderr; the others print WARNING and
    above. With ``log_dir``, every rank also writes everything to ``log_dir/rank{rank}.log``.
    """
    _state.update(rank=rank, role=role, configured=True)
    level = level or os.environ.get("MILES_LOG_LEVEL", "INFO")
    root = logging.getLogger(_ROOT)
    root.setLevel(logging.DEBUG)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = _PrefixFormatter("%(asctime)s %(miles_prefix)s %(levelname)s %(message)s", "%H:%M:%S")
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    quiet = rank not in (None, 0) and not all_ranks
    stream.setLevel(logging.WARNING if quiet else level)
    root.addHandler(stream)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(Path(log_dir) / f"rank{rank if rank is not None else 0}.log")
        fh.setFormatter(fmt)
        fh.setLevel(logging.DEBUG)
        root.addHandler(fh)


def set_role(role: str) -> None:
    _state["role"] = role


def warn_once(logger: logging.Logger, message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


if not logging.getLogger(_ROOT).handlers:
    configure_logging()
