"""``--custom-model-provider-path`` in a whole run: Miles's recorded Qwen3 dense Megatron command
(tests/fixtures/miles_scripts/megatron_qwen3_dense.flags, at the replay's tiny CPU scale: TP 2 + sequence
parallelism, embedded engines, the reference model of its KL loss) with a provider of our own added
(tests/fixtures/model_providers/tiny_gpt_provider.py ``get_args_provider``: its TransformerConfig from Megatron-LM's
``get_args()`` as Miles's providers build theirs, megatron-core's local layer spec with its unfused attention) and
the Megatron-LM fusion switches Miles's launchers pass. Two rollouts run; every weight sync is checked tensor by
tensor against the engines (``--check-weight-update-equal``), so the provider's model trains and the engines serve
its weights. Under ``--sequence-parallel`` the provider's megatron-core torch norms are built as miles's own
(provider.py ``_sequence_parallel_torch_norms``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _miles_e2e import run, tail
from miles_fixtures import HERE, tiny_replay

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

PROVIDERS = Path(__file__).resolve().parents[1] / "fixtures" / "model_providers"
FUSION = ["--no-masked-softmax-fusion", "--no-rope-fusion", "--no-bias-dropout-fusion",
          "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion"]


def test_provider_runs_two_rollouts_with_weight_checks(tmp_path: Path) -> None:
    replay = tiny_replay(HERE / "megatron_qwen3_dense.flags", tmp_path, tmp_path / "models")
    assert "--sequence-parallel" in replay.argv
    argv = replay.argv + ["--custom-model-provider-path", "tiny_gpt_provider.get_args_provider", *FUSION]
    if "--check-weight-update-equal" not in argv:
        argv.append("--check-weight-update-equal")
    log = tmp_path / "run.log"
    here = Path(__file__).resolve()
    pythonpath = os.pathsep.join([str(here.parents[2]), str(here.parents[1]), str(PROVIDERS)])
    result = run(["torchrun", "--standalone", "--nproc-per-node", str(replay.nproc), replay.entry, *argv], log,
                 timeout=600, PYTHONPATH=pythonpath)
    assert result.returncode == 0, f"exit code {result.returncode}; log {log}:\n{tail(log)}"
    text = log.read_text()
    assert "Megatron trainer ready" in text and "TP 2 x PP 1" in text, tail(log)
    assert ("--custom-model-provider-path tiny_gpt_provider.get_args_provider: a GPTModel (layer 0's core attention: "
            "DotProductAttention), weights by the dense converter") in text, tail(log)
    out = Path(argv[argv.index("--output-dir") + 1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["rollout_id"] for r in records] == [0, 1], records
    assert text.count("--check-weight-update-equal: ") >= 3, tail(log)   # the first sync and one per rollout
