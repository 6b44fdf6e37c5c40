"""A fork server for the multi-process tests: imports torch, transformers, megatron-core and the trainers once,
then forks each ``torchrun``-style launch's ranks from that state, so a launch does not pay the ~5-7 s of imports
per rank (and ~2 s for ``torchrun`` itself) again. Started by ``_torchrun.py``, one per pytest session.

Protocol (one launch at a time): the parent writes one JSON line to our stdin
(``script``, ``args``, ``nproc``, ``port``, ``env``, ``cwd``, ``log``); we fork the ranks, answer
``{"pids": [...]}`` and, once every rank has exited, ``{"rc": n}``. The ranks get torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...) and run ``script`` as ``__main__`` with
``sys.argv = [script, *args]``, stdout and stderr appended to ``log``. As torchrun's agent does: the first rank
to fail (nonzero exit or a signal) gets the others stopped (SIGTERM, SIGKILL after 5 s) and the launch
returns 1; all ranks exiting 0 returns 0. Nothing here runs torch code: the forked state is imports only
(one thread, no process group).

How a rank ends, against a rank under real ``torchrun`` (a fresh interpreter): as there, an uncaught exception
prints its traceback and exits 1, ``SystemExit`` gives its code, then the non-daemon threads are joined
(``threading._shutdown``, what the interpreter's finalisation does first) and the ``atexit`` functions run,
then stdout and stderr are flushed. Unlike there, the rank then leaves with ``os._exit``: the interpreter's
last teardown (garbage collection of what is left, ``__del__`` of objects still alive, closing files still
open and unflushed) does not run. Code whose exit relies on that behaves differently here;
``MILES_TEST_REAL_TORCHRUN=1`` runs every launch under ``torchrun`` (``make test-real``).

CUDA: importing megatron-core (and some transformers modules) here may initialise CUDA on a GPU machine, and
a forked child then cannot ("Cannot re-initialize CUDA in forked subprocess"). GPU launches never come here:
``_torchrun.py`` sends launches whose arguments name ``cuda``, and tests/suite_policy.py every test marked
``gpu``, to real ``torchrun``."""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import signal
import sys
import threading
import time
import traceback
import warnings

PRELOAD = ("torch", "torch.distributed", "torch.distributed.device_mesh", "safetensors.torch", "transformers",
           "miles.trainer.megatron", "megatron.core", "miles.config", "miles.trainer.fsdp", "miles.trainer.megatron.trainer")


def _preload() -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:       # noqa: BLE001 -- optional (megatron-core absent): the rank imports it or skips
            pass
    try:
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401 -- lazy modules, resolved now
    except Exception:           # noqa: BLE001
        pass


def _rank(req: dict, rank: int, proto_fds: tuple[int, ...]) -> None:
    """The forked rank: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)                      # its own process group: a timeout kills it and its children
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in {log, null, *proto_fds} - {0, 1, 2}:
            os.close(fd)
        nproc = req["nproc"]
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(req["port"]), "TORCHELASTIC_RESTART_COUNT": "0",
                           "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"})
        os.chdir(req["cwd"])
        random.seed()                        # a fresh interpreter's seeding, not the server's state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        script = req["script"]
        sys.path[0] = os.path.dirname(script)
        for p in reversed([p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]):
            if p not in sys.path:
                sys.path.insert(1, p)
        sys.argv = [script, *req["args"]]
        warnings.resetwarnings()
        if req["env"].get("PYTHONWARNINGS") == "ignore":
            warnings.simplefilter("ignore")
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:               # noqa: BLE001
            traceback.print_exc()
            code = 1
        threading._shutdown()                # as the interpreter's exit: join the non-daemon threads...
        atexit._run_exitfuncs()              # ...then the atexit functions
    except BaseException:                   # noqa: BLE001
        try:
            traceback.print_exc()
        except BaseException:               # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pids: list[int], log: str) -> int:
    """torchrun's agent: all 0 -> 0; the first failure stops the rest -> 1."""
    alive, failed, deadline = set(pids), False, None
    while alive:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed and deadline is not None and time.monotonic() > deadline:
                for p in alive:
                    _signal_group(p, signal.SIGKILL)
                deadline = None
            time.sleep(0.02)
            continue
        if pid not in alive:
            continue
        alive.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = True
            with open(log, "a") as f:
                why = f" ({signal.Signals(-code).name})" if code < 0 else ""
                f.write(f"[zygote] rank {pids.index(pid)} (pid {pid}) exited with {code}{why}; stopping the "
                        f"others\n")
            for p in alive:
                _signal_group(p, signal.SIGTERM)
            deadline = time.monotonic() + 5
    return 1 if failed else 0


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main() -> None:
    _preload()
    assert threading.active_count() == 1, threading.enumerate()
    inp, out = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), 1)           # stray prints of ours go to stderr, never into the protocol
    reply = os.fdopen(out, "w", buffering=1)
    reader = os.fdopen(inp, "r")
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in reader:
        if not line.strip():
            continue
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(req["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(req, rank, (inp, out))
            pids.append(pid)
        reply.write(json.dumps({"pids": pids}) + "\n")
        reply.write(json.dumps({"rc": _wait(pids, req["log"])}) + "\n")


if __name__ == "__main__":
    main()
