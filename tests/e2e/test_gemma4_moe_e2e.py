"""Gemma 4 MoE end to end on CPU: Miles's recorded gemma-4-26B-A4B command (tests/fixtures/miles_scripts/
megatron_gemma_4_26b_a4b.flags, radixark/miles@v0.1.0:scripts/run_gemma_4_26b_a4b.py) scaled by the replay tier's
``tiny_replay`` to the tiny Gemma 4 with the MoE block (``miles.utils.tiny_gemma4``, ``moe=True``) and its 8-GPU world
to 2 CPU ranks (TP 2 with sequence parallelism and EP 2 over the same ranks, as its TP 4 / EP 8; colocated). Every
other recorded flag runs as recorded, among them ``--use-rollout-routing-replay`` (R3: the embedded engines serving
Gemma4ForConditionalGeneration return each token's experts, the Megatron routers replay them) and
``--attention-backend unfused``; ``--moe-grouped-gemm`` is dropped where transformer-engine does not import (refused
there by name), as in the replay tier. 2 rollouts, a weight sync after each under ``--check-weight-update-equal``
(the engines hold exactly the trainer's weights: HF names, fused experts), colocated (``tensor``, as recorded) and
with one engine rank of its own (``broadcast``: the ``model.language_model.*`` names and re-joined fused experts in
the broadcast buckets, R3's routed experts from that engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import check_synced, run_replay, weight_sync_flags
from miles_fixtures import HERE, _drop, _flags, _set, tiny_replay

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

FIXTURE = HERE / "megatron_gemma_4_26b_a4b.flags"


@pytest.mark.parametrize("mode", ["tensor", "broadcast"])
def test_gemma4_moe_recorded_command_runs_two_rollouts(tmp_path: Path, mode: str) -> None:
    replay = tiny_replay(FIXTURE, tmp_path / "work", tmp_path / "models")
    assert replay.changed["--tensor-model-parallel-size"] == "4 -> 2", replay.changed
    assert replay.changed["--expert-model-parallel-size"] == "8 -> 2", replay.changed
    assert "--use-rollout-routing-replay" in replay.argv and "--sequence-parallel" in replay.argv
    assert "--colocate" in replay.argv and replay.nproc == 2, (replay.nproc, replay.changed)
    if mode != "tensor":                # the recorded --colocate -> the mode's own engine rank
        flags, replay.nproc = weight_sync_flags(mode, tmp_path)
        argv = _drop(replay.argv, "--colocate")
        for flag, values in _flags(flags).items():
            argv = _set(argv, flag, *values)
        replay.argv = argv
    log = tmp_path / "run.log"
    run_replay(replay, log)
    text = check_synced(log)
    assert "routing replay (R3, --use-rollout-routing-replay): 5 MoE routers" in text, text[-3000:]
