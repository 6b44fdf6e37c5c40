"""Launching ``train.py`` under torchrun with injected faults, and reading back what happened.

Shared by ``tests/e2e/test_fault_tolerance.py`` and ``benchmarks/ft_soak.py``. The faults themselves are
injected inside the driver by ``tests/e2e/ft_plugins.py`` (engines) or from here (trainer ranks). Only
processes of the launched job are ever signalled: they are found among the descendants of the
torchrun process this module started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "tests.e2e.ft_plugins.long_generate"


def quickstart_flags(data: Path, *, num_rollout: int, batch: int, n: int, response_len: int) -> list[str]:
    """GRPO on the quickstart data with ``n`` samples per prompt and one optimizer step per rollout."""
    return ["--hf-checkpoint", str(data / "model"), "--prompt-data", str(data / "train.jsonl"), "--input-key", "input",
            "--label-key", "label", "--rollout-shuffle", "--rm-type", "quickstart", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n), "--global-batch-size", str(batch * n),
            "--rollout-max-response-len", str(response_len), "--rollout-temperature", "1.0",
            "--advantage-estimator", "grpo", "--lr", "1e-3", "--skip-eval-before-train", "--eval-interval", "0",
            "--no-progress", "--custom-generate-function-path", PLUGIN]


def ft_flags(interval: float = 1.0, timeout: float = 3.0, first_wait: float = 120.0) -> list[str]:
    return ["--use-fault-tolerance", "--rollout-health-check-interval", str(interval),
            "--rollout-health-check-timeout", str(timeout), "--rollout-health-check-first-wait", str(first_wait)]


def layout_flags(trainers: int, engines: int) -> list[str]:
    return ["--train-backend", "fsdp", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(trainers), "--rollout-num-gpus", str(engines),
            "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", str(trainers + engines)]


@dataclass
class Job:
    proc: subprocess.Popen
    log: Path
    record: Path
    started: float

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"train.py did not finish within {timeout:.0f}s; log tail:\n{tail(self.log)}") from None

    def kill(self) -> None:
        """SIGKILL the whole job (torchrun leads its own session)."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass


def find_nvrx() -> Path | None:
    """Where nvidia-resiliency-ext (ft_launcher) is importable from: this interpreter's site-packages, or the
    prefix `make setup` installs it into (.venv/nvrx, kept apart so its pynvml shim never reaches the suite)."""
    import importlib.util

    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        return Path(importlib.util.find_spec("nvidia_resiliency_ext").origin).parents[1]
    prefix = REPO / ".venv" / "nvrx"
    return prefix if (prefix / "nvidia_resiliency_ext").is_dir() else None


def launch(flags: list[str], *, nproc: int, workdir: Path, faults: list[dict] | None = None, max_restarts: int = 0,
           env: dict[str, str] | None = None, launcher: list[str] | None = None, nvrx: Path | None = None) -> Job:
    """``torchrun --standalone --nproc-per-node N [--max-restarts R] train.py FLAGS`` in its own session;
    ``launcher`` replaces ``torchrun`` (e.g. ft_launcher and its options), ``nvrx`` joins PYTHONPATH."""
    workdir.mkdir(parents=True, exist_ok=True)
    log, record = workdir / "torchrun.log", workdir / "record.jsonl"
    path = [str(REPO), *([str(nvrx)] if nvrx else []), os.environ.get("PYTHONPATH", "")]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join(path),
                "MILES_FT_RECORD": str(record), "MILES_FT_FAULTS": json.dumps(faults or []), **(env or {})}
    argv = [*(launcher or [sys.executable, "-m", "torch.distributed.run"]), "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", str(max_restarts), str(REPO / "train.py"), *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Job(proc, log, record, time.time())


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def rank_pid(job: Job, rank: int) -> int | None:
    """The pid of the job's train.py process with RANK=rank (the current attempt's)."""
    for pid in descendants(job.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train.py" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def records(job: Job) -> tuple[list[dict], list[dict]]:
    """(samples, faults) recorded by the plugin so far."""
    if not job.record.exists():
        return [], []
    rows = [json.loads(line) for line in job.record.read_text().splitlines() if line.strip()]
    return [r for r in rows if "rollout_id" in r], [r for r in rows if "fault" in r]


def sample_census(samples: list[dict], pid: int | None = None) -> Counter:
    """How many times each (rollout, group, index) finished (in one attempt's process when ``pid``)."""
    return Counter((s["rollout_id"], s["group"], s["index"]) for s in samples if pid is None or s["pid"] == pid)


def metrics(workdir: Path) -> list[dict]:
    path = workdir / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def ft_events(workdir: Path) -> list[dict]:
    path = workdir / "run" / "ft_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
