"""Run a multi-process test file as its own ``torchrun`` worker script (the file re-enters through its
``__main__`` branch), with one thread per rank and this folder and ``tests/`` (``trainer_harness.py``) importable from the workers.

The ranks are forked from one server per pytest session (``_zygote.py``) that has imported torch,
transformers, megatron-core and the trainers already: a launch skips ``torchrun``'s start and every rank's
imports (~5-7 s a rank on the 2-core CI box). The ranks see torchrun's environment and its failure handling
(the first failing rank stops the others; the launch returns 1) and leave as real ranks do, up to the
interpreter's last teardown (``_zygote.py`` says what differs). ``MILES_TEST_REAL_TORCHRUN=1`` (``make test-real``;
tests/suite_policy.py sets it for every test marked ``gpu``), and any launch whose arguments name ``cuda``, go through
``python -m torch.distributed.run`` instead: CUDA cannot be initialised in a rank forked after the imports."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_server: subprocess.Popen | None = None


def _env(script: Path, extra_env: dict | None) -> dict:
    """The ranks' environment. A ``PYTHONPATH`` in ``extra_env`` is added to the test folders (the script's,
    tests/multiprocess, tests/: the harness modules), never put in their place: under the fork server the ranks
    inherit the server's path, under real torchrun only this one (a test that replaced it failed there alone)."""
    extra = dict(extra_env or {})
    given = [extra.pop("PYTHONPATH")] if extra.get("PYTHONPATH") else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(script.parent), str(HERE), str(HERE.parent), *given,
                                          os.environ.get("PYTHONPATH", "")])}
    env.update(extra)
    return env


def _start_server() -> subprocess.Popen:
    global _server
    if _server is not None and _server.poll() is None:
        return _server
    env = _env(HERE / "_zygote.py", None)
    _server = subprocess.Popen([sys.executable, str(HERE / "_zygote.py")], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=_server_log(), text=True, bufsize=1,
                               start_new_session=True)
    atexit.register(_stop_server, _server)
    ready = _server.stdout.readline()
    if not ready:
        raise RuntimeError(f"the test fork server exited with {_server.wait()} before it was ready")
    return _server


def _server_log():
    return open(os.path.join(tempfile.gettempdir(), f"miles_test_zygote_{os.getpid()}.log"), "w")


def _stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def _read(server: subprocess.Popen, deadline: float | None) -> dict | None:
    """The server's next reply; None when ``deadline`` passes first."""
    import time

    while True:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            return None
        ready, _, _ = select.select([server.stdout], [], [], wait)
        if ready:
            line = server.stdout.readline()
            if not line:
                raise RuntimeError(f"the test fork server died (exit {server.wait()})")
            return json.loads(line)


def torchrun(script: Path, nproc: int, port: int, *args: str, timeout: int, env: dict | None = None,
             cwd: str | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node=nproc script *args`` on 127.0.0.1:``port``; stdout and stderr of every rank
    come back together in ``stdout``, through a file, not a pipe: CPU shared-memory tensors start torch's
    ``torch_shm_manager``, which inherits the workers' stdout and would hold a pipe open. ``env``: extra
    variables for the ranks. A launch past ``timeout`` is killed and raises ``subprocess.TimeoutExpired``."""
    import time

    script = Path(script).resolve()
    full_env = _env(script, env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(script), *args]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        if os.environ.get("MILES_TEST_REAL_TORCHRUN") == "1" or "cuda" in args:   # GPU runs: no fork after imports
            proc = subprocess.run(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout, cwd=cwd)
            log.seek(0)
            proc.stdout, proc.stderr = log.read(), ""
            return proc
        server = _start_server()
        server.stdin.write(json.dumps({"script": str(script), "args": list(args), "nproc": nproc, "port": port,
                                       "env": full_env, "cwd": cwd or os.getcwd(), "log": log.name}) + "\n")
        server.stdin.flush()
        deadline = time.monotonic() + timeout
        pids = _read(server, None)["pids"]
        reply = _read(server, deadline)
        if reply is None:                                # as subprocess.run's timeout: kill, then raise
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _read(server, None)
            log.seek(0)
            raise subprocess.TimeoutExpired(cmd, timeout, output=log.read())
        log.seek(0)
        return subprocess.CompletedProcess(cmd, reply["rc"], log.read(), "")


def torchrun_self(script: Path, nproc: int, port: int, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """``torchrun`` of the test file ``script`` itself (see ``torchrun``)."""
    return torchrun(script, nproc, port, *args, timeout=timeout)
