"""Inkling end to end on CPU: Miles's recorded Inkling command (radixark/miles@v0.1.0:tests/snapshots/launch_scripts/
py/scripts/run_inkling.py/train.txt, the fixture ``megatron_inkling``) at tiny scale (``tiny_replay``: the tiny Inkling
text model, ``miles.utils.tiny_inkling``, in the text-only layout the embedded engine serves; its 4 GPUs at 2 CPU
ranks, TP 2 + sequence parallelism, colocated as recorded), with Miles's ``--custom-model-provider-path
miles_plugins.models.inkling.model.inkling_model_provider`` naming the Inkling family (built in its place): 2
rollouts with a weight sync after each under ``--check-weight-update-equal`` (every tensor the trainer exports equals
the engine's).

What is not built here is left out, each refused in one line on its own (``tests/unit/config/
test_miles_scripts.py::test_inkling_command_keeps_its_disk_offload_flags``, which keeps the disk-offload flags):
R3 (``--use-rollout-routing-replay``: the embedded engine does not record Inkling's experts); the recorded EP 4
runs as EP 2 on the replay's 2 ranks (x TP 2, as recorded: EP over the TP ranks); ``--offload-train-target disk`` and its
``--offload-train-disk-dir`` (built on both backends, accepted by that dry run, run in tests/multiprocess/
test_offload_disk.py) are left out of this replay to keep it short; ``--load`` (Miles's torch_dist conversion, which
the fixture gives as the HF directory) is dropped: training starts from ``--hf-checkpoint``; ``--model-name inkling`` (the released checkpoint's ``InklingConfig``) names the text layout's
model instead (``inkling_text``). The SGLang-only serving flags are dropped by the replay, as for every fixture.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _miles_e2e import check_ok, run
from miles_fixtures import HERE, PLUGIN_FOLDERS, _set, tiny_replay

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1200)]

FIXTURE = HERE / "megatron_inkling.flags"
NOT_BUILT = ("--offload-train-target", "--offload-train-disk-dir", "--use-rollout-routing-replay", "--load")


def test_inkling_recorded_command_runs_two_rollouts(tmp_path: Path) -> None:
    # the fixture less the flags not built (the replay parses the command as it scales it)
    lines = FIXTURE.read_text().splitlines()
    kept = [ln for ln in lines if ln.split(" ", 1)[0] not in NOT_BUILT]
    assert len(lines) - len(kept) == len(NOT_BUILT)
    fixture = tmp_path / FIXTURE.name
    fixture.write_text("\n".join(kept) + "\n")
    replay = tiny_replay(fixture, tmp_path, tmp_path / "models")
    argv = replay.argv
    assert "--custom-model-provider-path" in argv and "--colocate" in argv and "--sequence-parallel" in argv
    argv = _set(argv, "--expert-model-parallel-size", "2")   # the recorded EP 4 at the replay's 2 ranks (x TP 2)
    # the text layout's model (config class InklingTextConfig): the recorded name is the released checkpoint's
    argv = _set(argv, "--model-name", "inkling_text")
    log = tmp_path / "run.log"
    pythonpath = os.pathsep.join([str(Path(__file__).resolve().parents[2]), *map(str, PLUGIN_FOLDERS)])
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(replay.nproc), replay.entry, *argv]
    check_ok(run(cmd, log, timeout=900, PYTHONPATH=pythonpath), log)
    out = Path(argv[argv.index("--output-dir") + 1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["rollout_id"] for r in records] == [0, 1], records
    text = log.read_text()
    assert "TP 2 x PP 1 x DP 1 (EP 2)" in text, text[-3000:]
    assert text.count("--check-weight-update-equal: ") >= 3, text[-3000:]   # initial sync + one per rollout
