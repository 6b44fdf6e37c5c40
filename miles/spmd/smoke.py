"""A collective smoke test of the SPMD plane under any launcher.

    torchrun --nproc-per-node 4 -m miles.spmd.smoke --actor-num-gpus-per-node 2 --rollout-num-gpus 2
    mpirun -n 4 python -m miles.spmd.smoke --colocate --actor-num-gpus-per-node 4 --rollout-num-gpus-per-engine 2
    srun -n 4 python -m miles.spmd.smoke ...

Every rank bootstraps (world, plan, groups), then checks: an all-reduce on the trainer group (and its
gloo twin and DeviceMesh), a broadcast from each engine's leader over that engine's group, and a
broadcast from the driver over the control group carrying the plan's fingerprint (so every rank
proves it built the same plan). Each rank prints one line:

    SMOKE OK rank=3 roles=engine_leader engine=1 node=0 local_rank=3 device=cpu launcher=torchrun

``--smoke-engine-argv builtin`` (or a command, with ``{engine_id}``, ``{rank}``, ``{node_rank}`` and
``{out}`` filled in) makes every engine leader supervise a child; the built-in child reports its
environment, which must carry no launcher variable. ``--smoke-kill-engine`` then SIGKILLs the child
and requires it to come back while the rank carries on with the remaining collectives.
``--smoke-hold S`` keeps every rank (and its engine child) up for S seconds after its line, like a long
job (the launcher-death tests kill the launcher then).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from miles.spmd.errors import run_main

_CHILD = r"""
import json, os, sys, time
out = sys.argv[1]
with open(out + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(), "env": sorted(os.environ)}, f)
os.replace(out + ".tmp", out)
deadline = time.time() + float(sys.argv[2])
while time.time() < deadline:
    time.sleep(0.2)
