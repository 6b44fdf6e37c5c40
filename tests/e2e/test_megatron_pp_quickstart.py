"""The quickstart's GRPO phase with ``--train-backend megatron --pipeline-model-parallel-size 2`` under torchrun:
2 trainer ranks (one pipeline of 2 stages; megatron-core's groups over the trainer ranks only) + 2 embedded
engines, ``--check-weight-update-equal`` after every sync (the buckets gathered from both stages leave the
engines holding exactly the trainer's weights). 3 rollouts: a wiring test, not a learning test
(``test_megatron_quickstart.py`` checks learning with TP 2; ``tests/multiprocess/test_megatron_pp.py`` checks
the PP numbers against the FSDP backend). It starts from the session's SFT warm start (tests/conftest.py's
``quickstart_sft``), as the other quickstart e2e tests do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, check_ok, check_run_dir, run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1200)]


def test_megatron_pp2_quickstart_syncs_equal_weights(quickstart_sft: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "run", tmp_path / "run.log"
    check_ok(run(["bash", str(QUICKSTART / "run_grpo.sh"), "--train-backend", "megatron",
                  "--pipeline-model-parallel-size", "2", "--check-weight-update-equal", "--num-rollout", "3",
                  "--output-dir", str(out)], log, timeout=1100, QUICKSTART_DIR=str(quickstart_sft)), log)
    text = log.read_text(errors="replace")
    assert "Megatron trainer ready" in text and "TP 1 x PP 2 x DP 1" in text, text[-3000:]
    assert text.count("--check-weight-update-equal: ") >= 4, text[-3000:]    # initial sync + one per rollout
    check_run_dir(out, num_rollout=3, num_ranks=4)
