"""Miles's recorded multi-latent attention commands with context and pipeline parallelism (tests/fixtures/miles_scripts/
megatron_deepseek_v3.flags: CP 4 x EP 4 with --sequence-parallel; megatron_kimi_k2.flags: TP 8 x PP 8 x CP 4 x EP 32
with --sequence-parallel and an uneven last stage) run for 2 rollouts at tiny scale through the replay tier's scaler
(``miles_fixtures.tiny_replay``: a tiny model of the family with the recorded model's YaRN rope, parallel sizes at
most 2 on at most 4 ranks). On a machine without SGLang their dry run is refused by their SGLang-only serving flags
(``--sglang-ep-size``, ``--sglang-enable-dp-attention``), so the replay tier (tests/e2e/test_miles_replay.py, dry-run
fixtures only) does not take them; here they run with those flags dropped, as the tier drops them for every fixture:
DeepSeek-V3's command as CP 2 x EP 2 (the EP group is the CP pair) on 2 colocated ranks, Kimi-K2's as TP 2 x PP 2 x
EP 2 with --sequence-parallel on 4 colocated ranks (CP halved to 1 first by the 4-rank budget; its 3 tiny layers split
2 + 1 as the recorded ``--decoder-last-pipeline-num-layers`` splits the real 61), with ``--check-weight-update-equal``
after every sync.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import check_synced, run_replay
from miles_fixtures import replay_params

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.replay, pytest.mark.timeout(900)]

# fixture -> the parallel sizes the replay runs (flag -> value), the trainer ranks, the trainer layout it logs
CASES = {
    "megatron_deepseek_v3": ({"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
                              "--context-parallel-size": "2", "--expert-model-parallel-size": "2"}, 2,
                             "TP 1 x PP 1 x DP "),
    "megatron_kimi_k2": ({"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
                          "--context-parallel-size": "1", "--expert-model-parallel-size": "2",
                          "--decoder-last-pipeline-num-layers": "1"}, 4, "TP 2 x PP 2 x DP 1"),
}


# Both run under `make test-replay` only. In `make test`: the same 4-rank colocated layout (TP 2 x PP 2 x EP 2 with
# --sequence-parallel, a sync gathered from both stages) on Qwen3-MoE (test_moe_parallel_replay.py's int4 command),
# Kimi-K2's MLA synced at TP 2 x EP 2 (test_kimi_k2_e2e.py), MLA under CP 2, PP 2 (Kimi-K2's uneven split) and
# CP 2 x EP 2 against the FSDP backend (tests/multiprocess/test_megatron_mla.py's layouts)
@pytest.mark.parametrize("name", replay_params(CASES, in_make_test=()))
def test_recorded_mla_command_runs_two_rollouts(name: str, tmp_path: Path) -> None:
    from miles_fixtures import HERE, PLUGIN_FOLDERS, read_fixture, tiny_replay

    sizes, trainers, layout = CASES[name]
    assert read_fixture(HERE / f"{name}.flags")[1].startswith("refused: --sglang-")
    replay = tiny_replay(HERE / f"{name}.flags", tmp_path, tmp_path / "models")
    argv = replay.argv
    assert {f: argv[argv.index(f) + 1] for f in sizes} == sizes, replay.changed
    assert "--sequence-parallel" in argv and "--multi-latent-attention" in argv, replay.changed
    assert argv[argv.index("--actor-num-gpus-per-node") + 1] == str(trainers) and replay.nproc == trainers
    assert any(f.startswith("--sglang-") for f in replay.changed), replay.changed
    log = tmp_path / "replay.log"
    run_replay(replay, log, *PLUGIN_FOLDERS, timeout=800)
    check_synced(log, layout)                         # the layout; the first sync and one per rollout checked
