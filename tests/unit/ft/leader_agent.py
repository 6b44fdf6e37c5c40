"""An engine leader for tests: the real EngineSupervisor runs a child command, the real EngineHeartbeat
heartbeats for it to the lighthouse, exactly as an engine's leader rank does.

    python leader_agent.py --lighthouse ADDR --engine-id I --url URL --pid-file F [--max-restarts N]
        [--interval S --timeout S --first-wait S] -- CHILD ARGV...

The child's pid and incarnation are written to --pid-file whenever they change, so that the test can
SIGKILL or SIGSTOP the engine process itself (the leader lives on and restarts it in place).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

from miles.config.ft import FTConfig
from miles.ft.heartbeat import start_engine_heartbeat
from miles.ft.timing import ft_timings
from miles.spmd.supervisor import EngineSupervisor
from miles.utils.logging import configure_logging


def _publish_pid(sup: EngineSupervisor, path: Path, stop: threading.Event) -> None:
    last = None
    while not stop.wait(0.05):
        now = (sup.pid, sup.restarts)
        if now != last and sup.alive:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{now[0]} {now[1]}")
            os.replace(tmp, path)
            last = now


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--engine-id", type=int, required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--pid-file", type=Path, required=True)
    p.add_argument("--log", type=Path, default=None)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=1.0)
    p.add_argument("--first-wait", type=float, default=10.0)
    p.add_argument("--startup-timeout", type=float, default=0.0)
    p.add_argument("child", nargs=argparse.REMAINDER)
    args = p.parse_args()
    child = args.child[1:] if args.child[:1] == ["--"] else args.child
    configure_logging(rank=args.engine_id, role="leader", all_ranks=True)
    timings = ft_timings(FTConfig(use_fault_tolerance=True, rollout_health_check_interval=args.interval,
                                  rollout_health_check_timeout=args.timeout,
                                  rollout_health_check_first_wait=args.first_wait, max_engine_restarts=args.max_restarts),
                         engine_startup_timeout=args.startup_timeout)
    sup = EngineSupervisor(child, name=f"engine{args.engine_id}", log_path=args.log, max_restarts=args.max_restarts,
                           restart_backoff=0.2).start()
    stop = threading.Event()
    threading.Thread(target=_publish_pid, args=(sup, args.pid_file, stop), daemon=True).start()
    hb = start_engine_heartbeat(args.engine_id, sup, args.url, args.lighthouse, timings)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    hb.stop()
    sup.stop(timeout=5)


if __name__ == "__main__":
    main()