"""


class SmokeFailure(RuntimeError):
    """A collective returned the wrong value: a bug in the plane, not a user mistake."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m miles.spmd.smoke", add_help=False)
    p.add_argument("--smoke-engine-argv", default=None,
                   help="'builtin' or a command each engine leader supervises ({engine_id} {rank} {node_rank} {out}).")
    p.add_argument("--smoke-kill-engine", action="store_true", help="SIGKILL the child and require a restart.")
    p.add_argument("--smoke-dir", default=None, help="Where children write their reports (default: a temp dir).")
    p.add_argument("--smoke-timeout", type=float, default=60.0, help="Seconds to wait for a child to (re)start.")
    p.add_argument("--smoke-exit-rank", type=int, default=None,
                   help="Fault injection: this rank exits (code 0) before the control collectives.")
    p.add_argument("--smoke-hold", type=float, default=0.0,
                   help="Seconds every rank stays up after its checks (engine children running), like a long job.")
    return p


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SmokeFailure(f"smoke check failed: {what}")


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SmokeFailure(f"smoke: timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _supervise_engine(ctx, opts, cleanup: contextlib.ExitStack) -> str:
    """Start (and with --smoke-kill-engine, kill and see restarted) this leader's engine child.

    The child is stopped when ``cleanup`` closes (at the end of the smoke test, after any --smoke-hold)."""
    from miles.spmd.supervisor import SCRUB_EXACT, SCRUB_PREFIXES, EngineSupervisor

    spec, rank = ctx.engine, ctx.world.rank
    own_dir = opts.smoke_dir is None
    out_dir = Path(tempfile.mkdtemp(prefix="miles-smoke-") if own_dir else opts.smoke_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / f"engine{spec.engine_id}-rank{rank}.json"
    report.unlink(missing_ok=True)
    fill = {"engine_id": spec.engine_id, "rank": rank, "node_rank": spec.engine_node_rank(rank), "out": str(report)}
    if opts.smoke_engine_argv == "builtin":
        argv = [sys.executable, "-c", _CHILD, str(report), str(opts.smoke_timeout * 4 + opts.smoke_hold)]
    else:
        argv = [a.format(**fill) for a in shlex.split(opts.smoke_engine_argv)]
    if own_dir:
        cleanup.callback(shutil.rmtree, out_dir, ignore_errors=True)
    sup = EngineSupervisor(argv, env={"MILES_ENGINE_ID": str(spec.engine_id)}, name=f"engine{spec.engine_id}",
                           max_restarts=2, restart_backoff=0.2).start()
    cleanup.callback(sup.stop, timeout=5)
    first = sup.pid
    if opts.smoke_engine_argv == "builtin":
        _wait_for(report.exists, opts.smoke_timeout, f"engine {spec.engine_id}'s child report {report}")
        info = json.loads(report.read_text())
        leaked = [k for k in info["env"] if k in SCRUB_EXACT or k.startswith(SCRUB_PREFIXES)]
        _check(not leaked, f"launcher variables leaked into the engine's environment: {leaked}")
        _check(info["pgid"] != os.getpgid(0), "the engine shares the rank's process group")
        report.unlink()
    if opts.smoke_kill_engine:
        sup.kill()
        _wait_for(lambda: sup.restarts >= 1 and sup.alive and sup.pid != first, opts.smoke_timeout,
                  f"engine {spec.engine_id} to restart after SIGKILL")
        if opts.smoke_engine_argv == "builtin":
            _wait_for(report.exists, opts.smoke_timeout, "the restarted child's report")
    _check(sup.alive, f"engine {spec.engine_id}'s child is not running")
    return f" engine_pid={sup.pid} engine_restarts={sup.restarts}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(_parser().format_help().replace("usage:", "smoke options:", 1) + "\n")
    opts, rest = _parser().parse_known_args(argv)
    from miles.config import parse_args
    from miles.spmd import bootstrap

    cfg = parse_args(rest, validate=False)
    ctx = bootstrap(cfg)

    import torch
    import torch.distributed as dist

    world, plan, groups = ctx.world, ctx.plan, ctx.groups
    rank = world.rank
    if ctx.is_trainer:
        t = torch.tensor([float(rank + 1)], device=world.device)
        with groups.guard("trainer"):
            dist.all_reduce(t, group=groups.trainer_group)
        want = float(sum(r + 1 for r in plan.trainer_ranks))
        _check(t.item() == want, f"trainer all-reduce gave {t.item()}, expected {want}")
        c = torch.ones(1)
        with groups.guard("trainer_cpu"):
            dist.all_reduce(c, group=groups.trainer_cpu_group)
        _check(c.item() == len(plan.trainer_ranks), f"trainer_cpu all-reduce gave {c.item()}")
        mesh = groups.trainer_mesh
        _check(mesh is not None and mesh.size() == len(plan.trainer_ranks) and mesh.get_local_rank("dp")
               == plan.trainer_ranks.index(rank), f"trainer DeviceMesh {mesh}")
    spec = ctx.engine
    if spec is not None:
        value = float(spec.engine_id * 1000 + spec.leader_rank)
        t = torch.tensor([value if rank == spec.leader_rank else -1.0])
        with groups.guard(f"engine{spec.engine_id}"):
            dist.broadcast(t, src=spec.leader_rank, group=groups.engine_groups[spec.engine_id])
        _check(t.item() == value, f"engine {spec.engine_id} broadcast gave {t.item()}, expected {value}")
    with contextlib.ExitStack() as cleanup:  # engine children stop when the checks (and any hold) end
        extra = ""
        if opts.smoke_engine_argv and ctx.is_engine_leader:
            extra = _supervise_engine(ctx, opts, cleanup)
        if opts.smoke_exit_rank == rank:
            sys.stdout.flush()
            os._exit(0)  # a rank vanishing without an error: its peers must not hang
        payload = [{"fingerprint": plan.fingerprint(), "world_size": world.world_size}] if ctx.is_driver else [None]
        with groups.guard("control"):
            dist.broadcast_object_list(payload, src=plan.driver_rank, group=groups.control_group)
            places = [None] * world.world_size
            dist.all_gather_object(places, (world.node_rank, world.hostname), group=groups.control_group)
        _check(payload[0] == {"fingerprint": plan.fingerprint(), "world_size": world.world_size},
               f"control broadcast gave {payload[0]}, this rank's plan is {plan.fingerprint()}")
        for r, (node, host) in enumerate(places):  # ranks of one planned node share the launcher's node
            if plan.node_of(r) == plan.node_of(rank):
                _check(node == world.node_rank, f"rank {r} shares planned node {plan.node_of(r)} with rank {rank} "
                                                f"but runs on launcher node {node} ({host})")
        roles = ",".join(sorted(ctx.roles))
        backend = dist.get_backend(groups.trainer_group) if groups.trainer_group is not None else "-"
        extra = f" backend={backend} cpus={len(os.sched_getaffinity(0))}{extra}"
        line = (f"SMOKE OK rank={rank} roles={roles} engine={spec.engine_id if spec else '-'} node={world.node_rank} "
                f"local_rank={world.local_rank} device={world.device} launcher={world.launcher} "
                f"plan={plan.fingerprint()}{extra}\n")
        sys.stdout.write(line)  # one write: launchers that merge ranks' output must not split the line
        sys.stdout.flush()
        if opts.smoke_hold > 0:  # stay up like a long job (engine children running) until the launcher ends us
            time.sleep(opts.smoke_hold)
    ctx.close()
    return 0


if __name__ == "__main__":
    run_main(main)
