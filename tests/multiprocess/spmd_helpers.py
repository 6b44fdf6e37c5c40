"""Helpers for the launcher tests: run a launcher bounded in time, read the smoke test's lines.

Every process is started in its own session and, on timeout, only that session is killed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SMOKE = ["-m", "miles.spmd.smoke"]
_LINE = re.compile(r"^SMOKE OK (.*)$", re.M)


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def find_open_mpi() -> str | None:
    """Open MPI's mpirun (Debian's openmpi-bin), or None."""
    exe = shutil.which("mpirun")
    if not exe:
        return None
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if "Open MPI" in version else None


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MILES_LOG_LEVEL="INFO")
    env.update(extra)
    return env


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env or job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float, t0: float) -> Job:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started, nothing else
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"timed out after {timeout}s: {proc.args}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}") from None
    return Job(proc.returncode, out, err, time.monotonic() - t0)


def run(cmd: list[str], timeout: float = 180, env: dict[str, str] | None = None) -> Job:
    t0 = time.monotonic()
    return finish(start(cmd, env), timeout, t0)


def smoke_lines(text: str) -> dict[int, dict[str, str]]:
    """rank -> fields of its ``SMOKE OK key=value ...`` line."""
    lines = {}
    for m in _LINE.finditer(text):
        fields = dict(kv.split("=", 1) for kv in m.group(1).split())
        lines[int(fields["rank"])] = fields
    return lines


def assert_smoke(job: Job, world_size: int, launcher: str) -> dict[int, dict[str, str]]:
    assert job.returncode == 0, f"exit {job.returncode}\n--- stdout\n{job.stdout[-3000:]}\n--- stderr\n{job.stderr[-6000:]}"
    lines = smoke_lines(job.stdout)
    assert sorted(lines) == list(range(world_size)), f"ranks reporting: {sorted(lines)}\n{job.output[-4000:]}"
    assert {f["launcher"] for f in lines.values()} == {launcher}
    assert len({f["plan"] for f in lines.values()}) == 1, "ranks built different plans"
    return lines


def roles(lines: dict[int, dict[str, str]]) -> dict[int, set[str]]:
    return {r: set(f["roles"].split(",")) for r, f in lines.items()}
