"""Running the quickstart scripts and train.py from e2e tests: own process group, bounded, logged."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart"
REQUIRED_KEYS = ("rollout_id", "rollout/raw_reward", "rollout/response_len", "perf/rollout_time",
                 "perf/train_time", "perf/update_weights_time", "perf/step_time")


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"  # torchrun / python of this venv
    e.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
             PYTHON=sys.executable, **extra)
    return e


def run(cmd: list[str], log: Path, timeout: float, **extra_env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill exactly that process group; output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(**extra_env), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout}s; log {log}:\n{tail(log)}") from None
    return subprocess.CompletedProcess(cmd, rc)


def quickstart_copy(prepared: Path, dest: Path) -> Path:
    """A copy of ``prepared`` (tests/conftest.py's ``quickstart_prepared``: prepare.sh's model and data, built once a
    session) at ``dest``, the caller's own: what ``bash examples/quickstart/prepare.sh dest`` writes, without
    building it again."""
    shutil.copytree(prepared, dest)
    return dest


def tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def check_ok(result: subprocess.CompletedProcess, log: Path) -> None:
    assert result.returncode == 0, f"exit code {result.returncode}; log {log}:\n{tail(log)}"


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def check_run_dir(out_dir: Path, num_rollout: int, num_ranks: int, first: int = 0) -> list[dict]:
    """What every run leaves behind: one record per rollout with the required keys, config, logs, plot."""
    recs = metrics(out_dir)
    assert [r["rollout_id"] for r in recs] == list(range(first, first + num_rollout)), recs
    for r in recs:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, f"rollout {r['rollout_id']} lacks {missing}"
        assert r["perf/step_time"] > 0
    config = json.loads((out_dir / "config.json").read_text())
    assert config["run_plan"]["output_dir"] == str(out_dir)
    for rank in range(num_ranks):
        assert (out_dir / "logs" / f"rank{rank}.log").is_file(), f"no log for rank {rank}"
    assert (out_dir / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    if config["output"]["use_tensorboard"]:  # off by default, as in Miles
        assert list((out_dir / "tensorboard").glob("events.out.tfevents.*"))
    else:
        assert not (out_dir / "tensorboard").exists()
    return recs
