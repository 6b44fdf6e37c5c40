"""Weight sync end to end: a 2-rank FSDP2 trainer (torchrun, gloo) and 2 embedded engines, every mode.

One torchrun job (tests/multiprocess/weight_sync_worker.py) runs the scenarios in order and writes what
it saw; each test below checks one property. Before every sync the worker changes every shard of the
trainer (a stand-in for an optimizer step; ``sync_one`` excepted, whose contract is an unchanged trainer,
and whose newcomer holds the model dir's weights), and around it takes a sha256 digest of every tensor of
both engines (through /get_weights_by_name) and of the trainer's: ``content`` says, per engine, how many
of the 24 HF tensors of the tiny model changed in the sync and how many equal the trainer's. ``checked ==
24`` is ``--check-weight-update-equal``'s count (all 24 equal on both engines, compared bitwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.utils.net import find_free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(420)]
WORKER = Path(__file__).with_name("weight_sync_worker.py")
NUM_TENSORS = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from miles.utils.tiny_model import build_tiny_model

    work = tmp_path_factory.mktemp("weight_sync")
    model = build_tiny_model(work / "model", hidden_size=64, num_layers=2)
    out = work / "out.json"
    from _torchrun import torchrun

    proc = torchrun(WORKER, 2, find_free_port(), "--model", str(model), "--work", str(work), "--out", str(out),
                    timeout=400, env={"HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-80:])
        pytest.fail(f"weight-sync worker failed (rc {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", ["broadcast_flat", "broadcast_per_tensor", "p2p", "broadcast_after_p2p", "tensor",
                                      "disk_full", "disk_delta", "disk_corrupt_fallback", "after_restart",
                                      "p2p_after_restart", "p2p_full_buckets"])
def test_every_mode_moves_the_new_weights_into_every_engine(run: dict, scenario: str) -> None:
    s = run["scenarios"][scenario]
    assert s["checked"] == NUM_TENSORS
    c = s["content"]
    assert c["tensors"] == NUM_TENSORS
    assert c["changed"] == [NUM_TENSORS] * 2, c  # every tensor of both engines changed in this sync...
    assert c["equal"] == [NUM_TENSORS] * 2, c    # ...to the trainer's bytes
    assert s["buckets"] > 1 and s["bytes"] > 0  # 64 KiB buckets: the bucketed path really ran


def test_detached_sync_sends_the_weights_of_its_call_and_lands_before_the_next(run: dict) -> None:
    """train_async.py's sync: it returns with the engines' answer outstanding, the trainer steps on at once, and
    every engine still ends with the weights the trainer had at the call; a plain sync right after one lands it."""
    s = run["scenarios"]["broadcast_detached"]
    assert s["detached"] == 1.0 and s["buckets"] == 1            # the whole model in one request: detached
    assert s["in_flight"] is True and s["landed"] is True
    # at return the thread's part is not reported (no 0 standing for it); landing reports it, measured
    assert not {"weight_sync/transfer_s", "weight_sync/load_s", "weight_sync/gbps"} & s["metrics"].keys(), s["metrics"]
    m = s["landed_metrics"]
    assert m["weight_sync/transfer_s"] > 0 and m["weight_sync/load_s"] > 0 and m["weight_sync/rollout_id"] == 14, m
    assert m["weight_sync/total_s"] >= m["weight_sync/transfer_s"] + m["weight_sync/load_s"], m
    c = s["content"]
    assert c["changed"] == [NUM_TENSORS] * 2 and c["equal"] == [NUM_TENSORS] * 2, c  # the weights at the call
    assert s["versions"] == [str(s["version"])] * 2
    a = run["scenarios"]["broadcast_after_detached"]
    assert a["version"] == s["version"] + 2 and a["detached"] == 0.0  # a plain sync waits for its engines
    assert a["checked"] == NUM_TENSORS and a["content"]["equal"] == [NUM_TENSORS] * 2, a


def test_detached_sync_packs_the_weights_before_it_returns(run: dict) -> None:
    """The trainer changes its tensors in place right after a detached sync returns, its sender thread held until
    then: every engine still gets the values of the call (the bucket was copied before sync returned)."""
    s = run["scenarios"]["broadcast_detached_live"]
    assert s["detached"] == 1.0 and s["held"] == 1               # the gate held the detached thread
    c = s["content"]
    assert c["changed"] == [NUM_TENSORS] * 2 and c["equal"] == [NUM_TENSORS] * 2, c
    assert s["equal_to_mutated"] == [0, 0], s


def test_detached_sync_refused_by_the_engines_fails_when_landed(run: dict) -> None:
    """The engines' refusal of a detached sync is raised by land(), naming the engines and the tensor, and the
    sender's version is back to the one the engines hold (as after a plain sync that failed)."""
    r = run["detached_refused"]
    assert r["detached"] == 1.0
    assert r["error"] is not None and "no.such.weight" in r["error"], r
    assert any(url in r["error"] for url in r["urls"]), r
    assert r["version_after"] == r["version"] - 1


