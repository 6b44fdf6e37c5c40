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
                      "--rm-type", "math", "--num-epoch", "2", "--rollout-batch-size", "4", "--actor-num-gpus-per-node", "2",
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


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_step_phases_add_up_to_the_step_time(tmp_path: Path, tiny_model_dir):
    """A real run (train.py under torchrun: 1 trainer rank + 1 embedded engine, 3 rollouts): every record's
    phases plus ``perf/other_time`` are its ``perf/step_time``, and the residual is small; the train and
    weight-sync phases carry their parts (trainer rank 0's and the slowest rank's), which add up the same way."""
    import os
    import subprocess
    import sys

    from miles.run.metrics import OTHER_KEY, PHASE_PARTS, STEP_PHASES, read_metrics

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                            for a in range(5) for b in range(5)))
    out = tmp_path / "run"
    repo = Path(__file__).resolve().parents[3]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
           "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "2", "--hf-checkpoint", str(tiny_model_dir),
           "--prompt-data", str(data), "--input-key", "input", "--label-key", "label", "--rm-type", "quickstart",
           "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
           "--rollout-max-response-len", "4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
           "--no-progress", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(repo)}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = read_metrics(out / "metrics.jsonl")
    assert len(recs) == 3
    for r in recs:
        phases = [k for k in STEP_PHASES if k in r]
        assert {"perf/health_time", "perf/rollout_time", "perf/score_time", "perf/train_time",
                "perf/update_weights_time"} <= set(phases), sorted(r)
        assert sum(r[k] for k in phases) + r[OTHER_KEY] == pytest.approx(r["perf/step_time"], abs=1e-9)
        # what no phase covers (the loop's own bookkeeping) is a small part of the step
        assert -1e-3 <= r[OTHER_KEY] <= 0.05 * r["perf/step_time"] + 5e-3, (r[OTHER_KEY], r["perf/step_time"])
        for phase, (parts, residual) in PHASE_PARTS.items():
            assert all(k in r and r[k] >= 0 for k in parts), (phase, sorted(r))
            assert sum(r[k] for k in parts) + r[residual] == pytest.approx(r[phase], abs=1e-9)
            assert r[residual] >= -1e-3, (phase, r[residual])
        # the train phase's residual: the command to the ranks and the gather of the trainer's phase times
        assert r["perf/train/other_time"] <= 0.5 * r["perf/train_time"] + 5e-3, r
        assert r["perf/train/fwd_bwd_time"] > 0 and r["perf/train/optimizer_time"] > 0
        for part in ("data", "logprobs", "advantages", "fwd_bwd", "optimizer", "metrics"):   # one trainer rank
            assert r[f"perf/train/{part}_time_max"] == r[f"perf/train/{part}_time"]
    assert "run summary: 3 rollouts" in proc.stderr + proc.stdout


@pytest.mark.parametrize("loop_cls", ["RLLoop", "AsyncRLLoop"])
def test_both_loops_begin_with_the_first_sync_and_the_eval_before_training(loop_cls: str) -> None:
    """``RLLoop.begin``, which both loops' ``run`` start with: a checkpoint already at --num-rollout does nothing
    (no sync, no rollout); from rollout 0 the engines are synced, then evaluated (unless
    --skip-eval-before-train); from a resumed rollout only synced."""
    import asyncio
    from types import SimpleNamespace

    from miles.run import async_loop, loop

    calls = []
    lp = object.__new__(getattr(async_loop if loop_cls == "AsyncRLLoop" else loop, loop_cls))
    lp.timer = PhaseTimer()
    lp.job = SimpleNamespace(eval_datasets=["d"], sink=SimpleNamespace(log_eval=lambda i, m: calls.append(("log", i, m))))

    async def initial_sync():
        calls.append("sync")

    async def evaluate(rollout_id):
        calls.append(("eval", rollout_id))
        return {"eval/x": 1.0}

    lp.initial_sync, lp.evaluate = initial_sync, evaluate
    for start, skip, expect in ((3, False, []), (0, False, ["sync", ("eval", 0), ("log", 0, {"eval/x": 1.0})]),
                                (0, True, ["sync"]), (1, False, ["sync"])):
        calls.clear()
        lp.plan = SimpleNamespace(start_rollout_id=start, num_rollout=3)
        lp.cfg = SimpleNamespace(eval=SimpleNamespace(skip_eval_before_train=skip))
        assert asyncio.run(lp.begin()) is (start < 3)
        assert calls == expect, (start, skip, calls)
    lp.plan = SimpleNamespace(start_rollout_id=3, num_rollout=3)
    calls.clear()
    asyncio.run(lp.run())                  # nothing to do: returns before anything else
    assert calls == []


