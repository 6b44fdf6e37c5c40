"""Fault-tolerance soak: the quickstart GRPO run with engines killed at random moments.

    python benchmarks/ft_soak.py [--num-rollout 12] [--seed 0] [--out outputs/ft_soak]

Runs ``train.py`` under torchrun on this machine (1 FSDP trainer rank + 2 embedded engines, CPU, gloo,
the real sglang-router, a torchft lighthouse, ``--use-fault-tolerance``) with faults injected into the
driver by ``tests/e2e/ft_plugins.py``, at moments drawn from ``--seed``:

- a SIGKILL of an engine while a rollout's requests are in flight (during generation);
- a SIGKILL of an engine inside a weight sync (after its first bucket);
- the same engine SIGKILLed again as soon as it is back in rotation (twice in a row);
- a SIGSTOP of an engine during generation (a hang, found by the health probes).

Per fault it prints: time from the fault to the engine's removal from the router, time from the fault to
the engine being back in rotation (restarted, caught up to the current weights, verified), requests
retried during the outage, and samples lost (a prompt's group short of a sample) or duplicated: both must
be 0. ``--json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

import ft_harness as H  # noqa: E402


def fault_plan(num_rollout: int, rng: random.Random) -> list[dict]:
    """Four faults spread over the run, in an order that leaves time to recover (engines restart in ~15 s)."""
    if num_rollout < 10:
        raise SystemExit(f"--num-rollout {num_rollout}: the soak needs at least 10 rollouts to space four faults")
    q = num_rollout // 5
    gen_r = rng.randint(1, q)
    sync_v = rng.randint(gen_r + 3, 2 * q + 2)  # weight version v is synced after rollout v - 2
    stop_r = rng.randint(3 * q, 4 * q)
    return [
        {"name": "kill during generation", "signal": "KILL", "engine": 0, "rollout": gen_r,
         "after_s": round(rng.uniform(0.1, 0.6), 2)},
        {"name": "kill during a weight sync", "signal": "KILL", "engine": 1, "sync_version": sync_v,
         "after_buckets": rng.randint(1, 3)},
        {"name": "kill again once back (twice in a row)", "signal": "KILL", "engine": 0, "again_after": 0,
         "rollout": gen_r + 1, "after_s": round(rng.uniform(0.1, 0.6), 2)},
        {"name": "hang (SIGSTOP) during generation", "signal": "STOP", "engine": 1, "rollout": stop_r,
         "after_s": round(rng.uniform(0.1, 0.6), 2)},
    ]


def analyse(job: H.Job, workdir: Path, plan: list[dict], num_rollout: int, batch: int, n: int) -> dict:
    samples, injected = H.records(job)
    events = H.ft_events(workdir)
    census = H.sample_census(samples)
    expected = {(r, g, i) for r in range(num_rollout) for g in range(batch) for i in range(g * n, (g + 1) * n)}
    ok = {k for k in census if k in expected}
    rows = []
    for f in injected:
        name = next((p["name"] for p in plan if {k: v for k, v in p.items() if k != "name"} == f["fault"]), "?")
        eid = f["fault"]["engine"]
        t = f.get("t")
        removed = next((e for e in events if e["event"] == "removed" and e["engine_id"] == eid and t
                        and e["down_seen"] >= t - 1), None)
        back = next((e for e in events if e["event"] == "recovered" and e["engine_id"] == eid and t
                     and e["down_seen"] >= t - 1), None)
        rows.append({
            "fault": name, "engine": eid, "where": f["where"],
            "removal_s": round(removed["removed"] - t, 2) if removed else None,
            "back_in_rotation_s": round(back["admitted"] - t, 2) if back else None,
            "requests_retried": (back["requests_retried"] - (f.get("retries") or 0)) if back and
            back.get("requests_retried") is not None else None,
        })
    return {"faults": rows, "samples_expected": len(expected), "samples_done": len(ok),
            "samples_lost": len(expected - ok), "samples_duplicated": sum(v - 1 for v in census.values() if v > 1),
            "not_injected": [p["name"] for p in plan if all(p["name"] != r["fault"] for r in rows)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rollout", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="Draws the fault moments.")
    p.add_argument("--out", type=Path, default=Path("outputs/ft_soak"))
    p.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    batch, n, length = 4, 8, 96
    data = H.build_quickstart(args.out / "quickstart")
    workdir = args.out / f"run_seed{args.seed}_{int(time.time())}"
    plan = fault_plan(args.num_rollout, random.Random(args.seed))
    flags = [*H.layout_flags(1, 2), *H.quickstart_flags(data, num_rollout=args.num_rollout, batch=batch, n=n,
                                                          response_len=length),
             *H.ft_flags(interval=1.0, timeout=3.0), "--update-weight-buffer-size", "16384",
             "--output-dir", str(workdir / "run")]
    faults = [{k: v for k, v in f.items() if k != "name"} for f in plan]
    print(f"faults (seed {args.seed}): {json.dumps(faults)}", flush=True)
    t0 = time.time()
    job = H.launch(flags, nproc=3, workdir=workdir, faults=faults)
    rc = job.wait(args.timeout)
    result = {"rc": rc, "wall_s": round(time.time() - t0, 1), "seed": args.seed, "num_rollout": args.num_rollout,
              **analyse(job, workdir, plan, args.num_rollout, batch, n)}
    print(f"\ntrain.py exit code {rc}, {result['wall_s']} s, log {job.log}")
    print(f"{'fault':40} {'engine':>6} {'removed (s)':>12} {'back in rotation (s)':>21} {'requests retried':>17}")
    for r in result["faults"]:
        print(f"{r['fault']:40} {r['engine']:>6} {r['removal_s']!s:>12} {r['back_in_rotation_s']!s:>21} "
              f"{r['requests_retried']!s:>17}")
    print(f"samples: {result['samples_done']}/{result['samples_expected']} done, {result['samples_lost']} lost, "
          f"{result['samples_duplicated']} duplicated; faults not injected: {result['not_injected'] or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if rc == 0 and result["samples_lost"] == 0 and result["samples_duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