def test_sync_one_moves_only_the_newcomer(run: dict) -> None:
    s = run["scenarios"]["sync_one"]
    assert s["checked"] == NUM_TENSORS and s["buckets"] > 1
    # engine 0 restarted from the model dir: every tensor changed to the trainer's; engine 1 was current already
    assert s["content"] == {"tensors": NUM_TENSORS, "changed": [NUM_TENSORS, 0], "equal": [NUM_TENSORS] * 2}


def test_bucketed_and_per_tensor_paths_agree(run: dict) -> None:
    flat, per = run["scenarios"]["broadcast_flat"], run["scenarios"]["broadcast_per_tensor"]
    assert (flat["version"], per["version"]) == (1, 2) and flat["bytes"] == per["bytes"]
    assert run["versions_after_broadcast"] == ["2", "2"]


def test_disk_delta_writes_less_and_falls_back_on_a_flipped_byte(run: dict) -> None:
    delta = run["scenarios"]["disk_delta"]
    assert delta["fallbacks"] == 0 and 0 < delta["written"] < delta["bytes"]
    assert run["scenarios"]["disk_corrupt_fallback"]["fallbacks"] == 2  # both engines refused, both reloaded full


def test_missing_delta_piece_is_refused_by_the_engine(run: dict) -> None:
    assert "delta file is missing" in run["missing_piece"] and "deltas/" in run["missing_piece"]


def test_stalled_engine_fails_the_sync_within_its_timeout(run: dict) -> None:
    stall = run["stall"]
    assert stall["error"] is not None and "--update-weight-timeout=8" in stall["error"]
    assert stall["stalled_url"] in stall["error"] and "stalled or dead" in stall["error"]
    assert stall["elapsed_s"] < 8 + 5


def test_groups_reform_after_restart_and_version_is_current(run: dict) -> None:
    assert run["restarts"] == 1
    assert run["versions_after_restart"] == [run["expected_version"]] * 2
    assert run["newcomer_version_before"] != run["expected_version"]
    assert run["versions_after_sync_one"] == [run["expected_version"]] * 2
    assert run["scenarios"]["sync_one"]["version"] == run["scenarios"]["after_restart"]["version"]


def test_p2p_every_rank_sends_its_own_shard_and_engines_equal_broadcast(run: dict) -> None:
    p2p = run["scenarios"]["p2p"]
    sent = p2p["sent_per_rank"]
    # no single-rank gather: both trainer ranks sent part of every engine's bytes, each byte exactly once
    assert len(sent) == 2 and all(0 < s < p2p["bytes"] * 2 for s in sent)
    assert sum(sent) == p2p["bytes"] * 2  # 2 engines
    assert p2p["bytes"] == run["scenarios"]["broadcast_flat"]["bytes"]
    # the p2p sync moved every tensor to the trainer's bytes (test_every_mode_...), as the broadcast after it
    assert p2p["content"]["changed"] == p2p["content"]["equal"] == [NUM_TENSORS] * 2
    assert run["versions_after_p2p"] == [str(run["scenarios"]["broadcast_after_p2p"]["version"])] * 2


def test_p2p_reforms_its_group_after_engines_restart(run: dict) -> None:
    s = run["scenarios"]["p2p_after_restart"]
    assert s["checked"] == NUM_TENSORS and s["group"] is not None
    assert s["version"] == run["scenarios"]["sync_one"]["version"] + 1


def test_p2p_stalled_engine_fails_every_trainer_rank_within_its_timeout(run: dict) -> None:
    stall = run["p2p_stall"]
    source, other = stall["per_rank"]
    assert source["error"] is not None and "--update-weight-timeout=8" in source["error"]
    assert stall["stalled_url"] in source["error"]
    assert other["error"] is not None  # the other trainer rank learns of it too, and does not hang
    assert source["elapsed_s"] < 8 + 5 and other["elapsed_s"] < 8 + 5


def test_p2p_engine_refusal_ends_the_sync_on_every_rank_at_once(run: dict) -> None:
    source, other = run["p2p_refused"]
    assert source["error"] is not None and "do not tile" in source["error"]
    assert other["error"] is not None
    # the update timeout is 30 s: both ranks are out long before it (the refusers drop the group)
    assert source["elapsed_s"] < 10 and other["elapsed_s"] < 10


def test_p2p_from_full_buckets_spreads_the_sending_over_both_ranks(run: dict) -> None:
    s = run["scenarios"]["p2p_full_buckets"]
    assert len(s["sent_per_rank"]) == 2 and all(0 < x < s["bytes"] * 2 for x in s["sent_per_rank"])
    assert sum(s["sent_per_rank"]) == s["bytes"] * 2
