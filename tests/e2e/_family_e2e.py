"""What the model-family e2e tests (``test_<family>_e2e.py``) share: Miles's recorded command of a family at tiny CPU
scale, run for 2 rollouts on the quickstart's data and reward with the embedded engines, the weights checked after
every sync (``--check-weight-update-equal``). A family's test gives its flags and its tiny model; what every such run
must show is checked here.

    data = quickstart_data(tmp_dir, quickstart_prepared)              # in the module's setup fixture
    recs, text = run_two_rollouts([*TINY_SHAPE, *RECORDED], model=model, data=data, tmp_path=tmp_path)

or in its steps (``two_rollouts_cmd``, ``run``, ``check_two_rollouts``) where a test does more between them.

Commands replayed from a fixture (``miles_fixtures.tiny_replay``) run through ``run_replay``."""

from __future__ import annotations

import os
from pathlib import Path

from _miles_e2e import REPO, check_ok, check_run_dir, metrics, quickstart_copy, run, tail

TRAINER_LAYOUT = "TP 2 x PP 1 x DP 1"         # the families' recorded layouts scaled to 2 CPU ranks (TP 2, EP 2)
# weight-sync mode -> its flags and ranks (2 trainer ranks; colocated engines on them, or one engine rank of its own)
WEIGHT_SYNC_MODES = {
    "tensor": (["--colocate", "--num-gpus-per-node", "2"], 2),
    "broadcast": (["--rollout-num-gpus", "1", "--num-gpus-per-node", "3"], 3),
    "p2p": (["--rollout-num-gpus", "1", "--num-gpus-per-node", "3", "--update-weight-transfer-mode", "p2p"], 3),
    "disk-delta": (["--rollout-num-gpus", "1", "--num-gpus-per-node", "3", "--update-weight-transfer-mode",
                    "disk-delta"], 3),
}


def quickstart_data(d: Path, prepared: Path) -> Path:
    """The quickstart's data (``examples/quickstart/prepare.sh``'s, built once a session: tests/conftest.py's
    ``quickstart_prepared``) copied under ``d / "data"``."""
    return quickstart_copy(prepared, d / "data")


def weight_sync_flags(mode: str, tmp_path: Path) -> tuple[list[str], int]:
    """A ``WEIGHT_SYNC_MODES`` mode's flags (disk-delta's directory under ``tmp_path``) and number of ranks."""
    flags, nproc = WEIGHT_SYNC_MODES[mode]
    if mode == "disk-delta":
        flags = [*flags, "--update-weight-disk-dir", str(tmp_path / "deltas")]
    return flags, nproc


def two_rollouts_cmd(flags: list[str], *, model: Path, data: Path, out: Path, nproc: int = 2,
                     global_batch_size: int | None = 8) -> list[str]:
    """``torchrun`` of train.py with ``flags`` on ``nproc`` ranks: 2 rollouts of 4 quickstart prompts x 2 samples
    (4-token responses, the quickstart's reward) on ``model``, every weight sync checked, the run dir ``out``."""
    batch = ["--global-batch-size", str(global_batch_size)] if global_batch_size else []
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "train.py", *flags,
            "--hf-checkpoint", str(model), "--prompt-data", str(data / "train.jsonl"), "--input-key", "input",
            "--label-key", "label", "--rm-type", "quickstart", "--num-rollout", "2", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", *batch, "--rollout-max-response-len", "4",
            "--check-weight-update-equal", "--output-dir", str(out)]


def check_synced(log: Path, layout: str | None = TRAINER_LAYOUT) -> str:
    """The run's log (returned) names the trainer's ``layout`` (unless None) and holds a passed weight check for the
    first sync and one after each rollout."""
    text = log.read_text()
    assert layout is None or layout in text, tail(log)
    assert text.count("--check-weight-update-equal: ") >= 3, tail(log)   # initial sync + one per rollout
    return text


def check_two_rollouts(out: Path, log: Path, nproc: int = 2) -> tuple[list[dict], str]:
    """A ``two_rollouts_cmd`` run: its run dir (``check_run_dir``), 8 samples a rollout, ``check_synced``; the
    metrics records and the log's text."""
    recs = check_run_dir(out, num_rollout=2, num_ranks=nproc)
    assert all(r["rollout/num_samples"] == 8 for r in recs)
    return recs, check_synced(log)


def run_two_rollouts(flags: list[str], *, model: Path, data: Path, tmp_path: Path, nproc: int = 2,
                     timeout: float = 600, **env: str) -> tuple[list[dict], str]:
    """``two_rollouts_cmd`` run (run dir ``tmp_path / "run"``, log ``tmp_path / "run.log"``, ``env`` added) and
    checked (``check_two_rollouts``)."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    check_ok(run(two_rollouts_cmd(flags, model=model, data=data, out=out, nproc=nproc), log, timeout, **env), log)
    return check_two_rollouts(out, log, nproc)


def run_replay(replay, log: Path, *pythonpath: Path, timeout: float = 600) -> list[dict]:
    """``torchrun`` of a replayed fixture (a ``miles_fixtures.tiny_replay`` result; ``pythonpath``: its plugin
    folders besides the repository): it exits 0 (else its scaled flags and the log's tail) after rollouts 0 and 1,
    whose metrics records are returned."""
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(replay.nproc), replay.entry, *replay.argv]
    result = run(cmd, log, timeout=timeout, PYTHONPATH=os.pathsep.join(map(str, [REPO, *pythonpath])))
    scaled = "\n".join(f"  {flag}: {change}" for flag, change in replay.changed.items())
    assert result.returncode == 0, f"exit code {result.returncode}; scaled flags:\n{scaled}\nlog {log}:\n{tail(log)}"
    records = metrics(Path(replay.argv[replay.argv.index("--output-dir") + 1]))
    assert [r["rollout_id"] for r in records] == [0, 1], records
    return records
