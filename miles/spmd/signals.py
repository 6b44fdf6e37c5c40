"""A rank's signals: the launcher's SIGTERM ends it at once, with its engines; Ctrl-C ends it within seconds.

``run_main`` calls :func:`install` before the entry point runs (main thread, launcher or not).

- **SIGTERM** is how every launcher ends a job (torchrun when another rank failed or the agent was stopped,
  ``scancel``/Slurm, ``mpirun``). By its default action the rank would die on the spot and leave its engine
  processes to their parent-death signal, and an engine that is stopped (SIGSTOP, a debugger) never acts on a
  SIGTERM. So the rank writes one line, SIGKILLs every engine's process group (a stopped process dies of SIGKILL
  too) and leaves with ``os._exit(128 + 15)``: no waiting for a collective, a peer, a thread or a checkpoint (one
  being written stays a ``.tmp.`` directory, which is never loaded).
- **SIGINT** (Ctrl-C; torchrun forwards it to every rank) raises ``KeyboardInterrupt`` in the main thread, also
  inside ``asyncio.run`` (whose own SIGINT handler would only cancel the main task at its next ``await``, which a
  follower rank running commands synchronously never reaches: it went on training to the end): the run stops,
  records what it finished and prints one line (``run_main``). A rank whose main thread is blocked (a collective,
  a native call) cannot raise it, so a rank still there ``INTERRUPT_GRACE_S`` seconds after the first SIGINT, or
  one that gets a second SIGINT, leaves as on SIGTERM (exit code 130).

The main thread runs Python signal handlers only between bytecodes, which a rank waiting inside a collective
does not reach for up to ``--distributed-timeout-minutes``. The signals therefore also reach a daemon thread
through ``signal.set_wakeup_fd`` (the interpreter writes each caught signal's number to a pipe from its C-level
handler), and that thread acts at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import NoReturn

INTERRUPT_GRACE_S = 10.0
_BACKSTOP_S = 3.0  # leave() exits by then whatever a log handler or a dead pipe does
_leaving = threading.Lock()
_quiet = threading.Event()  # run_main is already reporting this rank's failure: no second line
_failure: list[str] = []  # the one line of a failure this rank is cleaning up after (note_failure)
_installed = False


def _prefix() -> str:
    from miles.spmd.errors import env_rank

    rank = env_rank()
    return f"[miles r{rank}]" if rank is not None else "[miles]"


def kill_engines() -> None:
    """SIGKILL the process group of every engine this rank supervises (stopped ones included)."""
    supervisor = sys.modules.get("miles.spmd.supervisor")
    if supervisor is not None:
        with contextlib.suppress(Exception):
            supervisor.terminate_all(grace=0.0)


def leave(message: str | None, code: int) -> NoReturn:
    """End this rank now, from any thread: ``message`` as its one line (None: none), engines SIGKILLed, exit ``code``.
    A second caller (the other path of the same signal) waits for the first one's exit."""
    if not _leaving.acquire(blocking=False):
        threading.Event().wait()  # the first caller exits the process
    backstop = threading.Timer(_BACKSTOP_S, os._exit, (code,))
    backstop.daemon = True
    backstop.start()
    if message is not None and not _quiet.is_set():
        line = _failure[0] if _failure else f"{_prefix()} error: {message}"
        with contextlib.suppress(OSError):
            os.write(2, (line + "\n").encode())
        _log_to_files(line)
    kill_engines()
    from miles.spmd.errors import _flush_and_exit

    _flush_and_exit(code)


def _log_to_files(line: str) -> None:
    """``line`` into the rank's log file (the console has it already), where one is configured."""
    import logging

    with contextlib.suppress(Exception):
        record = logging.LogRecord("miles.spmd.signals", logging.ERROR, __file__, 0, "%s", (line,), None)
        for handler in logging.getLogger("miles").handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)


def note_failure(line: str) -> None:
    """This rank failed (``line``: its one line) and is cleaning up: a SIGTERM that ends it meanwhile (the launcher
    saw another rank exit) prints this line, not its own, so the rank's real error is what it reports."""
    _failure[:] = [line]


def quiet() -> None:
    """run_main is reporting this rank's own failure: a SIGTERM that comes meanwhile adds no line."""
    _quiet.set()


def _on_sigterm() -> NoReturn:
    leave("stopped by SIGTERM: the launcher is ending the job (a rank failed, or the job was cancelled or "
          "interrupted); this rank's engine processes were killed with it.", 128 + signal.SIGTERM)


def _on_sigint() -> None:
    def late() -> None:
        leave(f"interrupted (SIGINT), and this rank did not stop within {INTERRUPT_GRACE_S:g}s (it was inside a "
              "collective or a native call); it left at once, with its engine processes.", 130)

    timer = threading.Timer(INTERRUPT_GRACE_S, late)
    timer.daemon = True
    timer.start()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _watch(fd: int) -> None:
    interrupted = False
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum == signal.SIGTERM:
                _on_sigterm()
            elif signum == signal.SIGINT and interrupted:
                leave("interrupted twice (SIGINT); left at once, with this rank's engine processes.", 130)
            elif signum == signal.SIGINT:
                interrupted = True
                _on_sigint()


def install() -> None:
    """SIGTERM and SIGINT handling of this rank (see the module docstring); once per process, main thread only."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm())
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when SIGINT is ignored (nohup, &)
        signal.signal(signal.SIGINT, _interrupt)  # not default_int_handler itself: asyncio.run would replace that
    r, w = os.pipe()  # not inherited by children (os.pipe is non-inheritable)
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter: the Python-level handler alone
        os.close(r)
        os.close(w)
    else:
        threading.Thread(target=_watch, args=(r,), name="miles-signals", daemon=True).start()
    _installed = True
