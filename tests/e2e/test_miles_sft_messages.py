"""SFT on chat ``messages`` as Miles's SFT launcher (scripts/run_qwen3_sft.py) runs it: its flag list from
tests/fixtures/miles_scripts/sft_async_qwen3.flags (the SFT run path; the Megatron model/parallelism
flags of the fixture are not part of it) through ``train_async.py`` on the tiny model, one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _miles_e2e import REPO, check_ok, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]

FIXTURE = REPO / "tests" / "fixtures" / "miles_scripts" / "sft_async_qwen3.flags"
SFT_PATH_FLAGS = {  # what the SFT run path reads; sizes are overridden below for the tiny run
    "--hf-checkpoint", "--save", "--save-interval", "--rollout-function-path", "--prompt-data", "--input-key",
    "--rollout-shuffle", "--num-epoch", "--rollout-batch-size", "--global-batch-size", "--loss-type",
    "--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only", "--optimizer",
    "--lr", "--lr-decay-style", "--min-lr", "--weight-decay", "--adam-beta1", "--adam-beta2",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu",
}


def _fixture_flags(model: Path, data: Path, out: Path) -> list[str]:
    argv = []
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("--") and line.split()[0] in SFT_PATH_FLAGS:
            argv += line.replace("{MODEL}", str(model)).replace("{DATA}", str(data)).replace("{OUT}", str(out)).split()
    assert "miles.rollout.sft_rollout.generate_rollout" in argv and "messages" in argv
    return argv


def test_sft_on_messages_with_miles_launcher_flags(tmp_path: Path, tiny_model_dir: Path):
    data = tmp_path / "conversations.jsonl"
    rows = [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i % 5}+{i % 3}="},
                          {"role": "assistant", "content": str(i % 5 + i % 3)}]} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "1", "train_async.py", "--train-backend", "fsdp",
           *_fixture_flags(tiny_model_dir, data, tmp_path),
           "--rollout-batch-size", "4", "--global-batch-size", "4", "--num-epoch", "1", "--lr", "1e-3",
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
           "--output-dir", str(out), "--no-progress"]
    check_ok(run(cmd, log, timeout=420), log)
    recs = metrics(out)
    assert [r["rollout_id"] for r in recs] == [0, 1], recs  # 8 conversations, 4 per rollout, --num-epoch 1
    # each response is "<sum><|im_end|>\n": 3 trained tokens (the prompt up to "<|im_start|>assistant\n" is not)
    assert all(r["rollout/response_len"] == 3.0 and r["train/num_samples"] == 4 for r in recs), recs
    assert recs[1]["train/sft_loss"] < recs[0]["train/sft_loss"], recs
