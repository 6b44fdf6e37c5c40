"""An old flag name and its new name together are one error line, not "the last one wins"."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_args

BASE = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "1"]


@pytest.mark.parametrize("old,new,a,b", [("--rollout-router-ip", "--sglang-router-ip", "10.0.0.1", "10.0.0.2"),
                                         ("--rollout-router-port", "--sglang-router-port", "3000", "3001")])
def test_old_and_new_router_flag_together_is_one_line(old, new, a, b):
    with pytest.raises(ConfigError, match=f"{old} and {new} are the same flag .* keep only {new}") as e:
        parse_args(BASE + [old, a, f"{new}={b}"])
    assert "\n" not in str(e.value)
