"""Resume: a run stopped after rollout 1 and restarted with --load continues at rollout 2, with the data order
an uninterrupted run would have had (the data source position and epoch travel in the checkpoint), and
appends to the same metrics.jsonl. A --load not written yet is a fresh start (Miles's meaning).

Real parts: torchrun, 2 colocated ranks (FSDP2 + an embedded engine each), the quickstart's verifier,
crash-safe checkpoints; the prompts each rollout used come from --save-debug-rollout-data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _miles_e2e import QUICKSTART, check_ok, check_run_dir, metrics, run, tail

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

NUM_PROMPTS, BATCH, SEED = 10, 4, 7


def _cmd(model: Path, data: Path, out: Path, ckpt: Path, num_rollout: int, *extra: str) -> list[str]:
    return ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--train-backend", "fsdp", "--colocate",
            "--actor-num-nodes", "1",
            "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2", "--hf-checkpoint", str(model),
            "--prompt-data", str(data), "--input-key", "input", "--label-key", "label", "--rm-type", "quickstart",
            "--rollout-shuffle", "--rollout-seed", str(SEED), "--num-rollout", str(num_rollout),
            "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3",
            "--lr", "1e-3", "--save", str(ckpt), "--save-interval", "1", "--output-dir", str(out), "--no-progress", "--use-tensorboard",
            "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.jsonl"), *extra]


def _prompts_per_rollout(out: Path, rollout_id: int) -> list[str]:
    rows = [json.loads(line) for line in (out / "rollouts" / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]
    by_group: dict[int, str] = {}
    for r in rows:
        by_group.setdefault(r["group_index"], r["prompt"])
    return [by_group[g] for g in sorted(by_group)]


def test_resume_continues_rollout_ids_and_data(tmp_path: Path):
    import sys

    sys.path.insert(0, str(QUICKSTART))
    import build as quickstart_build

    from miles.rollout.data import epoch_order

    quickstart_build.build(tmp_path / "qs", train_copies=1)
    model = tmp_path / "qs" / "model"
    rows = quickstart_build.eval_rows()[:NUM_PROMPTS]
    data = tmp_path / "train.jsonl"
    quickstart_build.write_jsonl(data, rows)
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"

    log1 = tmp_path / "first.log"
    check_ok(run(_cmd(model, data, out, ckpt, 2), log1, timeout=600), log1)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000000", "step_00000001"]
    saved = json.loads((ckpt / "step_00000001" / "trainer_state.json").read_text())["extra"]
    assert saved["next_rollout_id"] == 2 and saved["data_source"]["offset"] == 2 * BATCH

    log2 = tmp_path / "second.log"
    check_ok(run(_cmd(model, data, out, ckpt, 4, "--load", str(ckpt)), log2, timeout=600), log2)
    text = log2.read_text()
    assert "resuming at rollout 2" in text, tail(log2)
    check_run_dir(out, num_rollout=4, num_ranks=2)  # appended: rollout ids 0..3 in one metrics.jsonl
    assert [r["rollout_id"] for r in metrics(out)] == [0, 1, 2, 3]
    assert "weight sync v1 " not in text  # versions continue from the checkpoint instead of restarting

    # the prompts, rollout by rollout, are those of one uninterrupted pass over the shuffled epochs
    order = [rows[i]["input"] for e in range(2) for i in epoch_order(NUM_PROMPTS, e, SEED, True)]
    for k in range(4):
        assert _prompts_per_rollout(out, k) == order[k * BATCH:(k + 1) * BATCH], f"rollout {k}"
    final = json.loads((ckpt / "step_00000003" / "trainer_state.json").read_text())["extra"]
    assert final["data_source"]["epoch"] == 1 and final["data_source"]["offset"] == 4 * BATCH - NUM_PROMPTS


def test_load_not_written_yet_starts_fresh_as_in_miles(tmp_path: Path, tiny_model_dir: Path):
    """Miles's scripts pass ``--load $CKPT --save $CKPT`` from the first run on: an empty --load is a fresh
    start that says so, and the run saves into --save."""
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"input": "1+1=", "response": "2"}) + "\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    log = tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--train-backend", "fsdp",
           "--debug-train-only", "--actor-num-nodes", "1",
           "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2", "--hf-checkpoint", str(tiny_model_dir),
           "--loss-type", "sft_loss", "--prompt-data", str(data), "--label-key", "response", "--num-rollout", "1",
           "--rollout-batch-size", "2", "--save", str(ckpt), "--load", str(ckpt),
           "--output-dir", str(tmp_path / "out")]
    check_ok(run(cmd, log, timeout=300), log)
    text = log.read_text()
    assert f"--load {ckpt}: no checkpoint there yet" in text, tail(log)
    assert (ckpt / "step_00000000" / "COMPLETE").is_file()