def test_async_loop_detaches_each_sync_and_lands_it_before_the_next_generation() -> None:
    """train_async.py: every sync is asked to detach (the engines load while the trainer trains on), and the
    generation that follows waits for that sync's answer (``WeightSender.land``) before it asks the engines for
    anything; the time it waited is the rollout's ``perf/wait_weights_time``, and what the landed sync measured on
    its thread (transfer, load) goes into that rollout's record with the rollout the sync followed."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from miles.run.async_loop import AsyncRLLoop
    from miles.weight_sync.base import SyncResult

    events: list = []
    logged: dict[int, dict] = {}

    class Sender:
        weight_version, in_flight, synced_after, landed_after = 0, False, None, None

        @property
        def detached_in_flight(self) -> bool:
            return self.in_flight

        def land(self) -> float:
            events.append("land")
            if self.in_flight:
                self.landed_after = self.synced_after
            self.in_flight = False
            return 0.25

        def take_landed(self) -> SyncResult | None:  # once, as WeightSender.take_landed
            if self.landed_after is None:
                return None
            r = SyncResult("broadcast", 1, bytes=4_000_000, transfer_s=0.003, load_s=0.002, total_s=0.008,
                           extra={"detached": 1.0, "rollout_id": float(self.landed_after)})
            self.landed_after = None
            return r

    sender = Sender()
    lp = object.__new__(AsyncRLLoop)
    lp.interval, lp.max_staleness, lp.detach, lp.fully, lp._tasks, lp.timer = 1, None, True, None, [], PhaseTimer()
    lp.job = SimpleNamespace(worker=SimpleNamespace(ft=None, sender=sender, channel=SimpleNamespace(keepalive=contextlib.nullcontext)),
                             data_source=None, sink=SimpleNamespace(log=lambda i, m: logged.__setitem__(i, m)))

    async def generate(rollout_id, keepalive=True):
        events.append(("generate", rollout_id))
        return [], {}

    async def sync_weights(detach=False, rollout_id=None):
        if sender.in_flight:
            sender.land()  # WeightSender.sync lands its predecessor first
        events.append(("sync", detach))
        sender.in_flight, sender.synced_after = detach, rollout_id
        return {}

    async def maybe_eval(rollout_id):
        return {}

    lp.generate, lp.sync_weights, lp.maybe_eval = generate, sync_weights, maybe_eval
    lp.score = lambda groups: (groups, {})
    lp.train_step = lambda rollout_id, groups: {}
    lp.maybe_save = lambda rollout_id, metrics=None: None

    async def main() -> None:
        await lp._overlapped(0, 3, asyncio.ensure_future(lp.generate_overlapped(0)))

    asyncio.run(main())
    assert events == [("generate", 0), ("generate", 1), ("sync", True), "land", ("generate", 2), ("sync", True),
                      "land", ("sync", True), "land"], events
    assert [logged[i]["perf/wait_weights_time"] for i in range(3)] == [0.0, 0.0, 0.25]
    # rollout 2's generation landed the sync that followed rollout 0: its thread's measures, not zeros; the last
    # sync landed the one after rollout 1 (no generation came between), and the last sync itself landed before the
    # last record was written: every sync's measures reach the records, none overwriting another
    assert not any("landed_" in k for i in (0, 1) for k in logged[i]), logged
    measured = {"transfer_s": 0.003, "load_s": 0.002, "total_s": 0.008, "gbps": 0.5}
    assert {k: v for k, v in logged[2].items() if "landed_" in k} == {
        **{f"weight_sync/{by}landed_{k}": v for by in ("", "sync_", "final_") for k, v in measured.items()},
        "weight_sync/landed_rollout_id": 0.0, "weight_sync/sync_landed_rollout_id": 1.0,
        "weight_sync/final_landed_rollout_id": 2.0}


def _worker(sender, ft=None):
    from types import SimpleNamespace

    return SimpleNamespace(ft=ft, sender=sender, channel=SimpleNamespace(is_src=True, src=0),
                           ctx=SimpleNamespace(plan=SimpleNamespace(trainer_ranks=[1, 2])))


def test_a_sync_detaches_only_where_the_driver_holds_the_senders_thread() -> None:
    """Only the process whose thread runs a detached sync can land it, and the driver lands: train_async.py detaches
    only where the driver's sender is the source rank (a plain sync elsewhere), and the driver's handle refuses a
    detached sync by name where it is not."""
    from miles.run.async_loop import detaches
    from miles.run.worker import Ranks
    from miles.spmd.errors import MilesError
    from miles.weight_sync.base import build_weight_sender

    cfg = parse_args(["--hf-checkpoint", "x"], validate=False).weights
    source, other = (build_weight_sender(cfg, None, is_source=s) for s in (True, False))
    assert detaches(_worker(source), fully_async=False) is True
    assert detaches(_worker(other), fully_async=False) is False       # the driver is not the source rank
    assert detaches(_worker(None), fully_async=False) is False        # the driver syncs nothing
    assert detaches(_worker(source), fully_async=True) is False
    assert detaches(_worker(source, ft=object()), fully_async=False) is False
    with pytest.raises(MilesError, match=r"landed by the driver \(rank 0\), which is not the weight sender's source "
                                         r"rank \(rank 1, the first trainer rank\).*sync without detach"):
        Ranks(_worker(other)).sync_weights(detach=True, rollout_id=3)
