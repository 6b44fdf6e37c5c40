"""The command channel over a real 2-rank gloo group: commands in order, keep-alives skipped, JSON gathers,
and a follower that waits for a silent driver fails within the timeout instead of hanging."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, scenario: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    from miles.run.control import CommandChannel, all_gather_json, broadcast_json

    group = dist.new_group([0, 1], backend="gloo")
    try:
        if scenario == "commands":
            chan = CommandChannel(group, src=0, timeout=20, keepalive_s=0.05)
            gathered = all_gather_json({"rank": rank, "url": f"http://h:{rank}"}, group, timeout=20)
            plan = broadcast_json({"n": 3} if rank == 0 else None, group, 0, timeout=20)
            if rank == 0:
                import time

                with chan.keepalive():
                    time.sleep(0.4)  # several keep-alives go out meanwhile
                chan.send({"cmd": "train", "rollout_id": 1})
                chan.send({"cmd": "stop"})
                q.put((rank, gathered, plan, None))
            else:
                got = [chan.recv(), chan.recv()]
                q.put((rank, gathered, plan, got))
        elif scenario == "silent_driver":
            chan = CommandChannel(group, src=0, timeout=2)
            if rank == 1:
                try:
                    chan.recv()
                    q.put((rank, "no error"))
                except (TimeoutError, RuntimeError) as e:
                    q.put((rank, str(e)))
            else:
                import time

                time.sleep(4)  # alive past the follower's 2 s timeout: it must time out, not see a dead peer
                q.put((rank, "slept"))
    except Exception as e:  # report instead of dying silently
        q.put((rank, f"worker error: {type(e).__name__}: {e}"))
    finally:
        q.close()
        q.join_thread()  # flush before leaving
        os._exit(0)  # skip process-group teardown (the silent scenario leaves one half-done)


def _run(scenario: str) -> dict:
    from miles.utils.net import find_free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, scenario, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        item = q.get(timeout=60)
        out[item[0]] = item[1:]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


@pytest.mark.multiprocess
def test_commands_keepalive_and_gathers():
    out = _run("commands")
    gathered, plan, cmds = out[1]
    assert gathered == [{"rank": 0, "url": "http://h:0"}, {"rank": 1, "url": "http://h:1"}] == out[0][0]
    assert plan == {"n": 3} == out[0][1]
    assert cmds == [{"cmd": "train", "rollout_id": 1}, {"cmd": "stop"}]  # keep-alives never surface


@pytest.mark.multiprocess
def test_follower_times_out_on_silent_driver():
    out = _run("silent_driver")
    msg = out[1][0]
    assert "within 2" in msg or "timed out" in msg or "Timed out" in msg, msg
