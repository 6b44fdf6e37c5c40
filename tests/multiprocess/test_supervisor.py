"""EngineSupervisor with real child processes: restarts, give-up, scrubbed env, process groups, death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.spmd.supervisor import EngineSupervisor

pytestmark = pytest.mark.multiprocess

# A stand-in engine: reports itself to a file, then sleeps (bounded).
CHILD = """
import json, os, sys, time
out = sys.argv[1]
with open(out + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "env": dict(os.environ)}, f)
os.replace(out + ".tmp", out)
print("engine says hello", flush=True)
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 120)
"""


def wait_until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def report(path: Path) -> dict:
    wait_until(path.exists, what=f"{path}")
    return json.loads(path.read_text())


def test_sigkilled_child_is_restarted_and_the_parent_lives_on(tmp_path, monkeypatch):
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                 "TORCHELASTIC_USE_AGENT_STORE": "True", "OMPI_COMM_WORLD_RANK": "3", "PMI_RANK": "3"}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "child.json"
    exits = []
    sup = EngineSupervisor([sys.executable, "-c", CHILD, str(out)], env={"MILES_ENGINE_ID": "7"}, name="engine7",
                           log_path=tmp_path / "engine.log", max_restarts=2, restart_backoff=0.05,
                           on_exit=lambda s, rc, again: exits.append((rc, again))).start()
    try:
        first = report(out)
        assert first["pid"] == sup.pid and sup.alive
        # scrubbed environment, plus what the caller added
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                    "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
            assert var not in first["env"]
        assert first["env"]["MILES_ENGINE_ID"] == "7"
        # its own process group: signals to it never reach us
        assert first["pgid"] == first["pid"] != os.getpgid(0)
        out.unlink()
        os.kill(first["pid"], signal.SIGKILL)  # the fault
        second = report(out)
        assert second["pid"] != first["pid"] and sup.pid == second["pid"] and sup.alive
        assert sup.restarts == 1 and not sup.given_up
        assert exits == [(-signal.SIGKILL, True)]
        assert not alive(first["pid"])
        wait_until(lambda: (tmp_path / "engine.log").read_text().count("engine says hello") == 2, what="log lines")
    finally:
        rc = sup.stop(timeout=5)
    assert rc == -signal.SIGTERM and not sup.alive


def test_gives_up_after_max_restarts_until_restart_is_called(tmp_path):
    exits = []
    sup = EngineSupervisor([sys.executable, "-c", "import sys; sys.exit(3)"], name="flaky", max_restarts=2,
                           restart_backoff=0.05, on_exit=lambda s, rc, again: exits.append((rc, again))).start()
    try:
        wait_until(lambda: sup.given_up, what="give-up")
        assert exits == [(3, True), (3, True), (3, False)]
        assert sup.restarts == 2 and sup.returncode == 3 and not sup.alive
        sup.restart()  # an operator (or the ft plane) tries again: a fresh budget
        wait_until(lambda: len(exits) == 6, what="the second round")
        assert sup.given_up and sup.restarts == 5
    finally:
        sup.stop(timeout=5)


def test_restart_replaces_a_running_child(tmp_path):
    out = tmp_path / "child.json"
    sup = EngineSupervisor([sys.executable, "-c", CHILD, str(out)], name="e", restart_backoff=0.05).start()
    try:
        first = report(out)["pid"]
        out.unlink()
        sup.restart(timeout=5)
        assert report(out)["pid"] != first and sup.restarts == 1 and sup.alive
        assert not alive(first)
    finally:
        sup.stop(timeout=5)


def test_stop_takes_down_the_engines_own_children(tmp_path):
    pids = tmp_path / "pids"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pids)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(120)\n")
    sup = EngineSupervisor([sys.executable, "-c", script], name="tree").start()
    wait_until(lambda: pids.exists() and pids.read_text().strip(), what="grandchild pid")
    grandchild, child = int(pids.read_text()), sup.pid
    sup.stop(timeout=5)
    wait_until(lambda: not alive(child) and not alive(grandchild), timeout=10, what="the engine's process group to exit")


def test_engine_dies_with_its_rank(tmp_path):
    """A rank killed hard (SIGKILL: no cleanup runs) leaves no engine behind (PR_SET_PDEATHSIG)."""
    out = tmp_path / "child.json"
    rank_program = (
        "import sys, time\n"
        "from miles.spmd.supervisor import EngineSupervisor\n"
        f"EngineSupervisor([sys.executable, '-c', {CHILD!r}, {str(out)!r}], name='e').start()\n"
        "time.sleep(120)\n")
    rank = subprocess.Popen([sys.executable, "-c", rank_program], start_new_session=True)
    try:
        child = report(out)["pid"]
        assert alive(child)
        rank.kill()
        rank.wait(timeout=10)
        wait_until(lambda: not alive(child), timeout=10, what="the orphaned engine to exit")
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(timeout=10)


def test_missing_command_raises_at_start():
    with pytest.raises(FileNotFoundError, match="/nonexistent/engine-binary"):
        EngineSupervisor(["/nonexistent/engine-binary"], name="none").start()
