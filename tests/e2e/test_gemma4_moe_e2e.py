"""Gemma 4 MoE end to end on CPU: Miles's recorded gemma-4-26B-A4B command (tests/fixtures/miles_scripts/
megatron_gemma_4_26b_a4b.flags, radixark/miles@v0.1.0:scripts/run_gemma_4_26b_a4b.py) scaled by the replay tier's
``tiny_replay`` to the tiny Gemma 4 with the MoE block (``miles.utils.tiny_gemma4``, ``moe=True``) and its 8-GPU world
to 2 CPU ranks (TP 2 with sequence parallelism and EP 2 over the same ranks, as its TP 4 / EP 8; colocated). Every
other recorded flag runs as recorded, among them ``--use-rollout-routing-replay`` (R3: the embedded engines serving
Gemma4ForConditionalGeneration return each token's experts, the Megatron routers replay them) and
``--attention-backend unfused``; ``--moe-grouped-gemm`` is dropped where transformer-engine does not import (refused
there by name), as in the replay tier. 2 rollouts, a weight sync after each under ``--check-weight-update-equal``
(the engines hold exactly the trainer's weights: HF names, fused experts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _miles_e2e import run, tail
from miles_fixtures import HERE, tiny_replay

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

FIXTURE = HERE / "megatron_gemma_4_26b_a4b.flags"


def test_gemma4_moe_recorded_command_runs_two_rollouts(tmp_path: Path) -> None:
    replay = tiny_replay(FIXTURE, tmp_path / "work", tmp_path / "models")
    assert replay.changed["--tensor-model-parallel-size"] == "4 -> 2", replay.changed
    assert replay.changed["--expert-model-parallel-size"] == "8 -> 2", replay.changed
    assert "--use-rollout-routing-replay" in replay.argv and "--sequence-parallel" in replay.argv
    log = tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(replay.nproc), replay.entry, *replay.argv]
    result = run(cmd, log, timeout=600, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    assert result.returncode == 0, f"exit code {result.returncode}; log {log}:\n{tail(log)}"
    out = Path(replay.argv[replay.argv.index("--output-dir") + 1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["rollout_id"] for r in records] == [0, 1], records
    text = log.read_text()
    assert "TP 2 x PP 1 x DP 1" in text, tail(log)
    assert "routing replay (R3, --use-rollout-routing-replay): 5 MoE routers" in text, tail(log)
    assert text.count("--check-weight-update-equal: ") >= 3, tail(log)   # the first sync and one per rollout
