"""Values the run derives from the flags (and the data size), computed once on the driver and logged.

    plan = resolve_run(cfg, num_prompts=len(dataset))   # RunPlan; every derived value is logged
    plan.to_dict() / RunPlan.from_dict(...)             # travels to the other ranks as JSON

Derivations (Miles's batch invariant, ``docs/flags.md``):

- ``num_rollout``: ``--num-rollout``, else ``--num-epoch`` x (prompts // ``--rollout-batch-size``);
- ``num_steps_per_rollout``: ``--num-steps-per-rollout``, else rollout samples / ``--global-batch-size``,
  else 1; ``global_batch_size`` = rollout samples / steps (rollout samples = ``--rollout-batch-size`` x
  ``--n-samples-per-prompt``); ``--use-dynamic-global-batch-size``: 1 step of the rollout's samples (the trainer
  takes whatever number arrives);
- offloading when colocated: ``--offload-train`` / ``--offload-rollout`` default to ``--colocate`` (or
  ``--offload``).
Nothing here rewrites the config; the plan is a separate object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.config.base import ConfigError
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.config import MilesConfig

logger = get_logger(__name__)


@dataclass(kw_only=True)
class RunPlan:
    num_rollout: int
    num_steps_per_rollout: int
    global_batch_size: int
    rollout_samples: int
    offload_train: bool
    offload_rollout: bool
    output_dir: str
    start_rollout_id: int = 0
    engine_api_key: str | None = None
    engine_kind: str = "embedded"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunPlan:
        return cls(**d)


def derive_num_rollout(cfg: MilesConfig, num_prompts: int | None) -> int:
    d = cfg.data
    if d.num_rollout is not None:
        if d.num_epoch is not None:
            logger.warning("--num-rollout %d and --num-epoch %d both given: --num-rollout wins", d.num_rollout, d.num_epoch)
        return d.num_rollout
    if d.num_epoch is None:
        raise ConfigError("--num-rollout is required (there is no default since Miles 0.1.0): add --num-rollout N, "
                          "or --num-epoch E to derive it from the data size.")
    if num_prompts is None:
        raise ConfigError("--num-epoch needs --prompt-data to count the prompts; pass --num-rollout instead.")
    if not d.rollout_batch_size:
        raise ConfigError(f"--num-epoch {d.num_epoch} needs --rollout-batch-size N (prompts per rollout) to derive "
                          "the number of rollouts; add it, or pass --num-rollout.")
    per_epoch = num_prompts // d.rollout_batch_size
    if per_epoch == 0:
        raise ConfigError(f"--rollout-batch-size {d.rollout_batch_size} is larger than the prompt data ({num_prompts} "
                          "prompts): lower it, or pass --num-rollout.")
    n = per_epoch * d.num_epoch
    logger.info("--num-epoch %d x (%d prompts // --rollout-batch-size %d) -> num_rollout %d", d.num_epoch, num_prompts,
                d.rollout_batch_size, n)
    return n


def derive_steps(cfg: MilesConfig) -> tuple[int, int, int]:
    """(num_steps_per_rollout, global_batch_size, rollout_samples)."""
    d = cfg.data
    samples = (d.rollout_batch_size or 0) * d.n_samples_per_prompt
    if d.use_dynamic_global_batch_size:     # one step over whatever the rollout gives (validate.py checks the rest)
        return 1, samples, samples
    if d.num_steps_per_rollout is not None:
        steps = d.num_steps_per_rollout
    elif d.global_batch_size is not None:
        if samples % d.global_batch_size:
            raise ConfigError(f"--global-batch-size {d.global_batch_size} must divide --rollout-batch-size x "
                              f"--n-samples-per-prompt = {samples}.")
        steps = samples // d.global_batch_size
    else:
        steps = 1
    if samples and samples % steps:
        raise ConfigError(f"--num-steps-per-rollout {steps} must divide the {samples} samples of a rollout "
                          "(--rollout-batch-size x --n-samples-per-prompt).")
    gbs = d.global_batch_size or (samples // steps if samples else 0)
    return steps, gbs, samples


def resolve_run(cfg: MilesConfig, *, num_prompts: int | None, output_dir: str, world_size: int,
                engine_kind: str = "embedded", engine_api_key: str | None = None) -> RunPlan:
    c = cfg.cluster
    num_rollout = derive_num_rollout(cfg, num_prompts)
    steps, gbs, samples = derive_steps(cfg)
    offload_train = c.offloads_train
    offload_rollout = c.offload_rollout if c.offload_rollout is not None else (c.offload or c.colocate)
    plan = RunPlan(num_rollout=num_rollout, num_steps_per_rollout=steps, global_batch_size=gbs, rollout_samples=samples,
                   offload_train=bool(offload_train), offload_rollout=bool(offload_rollout), output_dir=output_dir,
                   engine_kind=engine_kind, engine_api_key=engine_api_key)
    logger.info("run plan: %d rollout(s) of %d samples, %d optimizer step(s) of %d samples each, offload train=%s "
                "rollout=%s, engines %s, output %s (%d ranks)", num_rollout, samples, steps, gbs, plan.offload_train,
                plan.offload_rollout, engine_kind, output_dir, world_size)
    return plan
