"""Miles's recorded GLM-4.5 / GLM-4.5-Air commands that a CPU box refuses on SGLang-only serving flags
(tests/fixtures/miles_scripts/megatron_moe_glm45_355b_a32b_8node.flags: TP 8 x PP 4 x CP 2 x EP 16, DeepEP, EAGLE
and DP-attention serving; p2p_profile_glm45_air.flags: PP 4 x EP 8, p2p weight transfer, EP serving) run for 2
rollouts at tiny scale through the replay tier's scaler (``miles_fixtures.tiny_replay``: a tiny ``glm4_moe`` model
with the recorded model's switches, the SGLang-only and absent-kernel flags dropped as for every fixture), with
``--check-weight-update-equal`` after every sync. The replay tier (tests/e2e/test_miles_replay.py) takes the
dry-run fixture ``megatron_moe_glm45_355b_a32b`` itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import check_synced, run_replay
from miles_fixtures import replay_params

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.replay, pytest.mark.timeout(900)]

NAMES = ("megatron_moe_glm45_355b_a32b_8node", "p2p_profile_glm45_air")


@pytest.mark.parametrize("name", replay_params(NAMES, in_make_test=("megatron_moe_glm45_355b_a32b_8node",)))
def test_recorded_glm45_command_runs_two_rollouts(name: str, tmp_path: Path) -> None:
    from miles_fixtures import HERE, PLUGIN_FOLDERS, tiny_replay

    replay = tiny_replay(HERE / f"{name}.flags", tmp_path, tmp_path / "models")
    assert any(f.startswith("--sglang-") for f in replay.changed), replay.changed
    log = tmp_path / "replay.log"
    run_replay(replay, log, *PLUGIN_FOLDERS)
    check_synced(log, layout=None)
