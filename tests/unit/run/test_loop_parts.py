"""Loop building blocks that need no cluster: trainable-sample filtering, phase timers, SFT samples, dry run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.run.loop import PhaseTimer, trainable_groups
from miles.types import Sample, SampleStatus


def _s(g: int, reward, status=SampleStatus.COMPLETED, rlen: int = 2) -> Sample:
    return Sample(group_index=g, tokens=[5, 6, 7, 8][: 2 + rlen], response_length=rlen, reward=reward, status=status)


def test_trainable_groups_drops_failed_and_empty():
    groups = [[_s(0, 1.0), _s(0, 0.0, SampleStatus.FAILED)], [_s(1, None, SampleStatus.FAILED), _s(1, 0.0, SampleStatus.ABORTED, 0)],
              [_s(2, 1.0), _s(2, 1.0, SampleStatus.TRUNCATED)]]
    kept, m = trainable_groups(groups, policy=True)
    assert [len(g) for g in kept] == [1, 2]
    assert m["rollout/dropped_samples"] == 3 and m["rollout/num_groups"] == 2
    assert m["rollout/zero_std_groups"] == 2
    sft_kept, _ = trainable_groups([[_s(0, None)]], policy=False)  # SFT samples have no reward
    assert len(sft_kept) == 1


def test_phase_timer():
    t = PhaseTimer()
    with t("train"):
        time.sleep(0.01)
    with t("train"):
        pass
    out = t.pop()
    assert out["perf/train_time"] >= 0.01 and out["perf/rollout_time"] == 0.0 and out["perf/update_weights_time"] == 0.0
    assert t.pop()["perf/train_time"] == 0.0


def test_sft_source(tmp_path: Path, tiny_model_dir):
    from transformers import AutoTokenizer

    from miles.rollout.data import DataSource, PromptDataset
    from miles.run.sft import SFTSource

    p = tmp_path / "sft.jsonl"
    p.write_text("\n".join(json.dumps({"input": f"{i}+1=", "response": str(i + 1)}) for i in range(5)) + "\n")
    cfg = parse_args(["--num-rollout", "1", "--rollout-batch-size", "2", "--label-key", "response", "--loss-type", "sft_loss"])
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    src = SFTSource(DataSource(PromptDataset(str(p), tok, cfg.data)), tok, cfg.data)
    groups, metrics = src.next_rollout(0)
    s = groups[0][0]
    assert len(groups) == 2 and s.response_length == 2 and s.loss_mask == [1, 1]
    assert s.tokens == tok("0+1=1", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert metrics["rollout/response_len"] == 2.0
    no_label = parse_args(["--num-rollout", "1", "--rollout-batch-size", "2", "--loss-type", "sft_loss"])
    with pytest.raises(ConfigError, match="--label-key"):
        SFTSource(None, tok, no_label.data)


def test_dry_run_text(tmp_path: Path, tiny_model_dir):
    from miles.run.entry import dry_run

    p = tmp_path / "train.jsonl"
    p.write_text("\n".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) for i in range(10)) + "\n")
    cfg = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(p), "--label-key", "label",
                      "--num-epoch", "2", "--rollout-batch-size", "4", "--actor-num-gpus-per-node", "2",
                      "--rollout-num-gpus", "2", "--num-gpus-per-node", "4", "--dry-run"])
    text = dry_run(cfg)
    assert "role plan: disaggregated, 4 rank(s)" in text and "engine_leader" in text
    assert '"num_rollout": 4' in text  # 2 epochs x (10 // 4)
    assert '"rollout_batch_size": 4' in text


def test_max_weight_staleness_drops_old_groups():
    """train_async.py --max-weight-staleness N: groups with a sample more than N versions behind are dropped."""
    from types import SimpleNamespace

    from miles.run.async_loop import AsyncRLLoop

    loop = object.__new__(AsyncRLLoop)
    loop.policy = True
    loop.job = SimpleNamespace(worker=SimpleNamespace(sender=SimpleNamespace(weight_version=5)))

    def group(g: int, *versions) -> list[Sample]:
        out = [_s(g, 1.0) for _ in versions]
        for s, v in zip(out, versions):
            s.weight_version = v
        return out

    groups = [group(0, 5, 5), group(1, 4, 3), group(2, 2, 5), group(3, None, 4)]
    loop.max_staleness = 1
    kept, m = loop.score_async([list(g) for g in groups])
    assert [g[0].group_index for g in kept] == [0, 3]
    assert m["rollout/stale_dropped_groups"] == 2 and m["rollout/weight_staleness_max"] == 3.0
    loop.max_staleness = None  # the default keeps everything, and still reports staleness
    kept, m = loop.score_async([list(g) for g in groups])
    assert len(kept) == 4 and "rollout/stale_dropped_groups" not in m
