"""``miles.utils.process_groups``: how the trainer's bounded gathers and the run's sample wire name a process group in
their errors, on a real one-rank gloo group: its ``group_desc``, else its global ranks; ``None`` is 'default'."""

from __future__ import annotations

import torch.distributed as dist

from miles.utils.process_groups import describe_group, group_name


def test_a_named_group_by_its_description_an_unnamed_one_by_its_ranks(one_rank_group) -> None:
    named = dist.new_group([0], backend="gloo", group_desc="trainer")
    unnamed = dist.new_group([0], backend="gloo")
    assert (group_name(named), describe_group(named)) == ("trainer", "'trainer' (1 ranks)")
    assert (group_name(unnamed), describe_group(unnamed, 2)) == ("ranks [0]", "'ranks [0]' (2 ranks)")
    assert (group_name(None), describe_group(None)) == ("default", "'default' (1 ranks)")


def test_the_default_group_needs_no_initialized_torch_distributed() -> None:
    assert not dist.is_initialized()
    assert describe_group(None, 2) == "'default' (2 ranks)"   # the size the caller has
    assert describe_group(None) == "'default'"                # no size to read: left out
