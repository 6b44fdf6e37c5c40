"""Helpers for the "a rank dies with its launcher" tests: find every process of one job, kill a launcher, time it.

Every process of a job carries ``MILES_TEST_TAG=<uuid>`` in its environment (inherited by ranks, engine
children and routers alike, even once re-parented), so the job's processes are found by reading
``/proc/<pid>/environ`` and nothing else is ever signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from spmd_helpers import REPO


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    comm: str
    cmdline: str


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged(tag: str) -> dict[int, Proc]:
    """Live (non-zombie) processes whose environment holds MILES_TEST_TAG=tag."""
    want = f"MILES_TEST_TAG={tag}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state not in ("Z", "X"):
            found[int(entry)] = Proc(int(entry), int(ppid), comm, cmd)
    return found


def kill_tagged(tag: str) -> None:
    """SIGKILL whatever of the job is left (test clean-up: only processes carrying our tag)."""
    for _ in range(3):
        left = tagged(tag)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


@dataclass
class Launched:
    proc: subprocess.Popen
    tag: str
    stdout: Path
    stderr: Path
    gone_after: dict | None = None  # process -> seconds after the kill it was last seen (kill_and_time_orphans)

    def text(self) -> str:
        return self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return self.text()[-n:]


def launch(cmd: list[str], env: dict[str, str], tag: str, out_dir: Path) -> Launched:
    """Start ``cmd`` in its own session with the tag in its environment; output to files (no pipe to fill)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out, err = out_dir / "launcher.out", out_dir / "launcher.err"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(env, MILES_TEST_TAG=tag), stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Launched(proc, tag, out, err)


def wait_until(job: Launched, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{job.tail()}")
        time.sleep(0.1)


def children_of(procs: dict[int, Proc], pid: int) -> list[Proc]:
    return [p for p in procs.values() if p.ppid == pid]


def kill_and_time_orphans(job: Launched, victim: int, bound: float, keep: set[int] = frozenset(),
                          sig: int = signal.SIGKILL) -> tuple[float, dict]:
    """Send ``sig`` (SIGKILL) to ``victim``; return (seconds until every other tagged process not in ``keep`` is
    gone, the processes seen just before). Fails, listing the survivors, if some are still there after ``bound`` s."""
    before = tagged(job.tag)
    assert victim in before, f"pid {victim} is not a process of this job: {before}"
    t0 = time.monotonic()
    os.kill(victim, sig)
    last: dict[int, float] = {}  # pid -> when it was last seen alive
    while True:
        left = {pid: p for pid, p in tagged(job.tag).items() if pid not in keep}
        elapsed = time.monotonic() - t0
        last.update({pid: elapsed for pid in left})
        if not left:
            job.gone_after = {f"{before[pid].comm}[{pid}]": round(t, 2) for pid, t in last.items() if pid in before}
            return elapsed, before
        if elapsed > bound:
            listing = "\n".join(f"  pid {p.pid} ppid {p.ppid} {p.comm}: {p.cmdline}" for p in left.values())
            raise AssertionError(f"{len(left)} process(es) of the job still alive {bound:g}s after "
                                 f"{signal.Signals(sig).name} of pid {victim} ({before[victim].comm}):\n{listing}\n"
                                 f"{job.tail()}")
        time.sleep(0.05)
