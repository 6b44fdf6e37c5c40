"""``--custom-reward-post-process-path module.function``: Miles's hook between rewards and training.

    def post_process(args, samples: list[Sample]) -> tuple[list[float], list[float]]  # (raw_rewards, rewards)

It is called once per training rollout with the rollout's rewarded samples, in group order. While it
is set, each sample keeps its reward function's value unconverted (a number or a dict: Miles's
``sample.reward``; ``sample.get_reward_value(args)`` reads it); afterwards ``sample.reward`` is the
returned reward and ``metadata["raw_reward"]`` the raw one (``rollout/raw_reward`` is their mean). The
trainer's ``--advantage-estimator`` then starts from these rewards (for grpo/gspo that still means
group normalization unless ``--disable-rewards-normalization``; in Miles the post-process replaces it).
Evaluation rollouts are not post-processed. The call is bounded by ``--rm-timeout``; a failure or an
answer of the wrong shape stops the rollout with a message naming the function.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from miles.rollout.plugins import call_bounded, choose_arity, load_function
from miles.types import Sample, SampleStatus
from miles.utils.errors import MilesError

FLAG = "--custom-reward-post-process-path"
FORMS = "def f(args, samples) -> (raw_rewards, rewards)"


class RewardPostProcessError(MilesError):
    """The reward post-process failed or answered something other than two lists of finite rewards."""


def _number(v: Any) -> float | None:
    if not isinstance(v, numbers.Real) and callable(getattr(v, "item", None)):
        v = v.item()
    if isinstance(v, numbers.Real) and math.isfinite(float(v)):
        return float(v)
    return None


class RewardPostProcess:
    def __init__(self, path: str, args: Any, timeout: float) -> None:
        self.path, self.args, self.timeout = path, args, timeout
        self.fn = load_function(path, FLAG)
        choose_arity(self.fn, (2,), FLAG, path, FORMS)

    async def apply(self, groups: list[list[Sample]]) -> dict[str, float]:
        """Post-process the rewarded samples of ``groups`` in place; returns metrics."""
        todo = [s for g in groups for s in g
                if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.reward is not None]
        if not todo:
            return {}
        what = f"{FLAG} {self.path}"
        try:
            out = await call_bounded(self.fn, (self.args, todo), self.timeout, what)
        except TimeoutError as e:
            raise RewardPostProcessError(str(e)) from None
        except Exception as e:
            raise RewardPostProcessError(f"{what} raised {type(e).__name__}: {e}") from e
        if not (isinstance(out, tuple | list) and len(out) == 2 and all(isinstance(x, list | tuple) for x in out)
                and len(out[0]) == len(todo) and len(out[1]) == len(todo)):
            shape = type(out).__name__
            if isinstance(out, tuple | list):
                shape = f"{shape} of {len(out)}" + (f" with lengths {[len(x) if isinstance(x, list | tuple) else None for x in out]}"
                                                    if len(out) == 2 else "")
            raise RewardPostProcessError(f"{what} returned {shape}; expected (raw_rewards, rewards), two lists of "
                                         f"{len(todo)} numbers")
        raws, rewards = [_number(v) for v in out[0]], [_number(v) for v in out[1]]
        bad = next((i for i, (a, b) in enumerate(zip(raws, rewards)) if a is None or b is None), None)
        if bad is not None:
            raise RewardPostProcessError(f"{what}: entry {bad} is ({out[0][bad]!r}, {out[1][bad]!r}); every raw "
                                         "reward and reward must be a finite number")
        for s, raw, r in zip(todo, raws, rewards):
            s.metadata["raw_reward"] = raw
            s.reward = r
        return {"rollout/raw_reward": sum(raws) / len(raws)}  # type: ignore[arg-type]
