"""Kimi-K2.5 end to end on CPU: Miles's recorded Kimi-K2.5 command (radixark/miles@v0.1.0:tests/snapshots/
launch_scripts/py/scripts/run_kimi_k25.py/train.txt, the fixture ``megatron_kimi_k25``) at tiny scale (``tiny_replay``:
a tiny Kimi-K2.5 of the published multimodal layout with K2.5's own YaRN rope, its 8 GPUs at 2 CPU trainer ranks with
TP 2 + sequence parallelism and EP 2, as its TP 8 / EP 8), the embedded engines serving the checkpoint on the generic
transformers path: 2 rollouts with a weight sync after each under ``--check-weight-update-equal`` (every tensor the
trainer exports, under the checkpoint's ``language_model.*`` names, equals the engine's), in each weight-sync mode:
``tensor`` (colocated, as recorded), ``broadcast``, ``p2p`` and ``disk-delta`` (one engine rank of its own).

Every recorded flag is kept (``--model-name kimi_k25``, ``--use-dynamic-global-batch-size``, ``--optimizer-cpu-offload``
with ``--use-distributed-optimizer`` at one data-parallel rank, ``--use-rollout-routing-replay``, ...) but the SGLang-only
serving flag ``--sglang-ep-size``, which the embedded engines have no setting for (the fixture's expectation on a
machine without SGLang; the replay drops it, as it does for every fixture). The reward is the recorded ``deepscaler``
one on the replay's arithmetic prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _miles_e2e import check_ok, run
from miles_fixtures import HERE, PLUGIN_FOLDERS, _drop, _set, replay_params, tiny_replay

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1200)]

FIXTURE = HERE / "megatron_kimi_k25.flags"
# weight-sync mode -> (flags set, flags dropped, ranks): 2 trainer ranks; colocated engines on them, or one of its own
MODES = {
    "tensor": ({}, (), 2),
    "broadcast": ({"--rollout-num-gpus": ["1"], "--num-gpus-per-node": ["3"]}, ("--colocate",), 3),
    "p2p": ({"--rollout-num-gpus": ["1"], "--num-gpus-per-node": ["3"], "--update-weight-transfer-mode": ["p2p"]},
            ("--colocate",), 3),
    "disk-delta": ({"--rollout-num-gpus": ["1"], "--num-gpus-per-node": ["3"],
                    "--update-weight-transfer-mode": ["disk-delta"]}, ("--colocate",), 3),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("k25_models")


# `make test` runs the recorded colocated mode; the other modes run under `make test-replay` (the other families'
# e2e tests carry each mode in `make test`: docs/benchmarks.md, "The CPU suite")
@pytest.mark.parametrize("mode", replay_params(MODES, in_make_test=("tensor",)))
def test_kimi_k25_recorded_command_runs_two_rollouts(models: Path, tmp_path: Path, mode: str) -> None:
    replay = tiny_replay(FIXTURE, tmp_path, models)
    argv = replay.argv
    assert "--use-distributed-optimizer" in argv and "--sglang-ep-size" in replay.changed, replay.changed
    sets, drops, nproc = MODES[mode]
    for flag in drops:
        argv = _drop(argv, flag)
    for flag, values in sets.items():
        argv = _set(argv, flag, *values)
    if mode == "disk-delta":
        argv = _set(argv, "--update-weight-disk-dir", str(tmp_path / "deltas"))
    log = tmp_path / "run.log"
    pythonpath = os.pathsep.join([str(Path(__file__).resolve().parents[2]), *map(str, PLUGIN_FOLDERS)])
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), replay.entry, *argv]
    check_ok(run(cmd, log, timeout=900, PYTHONPATH=pythonpath), log)
    out = Path(argv[argv.index("--output-dir") + 1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["rollout_id"] for r in records] == [0, 1], records
    text = log.read_text()
    assert "TP 2 x PP 1 x DP 1" in text, text[-3000:]
    assert text.count("--check-weight-update-equal: ") >= 3, text[-3000:]   # initial sync + one per rollout
