"""Readable failures for an SPMD job: one line per rank for known errors, a traceback for bugs.

``run_main(main)`` wraps every entry point (``train.py``, ``train_async.py``, ``python -m
miles.spmd.smoke``). A ``ConfigError`` (bad flags or a plan that does not fit the launch) or another
*known* error (``MilesError``, a missing optional dependency) becomes ONE line on stderr, prefixed with
the rank, and exit code 2: every rank of a bad launch fails the same way within seconds, so the
launcher (torchrun, mpirun, srun) ends the job with a message a user can act on. Anything else is a
bug: traceback and exit code 1.

The rank is read from the launcher's environment, so the prefix is right even when the failure
happens before ``torch.distributed`` is up. Under torchrun the message also goes to the elastic
error file, so torchrun's "Root Cause" summary shows it instead of a link to its docs.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from miles.config.base import ConfigError
from miles.utils.errors import MilesError
from miles.utils.optional import MissingDependencyError

EXIT_KNOWN_ERROR = 2
EXIT_BUG = 1

# Launcher variables carrying the global rank, in the order world.py trusts them.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


class CollectiveTimeoutError(MilesError):
    """A collective on a named group did not finish within --distributed-timeout-minutes."""


class PeerGoneError(MilesError):
    """A collective failed because a member of the group exited (its connection closed)."""


def env_rank(env: dict[str, str] | None = None) -> int | None:
    """This process's global rank as the launcher wrote it, or None outside a launcher."""
    env = os.environ if env is None else env
    for var in _RANK_VARS:
        value = env.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def format_error(exc: BaseException, rank: int | None = None) -> str:
    """The single line printed for a known error: ``[miles r3] error: <message>``."""
    rank = env_rank() if rank is None else rank
    prefix = f"[miles r{rank}]" if rank is not None else "[miles]"
    message = " ".join(str(exc).split()) or type(exc).__name__
    return f"{prefix} error: {message}"


def is_known_error(exc: BaseException) -> bool:
    return isinstance(exc, ConfigError | MilesError | MissingDependencyError)


def _write_torchelastic_error_file(line: str) -> None:
    """Hand the message to torchrun's agent (its summary prints it as the root cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    payload = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(payload, f)
    except OSError:
        pass


def _exit(code: int) -> NoReturn:
    """Leave now: flush logs, then skip interpreter teardown.

    A failing rank must not wait for anything on its way out: non-daemon threads, a process group
    destructor or MPI_Finalize could block on peers that are still inside a collective.
    """
    supervisor = sys.modules.get("miles.spmd.supervisor")
    if supervisor is not None:
        supervisor.stop_all(timeout=2.0)  # engines go down with the rank
    _flush_and_exit(code)


def _flush_and_exit(code: int) -> NoReturn:
    from miles.utils import exit_cleanup

    exit_cleanup.run()  # os._exit skips atexit: this rank's spill files (--offload-train-target disk) go now
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # RuntimeError: a signal handler's flush inside the main
            pass                                     # thread's own write to that stream (reentrant call)
    os._exit(code)


def exit_rank_now(exc: BaseException) -> NoReturn:
    """End this rank from any thread with ``exc`` as its one line and exit code 2 (as :func:`run_main` does for a
    known error), e.g. from an engine supervisor's watcher thread while the main thread waits in a collective: the
    launcher then ends the job instead of the peers waiting out their timeouts."""
    line = format_error(exc)
    sys.stderr.write(line + "\n")
    _write_torchelastic_error_file(line)
    _flush_and_exit(EXIT_KNOWN_ERROR)   # the engine child is gone already; nothing else of this rank must be waited for


def run_main(fn: Callable[[], int | None]) -> NoReturn:
    """Run an entry point; turn known errors into one rank-prefixed line and exit code 2.

    A fatal signal (SIGSEGV, SIGABRT from a C++ ``std::terminate``, ...) dumps every thread's Python stack to
    stderr first, so a crash inside a native library still says where each thread was. Under a launcher,
    the rank exits when the process that started it dies (``miles.spmd.lifeline``)."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    from miles.spmd import signals
    from miles.spmd.lifeline import watch_launcher

    watch_launcher()  # under a launcher, this rank (and its engines) ends within seconds of the launcher's death
    signals.install()  # the launcher's SIGTERM: one line, engines SIGKILLed, exit at once; Ctrl-C: bounded
    try:
        rc = fn()
    except SystemExit:
        raise
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C (asyncio.run cancels its task first)
        signals.quiet()
        sys.stderr.write(format_error(RuntimeError("interrupted (SIGINT); the run stopped")) + "\n")
        _exit(130)
    except BaseException as exc:  # noqa: BLE001 - the one place that turns every failure into an exit code
        signals.quiet()
        if is_known_error(exc):
            line = format_error(exc)
            sys.stderr.write(line + "\n")
            _write_torchelastic_error_file(line)
            _exit(EXIT_KNOWN_ERROR)
        rank = env_rank()
        sys.stderr.write(f"[miles r{rank}] unexpected error (a bug; traceback follows)\n" if rank is not None
                         else "[miles] unexpected error (a bug; traceback follows)\n")
        traceback.print_exc()
        _exit(EXIT_BUG)
    sys.exit(int(rc or 0))
