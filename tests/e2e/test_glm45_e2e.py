"""Miles's recorded GLM-4.5 / GLM-4.5-Air commands that a CPU box refuses on SGLang-only serving flags
(tests/fixtures/miles_scripts/megatron_moe_glm45_355b_a32b_8node.flags: TP 8 x PP 4 x CP 2 x EP 16, DeepEP, EAGLE
and DP-attention serving; p2p_profile_glm45_air.flags: PP 4 x EP 8, p2p weight transfer, EP serving) run for 2
rollouts at tiny scale through the replay tier's scaler (``miles_fixtures.tiny_replay``: a tiny ``glm4_moe`` model
with the recorded model's switches, the SGLang-only and absent-kernel flags dropped as for every fixture), with
``--check-weight-update-equal`` after every sync. The replay tier (tests/e2e/test_miles_replay.py) takes the
dry-run fixture ``megatron_moe_glm45_355b_a32b`` itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _miles_e2e import run, tail
from miles_fixtures import replay_params

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.replay, pytest.mark.timeout(900)]

NAMES = ("megatron_moe_glm45_355b_a32b_8node", "p2p_profile_glm45_air")


@pytest.mark.parametrize("name", replay_params(NAMES, in_make_test=("megatron_moe_glm45_355b_a32b_8node",)))
def test_recorded_glm45_command_runs_two_rollouts(name: str, tmp_path: Path) -> None:
    from miles_fixtures import HERE, PLUGIN_FOLDERS, tiny_replay

    replay = tiny_replay(HERE / f"{name}.flags", tmp_path, tmp_path / "models")
    argv = replay.argv
    assert any(f.startswith("--sglang-") for f in replay.changed), replay.changed
    log = tmp_path / "replay.log"
    pythonpath = os.pathsep.join([str(Path(__file__).resolve().parents[2]), *map(str, PLUGIN_FOLDERS)])
    result = run(["torchrun", "--standalone", "--nproc-per-node", str(replay.nproc), replay.entry, *argv], log,
                 timeout=600, PYTHONPATH=pythonpath)
    scaled = "\n".join(f"  {flag}: {change}" for flag, change in replay.changed.items())
    assert result.returncode == 0, f"scaled flags:\n{scaled}\nlog {log}:\n{tail(log)}"
    out = Path(argv[argv.index("--output-dir") + 1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["rollout_id"] for r in records] == [0, 1], records
    assert log.read_text().count("--check-weight-update-equal: ") >= 3, tail(log)
