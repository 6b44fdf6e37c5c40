"""Miles's recorded Qwen3-235B-A22B commands (tests/fixtures/miles_scripts/megatron_moe_qwen3_235b_a22b.flags,
int4_qwen3_235b_a22b.flags: TP 4 x PP 4 x CP 2 x EP 16 with --sequence-parallel) run for 2 rollouts at tiny scale
through the replay tier's scaler (``miles_fixtures.tiny_replay``). On a machine without SGLang their dry run is
refused by their SGLang-only serving flags (``--sglang-enable-dp-attention``, ``--sglang-ep-size``), so the replay
tier (tests/e2e/test_miles_replay.py, dry-run fixtures only) does not take them; here they run with those flags
dropped, as the tier drops them for every fixture: the colocated int4 command as TP 2 x PP 2 x EP 2 with
--sequence-parallel on 4 ranks, the disaggregated one as TP 2 x EP 2 on 2 trainer ranks and 2 engine ranks, with
``--check-weight-update-equal`` after every sync.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import check_synced, run_replay
from miles_fixtures import replay_params

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

# fixture -> the parallel sizes the replay runs (flag -> value), the trainer ranks
CASES = {
    "int4_qwen3_235b_a22b": ({"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
                              "--context-parallel-size": "1", "--expert-model-parallel-size": "2"}, 4),
    "megatron_moe_qwen3_235b_a22b": ({"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1",
                                      "--context-parallel-size": "1", "--expert-model-parallel-size": "2"}, 2),
}


# `make test` runs the int4 command (TP 2 x PP 2 x EP 2, colocated on 4 ranks); the disaggregated one (TP 2 x EP 2
# + 2 engine ranks, broadcast) runs under `make test-replay`: in `make test` the GLM-5 and Gemma 4 e2e tests run that
# trainer layout with a broadcast to an engine rank of its own (test_glm5_e2e.py, test_gemma4_moe_e2e.py), the
# quickstart's disaggregated runs broadcast to 2 engine ranks (test_quickstart.py, test_megatron_quickstart.py)
@pytest.mark.parametrize("name", replay_params(CASES, in_make_test=("int4_qwen3_235b_a22b",)))
def test_recorded_qwen3_235b_command_runs_two_rollouts(name: str, tmp_path: Path) -> None:
    from miles_fixtures import HERE, PLUGIN_FOLDERS, tiny_replay

    sizes, trainers = CASES[name]
    replay = tiny_replay(HERE / f"{name}.flags", tmp_path, tmp_path / "models")
    argv = replay.argv
    assert {f: argv[argv.index(f) + 1] for f in sizes} == sizes, replay.changed
    assert "--sequence-parallel" in argv and argv[argv.index("--actor-num-gpus-per-node") + 1] == str(trainers)
    assert any(f.startswith("--sglang-") for f in replay.changed), replay.changed
    log = tmp_path / "replay.log"
    run_replay(replay, log, *PLUGIN_FOLDERS)
    check_synced(log, layout=None)
