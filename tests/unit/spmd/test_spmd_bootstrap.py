"""bootstrap() in this process: a world of one, every group created, the guard naming its group."""

from __future__ import annotations

import pytest

from miles.config import parse_args
from miles.spmd import bootstrap
from miles.spmd.errors import CollectiveTimeoutError


def test_bootstrap_single_process_world():
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("another test left a process group initialised in this process")
    cfg = parse_args(["--colocate", "--actor-num-gpus-per-node", "1", "--device", "cpu"], validate=False)
    ctx = bootstrap(cfg)
    try:
        assert (ctx.world.launcher, ctx.world.rank, ctx.world.world_size) == ("single", 0, 1)
        assert ctx.roles == {"driver", "trainer", "engine_leader"} and ctx.is_driver and ctx.is_engine_leader
        g = ctx.groups
        assert g.trainer_group is not None and g.trainer_cpu_group is g.trainer_group  # gloo on CPU: one group
        assert set(g.engine_groups) == {0} and g.engine_groups[0] is not None
        assert g.trainer_mesh.mesh_dim_names == ("dp",) and g.trainer_mesh.size() == 1
        t = torch.ones(2)
        with g.guard("trainer"):
            dist.all_reduce(t, group=g.trainer_group)
        assert t.tolist() == [1.0, 1.0]
        with pytest.raises(CollectiveTimeoutError, match="group 'control' did not finish within 10 min"):
            with g.guard("control"):
                raise RuntimeError("Timed out waiting 600000ms for recv operation to complete")
        # a bounded wait's TimeoutError over gloo's "connection reset" (trainer.collectives._wait): the member is named
        # as gone, not reported as a 600 s timeout; a real bounded-wait timeout stays what it is
        from miles.spmd.errors import PeerGoneError
        from miles.trainer.collectives import _wait

        class _Work:
            def __init__(self, exc: Exception | None) -> None:
                self.exc = exc

            def wait(self, timeout=None):
                if self.exc is not None:
                    raise self.exc
                return False

        reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:16621: Connection reset by peer")
        with pytest.raises(PeerGoneError, match="a member of group 'trainer' exited during a collective"):
            with g.guard("trainer"):
                _wait(_Work(reset), "gathering the step's metric names", 2, 600)
        with pytest.raises(TimeoutError, match="timed out after 600s"):
            with g.guard("trainer"):
                _wait(_Work(None), "gathering the step's metric names", 2, 600)
    finally:
        ctx.close()
    assert not dist.is_initialized()
