"""``miles.utils.process_groups``: how every bounded wait on a collective names a process group in its errors (on a real
one-rank gloo group: its ``group_desc``, else its global ranks; ``None`` is 'default') and words its timeout
(``wait_timeout_message``)."""

from __future__ import annotations

import torch.distributed as dist

from miles.utils.process_groups import LOG_HINT, describe_group, group_name, wait_timeout_message


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


def test_a_bounded_wait_words_its_timeout_in_one_line() -> None:
    """What timed out, over which group, after how long, and what to check; a backend error (gloo raises on its
    timeout) adds its first line; a caller that knows better names what to check."""
    assert wait_timeout_message("gathering weights", None, 600.0, size=2) == (
        "gathering weights over group 'default' (2 ranks) timed out after 600s; check that every rank of the group is "
        "alive and reached this call (the first error is in the log of the rank that stopped).")
    error = RuntimeError("[gloo] Timed out waiting 1500ms for recv operation to complete\nstack line")
    assert wait_timeout_message("broadcast from rank 0", None, 1.5, size=3, error=error) == (
        "broadcast from rank 0 over group 'default' (3 ranks) failed or timed out after 1.5s ([gloo] Timed out "
        "waiting 1500ms for recv operation to complete); check that every rank of the group is alive and reached "
        f"this call ({LOG_HINT}).")
    assert wait_timeout_message("all-gather", None, 2.0, size=2, error=RuntimeError(), check="the engines") == (
        "all-gather over group 'default' (2 ranks) failed or timed out after 2s (RuntimeError); check the engines.")


def test_a_bounded_wait_names_a_real_group(one_rank_group) -> None:
    control = dist.new_group([0], backend="gloo", group_desc="control")
    assert wait_timeout_message("size all-gather", control, 30.0).startswith(
        "size all-gather over group 'control' (1 ranks) timed out after 30s; check ")
