"""The role plan: layouts, node boundaries, multi-node engines, and every bad input's message."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_args
from miles.spmd.roles import build_role_plan, check_placement


def cluster(*flags: str):
    return parse_args(list(flags), validate=False).cluster


def test_disaggregated_trainers_first_then_engines():
    plan = build_role_plan(cluster("--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
                                   "--rollout-num-gpus-per-engine", "2"), 8)
    assert plan.mode == "disaggregated" and not plan.colocate
    assert plan.trainer_ranks == [0, 1, 2, 3]
    assert [e.ranks for e in plan.engines] == [[4, 5], [6, 7]]
    assert [(e.leader_rank, e.base_gpu_id, e.num_gpus, e.nnodes, e.node_ranks) for e in plan.engines] == [
        (4, 4, 2, 1, [4]), (6, 6, 2, 1, [6])]
    assert plan.role_of(0) == {"driver", "trainer"}
    assert plan.role_of(3) == {"trainer"}
    assert plan.role_of(4) == {"engine_leader"}
    assert plan.role_of(5) == {"engine_worker"}
    assert plan.engine_of(5).engine_id == 0 and plan.engine_of(2) is None
    assert plan.rollout_ranks == [4, 5, 6, 7]


def test_colocated_engines_over_trainer_ranks():
    plan = build_role_plan(cluster("--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2"), 4)
    assert plan.mode == "colocated" and plan.colocate
    assert plan.trainer_ranks == [0, 1, 2, 3]
    assert [e.ranks for e in plan.engines] == [[0, 1], [2, 3]]
    assert plan.role_of(0) == {"driver", "trainer", "engine_leader"}
    assert plan.role_of(1) == {"trainer", "engine_worker"}


def test_colocated_fewer_rollout_gpus_uses_the_first_trainer_ranks():
    plan = build_role_plan(cluster("--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2"), 4)
    assert [e.ranks for e in plan.engines] == [[0], [1]]
    assert plan.role_of(3) == {"trainer"}


def test_rollout_gpus_inferred_from_world_size_when_not_given():
    plan = build_role_plan(cluster("--actor-num-gpus-per-node", "2"), 5)
    assert plan.trainer_ranks == [0, 1] and [e.ranks for e in plan.engines] == [[2], [3], [4]]


def test_multi_node_layout_and_node_boundaries():
    c = cluster("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4",
                "--rollout-num-gpus-per-engine", "2", "--num-gpus-per-node", "2")
    plan = build_role_plan(c, 8)
    assert plan.num_nodes == 4
    assert [(e.ranks, e.node_index, e.base_gpu_id) for e in plan.engines] == [([4, 5], 2, 0), ([6, 7], 3, 0)]
    assert [plan.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [plan.local_gpu_of(r) for r in range(8)] == [0, 1] * 4


def test_engine_larger_than_a_node_has_one_leader_per_node():
    c = cluster("--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2",
                "--rollout-num-gpus-per-engine", "4", "--num-gpus-per-node", "2")
    plan = build_role_plan(c, 4)
    (spec,) = plan.engines
    assert (spec.ranks, spec.leader_rank, spec.nnodes, spec.node_ranks) == ([0, 1, 2, 3], 0, 2, [0, 2])
    assert plan.role_of(2) == {"trainer", "engine_leader"}
    assert plan.role_of(3) == {"trainer", "engine_worker"}
    assert [spec.engine_node_rank(r) for r in spec.ranks] == [0, 0, 1, 1]


def test_debug_modes():
    train = build_role_plan(cluster("--debug-train-only", "--actor-num-gpus-per-node", "3", "--rollout-num-gpus", "8"), 3)
    assert train.mode == "train-only" and train.engines == [] and train.trainer_ranks == [0, 1, 2]
    roll = build_role_plan(cluster("--debug-rollout-only", "--rollout-num-gpus-per-engine", "2"), 4)
    assert roll.mode == "rollout-only" and roll.trainer_ranks == []
    assert [e.ranks for e in roll.engines] == [[0, 1], [2, 3]]
    assert roll.role_of(0) == {"driver", "engine_leader"}


def test_critic_shares_actor_ranks():
    plan = build_role_plan(cluster("--actor-num-gpus-per-node", "2", "--critic-num-gpus-per-node", "2",
                                   "--rollout-num-gpus", "2"), 4)
    assert plan.critic_ranks == plan.trainer_ranks == [0, 1]
    with pytest.raises(ConfigError, match="--critic-num-gpus-per-node 1 must equal --actor-num-gpus-per-node 2"):
        build_role_plan(cluster("--actor-num-gpus-per-node", "2", "--critic-num-gpus-per-node", "1"), 4)


def test_plan_is_pure_and_describes_itself():
    c = cluster("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2")
    a, b = build_role_plan(c, 4), build_role_plan(c, 4)
    assert a.describe() == b.describe() and a.fingerprint() == b.fingerprint()
    text = a.describe()
    assert "disaggregated, 4 rank(s) on 1 node(s)" in text
    lines = text.splitlines()
    assert lines[2].split() == ["0", "0", "0", "driver,trainer", "-"]
    assert lines[5].split() == ["3", "0", "3", "engine_worker", "0"]
    assert "engine 0: ranks 2-3, leader 2 on node 0" in text
    other = build_role_plan(cluster("--colocate", "--actor-num-gpus-per-node", "4"), 4)
    assert other.fingerprint() != a.fingerprint()


@pytest.mark.parametrize(("flags", "world", "needles"), [
    (("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"), 3,
     ["world size mismatch", "needs 4 rank(s)", "started 3", "--rollout-num-gpus", "--nproc-per-node"]),
    (("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"), 5,
     ["--rollout-num-gpus-per-engine 2 does not divide 3", "Fix: --rollout-num-gpus 2"]),
    (("--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4"), 2,
     ["colocated plan: expected at most 2 rollout GPUs", "found --rollout-num-gpus 4", "drop --colocate"]),
    (("--actor-num-gpus-per-node", "4"), 4, ["leaving none for engines", "--rollout-num-gpus R"]),
    (("--actor-num-gpus-per-node", "3", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
      "--num-gpus-per-node", "4"), 5, ["engine 0 would take ranks 3-4, across nodes 0 and 1", "must fit in one node"]),
    (("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "3",
      "--num-gpus-per-node", "2"), 8, ["must take whole nodes", "multiple of 2"]),
    (("--debug-train-only", "--debug-rollout-only"), 1, ["exclude each other"]),
    (("--rollout-num-gpus-per-engine", "0",), 8, ["--rollout-num-gpus-per-engine must be at least 1, got 0"]),
])
def test_bad_plans_name_what_to_change(flags, world, needles):
    with pytest.raises(ConfigError) as info:
        build_role_plan(cluster(*flags), world)
    for needle in needles:
        assert needle in str(info.value)


def test_placement_must_match_the_launcher():
    plan = build_role_plan(cluster("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                                   "--num-gpus-per-node", "2"), 4)
    check_placement(plan, rank=3, node_rank=1, num_nodes=2, local_world_size=2)
    with pytest.raises(ConfigError, match="--num-gpus-per-node 2 ranks on each node, but the launcher put 4"):
        check_placement(plan, rank=3, node_rank=0, num_nodes=2, local_world_size=4)
    with pytest.raises(ConfigError, match="rank 1 runs on node 1, but the plan expects node 0"):
        check_placement(plan, rank=1, node_rank=1, num_nodes=2, local_world_size=2)
    # one node holding fewer ranks than --num-gpus-per-node (a CPU run with the default 8) is fine
    single = build_role_plan(cluster("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"), 4)
    check_placement(single, rank=3, node_rank=0, num_nodes=1, local_world_size=4)
    # one CPU node may simulate two of --num-gpus-per-node 2; one GPU node may not (engine GPU ids would clash)
    check_placement(plan, rank=3, node_rank=0, num_nodes=1, local_world_size=4)
    with pytest.raises(ConfigError, match="over 2 nodes of --num-gpus-per-node 2 GPUs.*Fix: --num-gpus-per-node 4"):
        check_placement(plan, rank=3, node_rank=0, num_nodes=1, local_world_size=4, on_gpu=True)
    check_placement(single, rank=3, node_rank=0, num_nodes=1, local_world_size=4, on_gpu=True)
