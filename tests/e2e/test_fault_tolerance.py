"""Fault injection into real ``train.py`` runs (torchrun, gloo, FSDP2, embedded engines, sglang-router, torchft).

1. Engines (``--use-fault-tolerance``, 1 trainer + 2 engines): SIGSTOP of an engine mid-rollout (a hang the
   health probes must catch), SIGKILL of an engine during a weight sync, SIGKILL of an engine mid-rollout.
   The run completes every rollout with every group full (each sample exactly once, at full length),
   each engine leaves the router within seconds and comes back with verified weights
   (``--check-weight-update-equal`` compares every engine with the trainer, bitwise, after every sync).
2. Trainer (``torchrun --max-restarts 1``, 2 trainer ranks + 1 engine): trainer rank 1 is SIGKILLed during
   rollout 2 while half-written checkpoint directories lie next to the last complete one. The job fails
   fast, torchrun relaunches it, and the relaunch resumes from step 1 with the same rollout ids and the
   same prompts in the same order as an uninterrupted run would use.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import ft_harness as H
import pytest
from _miles_e2e import quickstart_copy

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, quickstart_prepared: Path) -> Path:
    """The quickstart's model and data (prepare.sh's = build.py's defaults, built once a session), this module's copy."""
    return quickstart_copy(quickstart_prepared, tmp_path_factory.mktemp("ft_quickstart") / "qs")


def _fault(faults: list[dict], index: int, where: str) -> dict:
    """Fault ``index`` as injected; ``where`` is how its label starts (a timed fault whose timer fired after its
    rollout was over moves to the next rollout, so its label names the rollout it really hit)."""
    hit = [f for f in faults if f.get("index") == index]
    assert len(hit) == 1 and "error" not in hit[0] and hit[0]["where"].startswith(where), \
        f"fault {index} ('{where}...') not injected as planned: {faults}"
    return hit[0]


def test_engine_faults_run_completes_every_rollout_with_full_groups(quickstart, tmp_path):
    num_rollout, batch, n, length = 6, 4, 8, 96
    faults = [
        {"signal": "STOP", "engine": 0, "rollout": 1, "after_requests": 16},   # a hang, mid-rollout
        {"signal": "KILL", "engine": 1, "sync_version": 4, "after_buckets": 1},  # during the sync after rollout 2
        {"signal": "KILL", "engine": 0, "rollout": 4, "after_requests": 16},   # mid-rollout (twice for engine 0)
    ]
    flags = [*H.layout_flags(1, 2), *H.quickstart_flags(quickstart, num_rollout=num_rollout, batch=batch, n=n,
                                                          response_len=length),
             *H.ft_flags(interval=1.0, timeout=3.0), "--check-weight-update-equal",
             "--update-weight-buffer-size", "16384", "--output-dir", str(tmp_path / "run")]
    job = H.launch(flags, nproc=3, workdir=tmp_path, faults=faults)
    rc = job.wait(timeout=420)
    log = job.log.read_text(errors="replace")
    assert rc == 0, H.tail(job.log)

    samples, injected = H.records(job)
    # every rollout: every group full, every sample exactly once, at full length
    census = H.sample_census(samples)
    expected = {(r, g, i) for r in range(num_rollout) for g in range(batch) for i in range(g * n, (g + 1) * n)}
    assert set(census) == expected, f"missing {sorted(expected - set(census))[:5]}, extra {sorted(set(census) - expected)[:5]}"
    assert max(census.values()) == 1, [k for k, v in census.items() if v > 1][:5]
    assert all(s["status"] == "truncated" and s["response_length"] == length for s in samples)
    stop, in_sync_fault, kill = (_fault(injected, i, w) for i, w in ((0, "rollout 1"), (1, "weight sync v4"),
                                                                      (2, "rollout ")))
    for f in (stop, kill):  # the timed faults hit while their rollout's requests ran
        r = int(f["where"].split()[1])
        assert [s for s in samples if s["rollout_id"] == r and s["t"] > f["t"]], f"rollout {r} was over before {f}"
    rows = H.metrics(tmp_path)
    assert [m["rollout_id"] for m in rows] == list(range(num_rollout))
    assert all(m["rollout/num_groups"] == batch and m["rollout/generate_failures"] == 0 for m in rows), rows

    # each fault: out of the router within seconds; back in rotation only with verified current weights
    events = H.ft_events(tmp_path)
    removed = [e for e in events if e["event"] == "removed"]
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(removed) == 3 and not [e for e in events if e["event"] == "given_up"], events
    t_stop, t_sync, t_kill = stop["t"], in_sync_fault["t"], kill["t"]
    hang, in_sync, killed = (min((e for e in removed if e["engine_id"] == eid and e["down_seen"] >= t - 1),
                                 key=lambda e: e["down_seen"])
                             for eid, t in ((0, t_stop), (1, t_sync), (0, t_kill)))
    hb = 0.5 + 2 + 2  # heartbeat period + lighthouse heartbeat timeout + join timeout (interval 1 s)
    # the hang is caught by the leader's probes (interval + timeout) and the quorum, or by the driver when
    # the next weight sync reaches the stopped engine, whichever comes first: FTTimings.hang_detection_bound
    # (8.5 s) + 4 s slack; measured 3.5-5.3 s (docs/benchmarks.md)
    assert hang["removed"] - t_stop < 1 + 3 + hb + 4, (hang, t_stop)
    assert "weight sync" in in_sync["reason"] and in_sync["removed"] - t_sync < 5
    assert killed["removed"] - t_kill < hb + 4
    # the first two outages are over before the run ends (an engine restarts in ~15 s here): their engines
    # were pushed the current weights from the driver's cache, verified, and only then routed again
    assert {e["engine_id"] for e in recovered if e["down_seen"] < t_kill} == {0, 1}, events
    assert all(e["catch_up_version"] is not None and e["admitted"] > e["back"] for e in recovered)
    assert "verified" in log and "caught up to v" in log
    # at the start, each engine was routed only after the initial weight sync reached it
    driver = (tmp_path / "run" / "logs" / "rank0.log").read_text(errors="replace")
    assert driver.index("weight sync v1 (broadcast)") < driver.index(": added engine http"), driver[:4000]
    assert "routed after the initial weight sync" in driver
    leaders = "".join((tmp_path / "run" / "logs" / f"rank{r}.log").read_text(errors="replace") for r in (1, 2))
    assert "health probe failed while the process is alive (hung?)" in leaders  # the SIGSTOP seen by probes
    last = rows[-1]
    assert last["ft/engine_failures"] == 3 and last["ft/engine_restarts"] >= 2
    assert last["ft/recovery_time_max_s"] > 0 and "ft/requests_retried" in last


def _expected_prompts(data: Path, num_rollout: int, batch: int) -> list[list[str]]:
    """The prompts an uninterrupted run draws, rollout by rollout (the data plane's own order)."""
    from transformers import AutoTokenizer

    from miles.config import data as data_flags
    from miles.config.base import section_from_namespace
    from miles.config.data import DataConfig
    from miles.rollout.data import DataSource, PromptDataset

    p = argparse.ArgumentParser()
    data_flags.add_arguments(p)
    cfg = section_from_namespace(DataConfig, p.parse_known_args(["--input-key", "input", "--label-key", "label"])[0])
    tok = AutoTokenizer.from_pretrained(str(data / "model"))
    source = DataSource(PromptDataset(str(data / "train.jsonl"), tok, cfg, seed=42), shuffle=True, seed=42)
    return [[it.prompt for it in source.next_batch(batch)] for _ in range(num_rollout)]


def test_trainer_rank_killed_relaunch_resumes_from_last_complete_checkpoint(quickstart, tmp_path):
    num_rollout, batch, n = 4, 2, 4
    save = tmp_path / "ckpt"
    flags = [*H.layout_flags(2, 1), *H.quickstart_flags(quickstart, num_rollout=num_rollout, batch=batch, n=n,
                                                          response_len=8),
             "--save", str(save), "--save-interval", "1", "--output-dir", str(tmp_path / "run")]
    # rollout 2 stays in generation for 10 s of the first attempt after its first sample (a step here takes
    # milliseconds: the partial step-2 files below and the kill must land before step 2 is trained and saved)
    job = H.launch(flags, nproc=3, workdir=tmp_path, max_restarts=1,
                   env={"MILES_FT_HOLD": json.dumps({"rollout": 2, "seconds": 10})})
    first_pid = t_kill = driver = None
    deadline = time.monotonic() + 300
    while t_kill is None:  # SIGKILL trainer rank 1 once rollout 2 is being generated (step 1 is complete)
        assert job.proc.poll() is None and time.monotonic() < deadline, H.tail(job.log)
        samples, _ = H.records(job)
        if any(s["rollout_id"] == 2 for s in samples):
            first_pid = samples[0]["pid"]
            victim = H.rank_pid(job, 1)
            assert victim is not None and (save / "step_00000001" / "COMPLETE").exists()
            # what a crash in the middle of saving step 2 leaves behind: both must be ignored
            (save / ".tmp.step_00000002").mkdir()
            (save / ".tmp.step_00000002" / "model.rank0.pt").write_bytes(b"partial")
            (save / "step_00000002").mkdir()
            (save / "step_00000002" / "model.rank0.pt").write_bytes(b"partial, no COMPLETE")
            driver = H.rank_pid(job, 0)
            t_kill = time.monotonic()
            H.os.kill(victim, signal.SIGKILL)
        time.sleep(0.05)
    while H.rank_pid(job, 0) in (driver, None):  # torchrun ends the attempt and starts the next one
        assert job.proc.poll() is None and time.monotonic() - t_kill < 120, H.tail(job.log)
        time.sleep(0.1)
    relaunch_s = time.monotonic() - t_kill
    print(f"SIGKILL of trainer rank 1 -> relaunched rank 0: {relaunch_s:.2f} s")
    # measured 0.36 s and 0.59 s (2-core box, 2026-12-01): 5 s still fails a 10x slower teardown/relaunch
    assert relaunch_s < 5, f"the job took {relaunch_s:.1f}s to give up on a dead trainer rank"
    rc = job.wait(timeout=420)
    log = job.log.read_text(errors="replace")
    assert rc == 0, H.tail(job.log)

    # the first attempt ended fast, naming the dead rank, and torchrun relaunched the job
    assert "failed (exitcode: -9) local_rank: 1" in log, H.tail(job.log, 120)  # torchrun names the dead rank
    samples, _ = H.records(job)
    second = [s for s in samples if s["pid"] != first_pid]
    assert second, "no sample from the relaunched job"
    assert "resuming at rollout 2 (checkpoint of rollout 1)" in log, H.tail(job.log, 120)

    # same rollout ids, same data order: the relaunch redoes rollout 2 with the prompts the killed attempt
    # was using, and every rollout used exactly the prompts an uninterrupted run draws
    expected = _expected_prompts(quickstart, num_rollout, batch)
    by_attempt: dict[tuple[int, int], list[str]] = {}
    for s in samples:
        prompts = by_attempt.setdefault((s["pid"] == first_pid, s["rollout_id"]), [None] * batch)
        prompts[s["group"]] = s["prompt"]
    assert sorted(r for first, r in by_attempt if not first) == [2, 3]
    for (first, r), prompts in by_attempt.items():
        if first and r == 2:
            assert [p for p in prompts if p is not None] == [p for p, q in zip(expected[2], prompts) if q is not None]
        else:
            assert prompts == expected[r], (first, r, prompts, expected[r])
    assert H.sample_census(second) == H.sample_census(
        [{"rollout_id": r, "group": g, "index": i} for r in (2, 3) for g in range(batch) for i in range(g * n, (g + 1) * n)])
    # the partial step was discarded: every rollout's metrics once, and the run ends with complete checkpoints
    assert [m["rollout_id"] for m in H.metrics(tmp_path)] == list(range(num_rollout))
    assert (save / "step_00000003" / "COMPLETE").exists() and not (save / ".tmp.step_00000002").exists()


def test_hung_trainer_rank_under_ft_launcher_is_restarted_and_resumes(quickstart, tmp_path):
    """nvidia-resiliency-ext's ft_launcher: every rank heartbeats once per command (miles.ft.launcher); a
    SIGSTOPped trainer rank goes silent, its rank monitor sees no heartbeat within 20 s, the launcher
    restarts the worker group long before the collectives' 5 min timeout, and the run resumes from its
    last complete checkpoint."""
    nvrx = H.find_nvrx()
    if nvrx is None:
        pytest.skip("nvidia-resiliency-ext is not installed (make setup puts it in .venv/nvrx; or pip install "
                    "'miles[ft]')")
    num_rollout, batch, n = 4, 2, 4
    save = tmp_path / "ckpt"
    flags = [*H.layout_flags(2, 1), *H.quickstart_flags(quickstart, num_rollout=num_rollout, batch=batch, n=n,
                                                          response_len=8),
             "--save", str(save), "--save-interval", "1", "--output-dir", str(tmp_path / "run"),
             "--distributed-timeout-minutes", "5"]
    launcher = [sys.executable, "-c", "import sys; from nvidia_resiliency_ext.fault_tolerance.launcher import main; "
                "sys.argv[0] = 'ft_launcher'; sys.exit(main())", "--ft-initial-rank-heartbeat-timeout", "180",
                "--ft-rank-heartbeat-timeout", "20", "--ft-workload-check-interval", "1"]
    # rollout 2 stays in generation for 5 s of the first attempt (under the 20 s heartbeat timeout), so the SIGSTOP
    # below lands before step 2 is trained and saved
    job = H.launch(flags, nproc=3, workdir=tmp_path, max_restarts=1, launcher=launcher, nvrx=nvrx,
                   env={"MILES_FT_HOLD": json.dumps({"rollout": 2, "seconds": 5})})
    try:
        deadline = time.monotonic() + 300
        while True:  # SIGSTOP trainer rank 1 once rollout 2 is being generated (rollout 1 is checkpointed)
            assert job.proc.poll() is None and time.monotonic() < deadline, H.tail(job.log)
            samples, _ = H.records(job)
            if any(s["rollout_id"] == 2 for s in samples):
                break
            time.sleep(0.05)
        first_pid, victim, driver = samples[0]["pid"], H.rank_pid(job, 1), H.rank_pid(job, 0)
        assert victim is not None and (save / "step_00000001" / "COMPLETE").exists()
        H.os.kill(victim, signal.SIGSTOP)
        t_stop = time.monotonic()
        while H.rank_pid(job, 0) in (driver, None):  # the launcher ends the attempt and starts the next one
            assert job.proc.poll() is None and time.monotonic() - t_stop < 150, H.tail(job.log, 120)
            time.sleep(0.2)
        relaunch_s = time.monotonic() - t_stop
        rc = job.wait(timeout=420)
    finally:
        job.kill()
    log = job.log.read_text(errors="replace")
    assert rc == 0, H.tail(job.log, 120)
    # 20 s heartbeat timeout + teardown and restart (about 23 s measured, docs/benchmarks.md)
    assert relaunch_s < 60, f"ft_launcher took {relaunch_s:.0f}s to restart the group after a rank hung"
    assert "rank heartbeats on" in log, H.tail(job.log, 120)
    assert "resuming at rollout 2 (checkpoint of rollout 1)" in log, H.tail(job.log, 120)
    samples, _ = H.records(job)
    second = [s for s in samples if s["pid"] != first_pid]
    assert sorted({s["rollout_id"] for s in second}) == [2, 3]
    assert [m["rollout_id"] for m in H.metrics(tmp_path)] == list(range(num_rollout))
    assert (save / "step_00000003" / "COMPLETE").exists()
