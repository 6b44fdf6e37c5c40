"""CPU threads per process (miles.spmd.threads): each phase's processes share the cores they run on, the user's
OMP_NUM_THREADS fixes every count, torchrun's own OMP_NUM_THREADS=1 does not."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_args
from miles.spmd.roles import build_role_plan
from miles.spmd.threads import (
    _cgroup_quota,
    cpu_ranges,
    default_openmp_env,
    describe_threads,
    engine_processes,
    parse_cpu_ranges,
    plan_threads,
    user_omp_threads,
)


def plan(world: int, *flags: str):
    return build_role_plan(parse_args(list(flags), validate=False).cluster, world)


SINGLE = ("--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2")
QUICKSTART = ("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--num-gpus-per-node", "4")


def threads(p, cpus, overlap=False):
    return [(t.trainer, t.engine) for t in (plan_threads(p, r, cpus, overlap=overlap) for r in range(p.world_size))]


def test_one_trainer_and_one_engine_each_get_every_core_in_their_phase():
    p = plan(2, *SINGLE)
    assert threads(p, [[0, 1]] * 2) == [(2, 1), (1, 2)]  # rank 0 trains on 2 threads, rank 1's engine generates on 2
    assert threads(p, [list(range(16))] * 2) == [(16, 1), (1, 16)]


def test_ranks_that_compute_at_once_split_the_cores():
    p = plan(4, *QUICKSTART)  # 2 trainer ranks train together, then 2 engines generate together
    assert threads(p, [list(range(8))] * 4) == [(4, 1), (4, 1), (1, 4), (1, 4)]
    assert threads(p, [[0, 1]] * 4) == [(1, 1), (1, 1), (1, 1), (1, 1)]
    assert threads(p, [[0]] * 4) == [(1, 1), (1, 1), (1, 1), (1, 1)]  # never 0


def test_train_async_shares_the_cores_among_trainers_and_engines():
    assert threads(plan(2, *SINGLE), [list(range(8))] * 2, overlap=True) == [(4, 1), (1, 4)]
    assert threads(plan(4, *QUICKSTART), [list(range(8))] * 4, overlap=True) == [(2, 1), (2, 1), (1, 2), (1, 2)]


def test_ranks_bound_to_their_own_cores_do_not_share():
    p = plan(4, *QUICKSTART)
    own = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]  # e.g. srun --cpus-per-task with a per-task binding
    assert threads(p, own) == [(3, 1), (3, 1), (1, 2), (1, 2)]
    socket = [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]  # one trainer and one engine per socket
    assert threads(p, socket) == [(4, 1), (4, 1), (1, 4), (1, 4)]


def test_gpu_node_numa_halves_and_other_nodes():
    # 2 nodes x 8 GPU slots: 8 trainer ranks on node 0 (4 per NUMA half of 32 CPUs), 4 engines of 2 on node 1
    p = plan(16, "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "2",
             "--num-gpus-per-node", "8")
    halves = [list(range(16)) if r % 8 < 4 else list(range(16, 32)) for r in range(16)]
    got = threads(p, halves)
    assert got[:8] == [(4, 1)] * 8  # 16 CPUs shared by 4 trainer ranks
    assert engine_processes(p) == [8, 10, 12, 14]
    assert [got[r] for r in (8, 10, 12, 14)] == [(1, 8), (1, 8), (1, 8), (1, 8)]  # 2 engine leaders per half
    assert [got[r] for r in (9, 11, 13, 15)] == [(1, 1)] * 4  # GPU slots of an engine: no process of their own


def test_colocated_engines_and_trainers_take_turns():
    p = plan(2, "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "1",
             "--num-gpus-per-node", "2")
    assert threads(p, [list(range(8))] * 2) == [(4, 4), (4, 4)]


def test_train_only_gets_every_core():
    assert threads(plan(1, "--debug-train-only", "--actor-num-gpus-per-node", "1"), [[0, 1, 2, 3]]) == [(4, 1)]


def test_user_omp_num_threads_fixes_every_process():
    p = plan(2, *SINGLE)
    for r in range(2):
        t = plan_threads(p, r, [[0, 1]] * 2, overlap=False, fixed=3)
        assert (t.trainer, t.engine, t.source) == (3, 3, "OMP_NUM_THREADS")
    every = [plan_threads(p, r, [[0, 1]] * 2, overlap=False, fixed=3) for r in range(2)]
    assert describe_threads(p, every) == "CPU threads: 3 in every process (OMP_NUM_THREADS)"
    every = [plan_threads(p, r, [[0, 1]] * 2, overlap=False) for r in range(2)]
    assert describe_threads(p, every).startswith("CPU threads: 2 per trainer rank while it trains, 2 per engine "
                                                 "process while it generates")


def test_omp_num_threads_given_or_set_by_torchrun():
    assert user_omp_threads({}) is None
    assert user_omp_threads({"OMP_NUM_THREADS": "4"}) == 4
    assert user_omp_threads({"OMP_NUM_THREADS": "4,2"}) == 4  # OpenMP's nested list: the outer level
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1"}
    assert user_omp_threads(torchrun, launcher_env={"PATH": "/bin"}) is None  # torchrun added it
    assert user_omp_threads(torchrun, launcher_env={"OMP_NUM_THREADS": "1"}) == 1  # the user gave it to torchrun
    assert user_omp_threads(torchrun, launcher_env={}, train_env_vars={"OMP_NUM_THREADS": "1"}) == 1  # --train-env-vars
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match=f"OMP_NUM_THREADS='{bad}' is not a positive whole number"):
            user_omp_threads({"OMP_NUM_THREADS": bad})


def test_cpu_ranges_round_trip_and_cgroup_quota(tmp_path):
    for cpus in ([0], [0, 1], [0, 1, 2, 5], [3, 5, 6, 7, 9], list(range(192))):
        assert parse_cpu_ranges(cpu_ranges(cpus)) == cpus
    assert cpu_ranges(list(range(192))) == "0-191"
    f = tmp_path / "cpu.max"
    f.write_text("250000 100000\n")
    assert _cgroup_quota(str(f)) == 3
    f.write_text("max 100000\n")
    assert _cgroup_quota(str(f)) is None
    assert _cgroup_quota(str(tmp_path / "absent")) is None


def test_openmp_threads_spin_briefly_unless_the_user_chose():
    env: dict[str, str] = {}
    assert default_openmp_env(env) and env == {"GOMP_SPINCOUNT": "10000"}
    for given in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(given)
        assert not default_openmp_env(env) and env == given
