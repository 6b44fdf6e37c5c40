"""Engine supervision: a rank starts its engine as a child process, restarts it, and outlives it.

The leader rank of each engine (one per node for a multi-node engine) runs
``EngineSupervisor(argv, env, ...)``. The command is pluggable: the embedded engine
(``python -m miles.engine ...``) or an SGLang server, built by the fleet (``miles.fleet.engines``).

- The child gets this process's environment with every launcher variable removed (torchrun's
  ``TORCHELASTIC_*`` would make its own rendezvous hang; ``RANK``/``MASTER_*``/``OMPI_*``/``PMI_*``
  would make it believe it is a rank of this job), then ``env`` on top.
- It runs in its own session and process group, so a signal to the engine (or a Ctrl-C in the
  terminal) never reaches the rank, and stopping the engine takes its helpers down with it. It gets
  SIGKILL when the supervising thread dies (PR_SET_PDEATHSIG), so a killed rank leaves no engine behind, even a
  stopped one (a SIGTERM would stay pending in a SIGSTOPped process for ever).
- One watcher thread spawns every child and waits on it. When the child exits it calls
  ``on_exit(supervisor, returncode, will_restart)``, kills leftovers of the child's process group,
  and starts a new child after ``restart_backoff * 2**k`` seconds (capped at 60 s), up to
  ``max_restarts`` times; then it gives up (``given_up``) until ``restart()`` or ``stop()``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from miles.utils.logging import get_logger

logger = get_logger(__name__)

SCRUB_EXACT = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
})
SCRUB_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "HYDRA_")
_MAX_BACKOFF = 60.0
_PR_SET_PDEATHSIG = 1
_live: weakref.WeakSet[EngineSupervisor] = weakref.WeakSet()

ExitCallback = Callable[["EngineSupervisor", int, bool], None]


def scrubbed_env(base: dict[str, str] | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: os.environ) without launcher variables, then ``extra`` on top."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in SCRUB_EXACT and not k.startswith(SCRUB_PREFIXES)}
    env.update(extra or {})
    return env


def _child_setup(parent_pid: int) -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class EngineSupervisor:
    def __init__(self, argv: list[str], env: dict[str, str] | None = None, name: str = "engine",
                 log_path: Path | None = None, max_restarts: int = 3, restart_backoff: float = 1.0,
                 on_exit: ExitCallback | None = None) -> None:
        if not argv:
            raise ValueError("EngineSupervisor needs a command (argv is empty)")
        self.argv = [str(a) for a in argv]
        self.env = dict(env or {})
        self.name = name
        self.log_path = Path(log_path) if log_path is not None else None
        self.max_restarts = max_restarts
        self.restart_backoff = restart_backoff
        self.on_exit = on_exit
        self.restarts = 0  # every respawn, automatic or by restart()
        self.given_up = False
        self.returncode: int | None = None  # of the last child that exited
        self._auto_restarts = 0
        self._proc: subprocess.Popen | None = None
        self._cond = threading.Condition()
        self._want_spawn = False
        self._manual = False
        self._stopping = False
        self._spawned = threading.Event()
        self._spawn_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public
    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    @property
    def alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    def start(self, timeout: float = 30.0) -> EngineSupervisor:
        """Start the watcher thread and the first child; returns once the child is spawned."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started")
        self._stopping = False
        self._spawned.clear()
        self._thread = threading.Thread(target=self._watch, name=f"supervise-{self.name}", daemon=True)
        with self._cond:
            self._want_spawn = True
        self._thread.start()
        if not self._spawned.wait(timeout):
            raise TimeoutError(f"{self.name}: the child was not spawned within {timeout:g} s")
        if self._spawn_error is not None:
            raise self._spawn_error
        _live.add(self)
        return self

    def restart(self, timeout: float = 10.0) -> None:
        """Replace the child now (also after giving up); resets the automatic restart budget.

        A running child gets SIGTERM (to its process group), and SIGKILL after ``timeout`` seconds.
        """
        with self._cond:
            self._auto_restarts = 0
            if self.given_up:
                self.given_up = False
                self.restarts += 1
                self._want_spawn = True
                self._cond.notify_all()
                return
            self._manual = True
            self._cond.notify_all()
            proc = self._proc
        self._terminate(proc, timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child process itself (fault injection in tests)."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill_now(self) -> None:
        """Stop supervising and SIGKILL the child's process group at once (a hung or stopped engine): no restart and
        no ``on_exit`` call follow."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        proc = self._proc
        if proc is not None:
            self._kill_leftovers(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        _live.discard(self)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop the child (SIGTERM to its group, SIGKILL after ``timeout``) and the watcher; returns its code."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        proc = self._proc
        self._terminate(proc, timeout)
        if proc is not None:
            self._kill_leftovers(proc.pid)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        _live.discard(self)
        return proc.returncode if proc is not None else None

    # ------------------------------------------------------------------ internals
    def _terminate(self, proc: subprocess.Popen | None, timeout: float) -> None:
        """SIGTERM (then SIGCONT) the running child's process group; SIGKILL it after ``timeout`` s (then wait at most
        5 s)."""
        if proc is None or proc.poll() is not None:
            return
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)  # a stopped engine (SIGSTOP, a debugger) acts on the SIGTERM only once resumed
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s: pid %d ignored SIGTERM for %g s; SIGKILL", self.name, proc.pid, timeout)
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def _signal_group(self, sig: int) -> None:
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)  # the child leads its own process group (start_new_session)

    def _kill_leftovers(self, pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def _spawn(self) -> None:
        out = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 - handed to the child
        try:
            parent = os.getpid()
            self._proc = subprocess.Popen(self.argv, env=scrubbed_env(extra=self.env), stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True, preexec_fn=lambda: _child_setup(parent))
        finally:
            if out is not None:
                out.close()
        logger.info("%s: started pid %d (%s)%s", self.name, self._proc.pid, shlex.join(self.argv).replace("\n", " ")[:160],
                    f", restart {self.restarts}" if self.restarts else "")

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not (self._want_spawn or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    break
                self._want_spawn = False
            try:
                self._spawn()
            except OSError as e:
                self._spawn_error = e
                self._spawned.set()
                logger.error("%s: cannot start %s: %s", self.name, self.argv[0], e)
                return
            self._spawned.set()
            proc = self._proc
            while proc.poll() is None:
                time.sleep(0.1)
            self.returncode = proc.returncode
            self._kill_leftovers(proc.pid)
            with self._cond:
                if self._stopping:
                    break
                if self._manual:
                    self._manual = False
                    self.restarts += 1
                    self._want_spawn = True
                    continue
                will_restart = self._auto_restarts < self.max_restarts
            logger.warning("%s: pid %d exited with code %s; %s", self.name, proc.pid, proc.returncode,
                           f"restarting ({self._auto_restarts + 1}/{self.max_restarts})" if will_restart
                           else f"giving up after {self.max_restarts} restart(s)")
            if self.on_exit is not None:
                try:
                    self.on_exit(self, proc.returncode, will_restart)
                except Exception:  # a broken callback must not kill supervision
                    logger.exception("%s: on_exit callback failed", self.name)
            with self._cond:
                if not will_restart and not self._manual:
                    self.given_up = True
                    continue  # wait for restart() or stop()
                delay = min(self.restart_backoff * (2 ** self._auto_restarts), _MAX_BACKOFF)
                self._cond.wait_for(lambda: self._stopping or self._manual, timeout=delay)
                if self._stopping:
                    break
                if self._manual:
                    self._manual = False
                else:
                    self._auto_restarts += 1
                self.restarts += 1
                self._want_spawn = True


def stop_all(timeout: float = 5.0) -> None:
    """Stop every running supervisor of this process (used on exit)."""
    for sup in list(_live):
        with contextlib.suppress(Exception):
            sup.stop(timeout)


def terminate_all(grace: float = 1.0) -> None:
    """Take every engine of this process down at once, now: SIGTERM to each child's process group, SIGKILL
    to the groups still there after ``grace`` seconds (``grace <= 0``: SIGKILL at once, as on the launcher's
    SIGTERM, signals.py). For a rank that is about to ``os._exit`` (its launcher is gone, lifeline.py; or it
    was told to end): it neither joins watcher threads nor restarts anything."""
    sups = list(_live)
    for sup in sups:
        with sup._cond:
            sup._stopping = True  # the watcher must not respawn the child it sees exit
            sup._cond.notify_all()
    procs = [sup._proc for sup in sups if sup._proc is not None and sup._proc.poll() is None]
    for proc in procs if grace > 0 else ():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once resumed
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for proc in procs:  # the group, not only the child: helpers it started die too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


atexit.register(stop_all)
