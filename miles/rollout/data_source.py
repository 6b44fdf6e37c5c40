"""Miles's ``miles.rollout.data_source.DataSource``: the data-buffer API a rollout function's ``data_source`` has.

    groups = data_source.get_samples(n)     # n prompts, each a group of --n-samples-per-prompt fresh samples
    data_source.add_samples(unused_groups)  # give prompts back: they are served again first

The object the run passes (:class:`miles.rollout.rollout_fn.MilesDataBuffer`) is a ``DataSource``; the run's
checkpoints save and restore the data position themselves, so ``save`` / ``load`` do nothing here.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from miles.types import Sample

__all__ = ["DataSource", "RolloutDataSourceWithBuffer"]


class DataSource(abc.ABC):
    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """``num_samples`` groups of fresh samples."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Give groups back (their prompts are served again first)."""

    def save(self, rollout_id: int) -> None:  # noqa: B027 - the run checkpoints the data position itself
        """Nothing: the run's checkpoint holds the data position."""

    def load(self, rollout_id: int | None = None) -> None:  # noqa: B027
        """Nothing: the run restores the data position from its checkpoint."""

    def get_buffer_length(self) -> int | None:
        """Groups given back and not yet served again (None: not tracked)."""
        return None


class RolloutDataSourceWithBuffer(DataSource):
    """Miles's default data source, built from the args: the ``--prompt-data`` prompts (``--input-key``,
    ``--label-key``, ... as the run reads them; shuffled per epoch with ``--rollout-shuffle``), each drawn as a group
    of ``--n-samples-per-prompt`` fresh samples; prompts given back with ``add_samples`` are served again first.

    It is this project's :class:`~miles.rollout.rollout_fn.MilesDataBuffer` over the run's data source, built the
    way the run builds its own (one implementation); ``args`` are the flags a plugin is given (with the tokenizer).
    Unlike Miles's, groups given back come back as fresh samples of their prompts, not as the given objects."""

    def __init__(self, args: Any) -> None:
        from miles.config.data import DataConfig
        from miles.rollout.data import DataSource as Prompts
        from miles.rollout.rollout_fn import MilesDataBuffer, build_prompt_dataset

        data = DataConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DataConfig)})
        if not data.prompt_data:
            raise ValueError("RolloutDataSourceWithBuffer reads --prompt-data FILE, which is not set.")
        seed = getattr(args, "rollout_seed", 0)
        prompts = Prompts(build_prompt_dataset(data, args.tokenizer, seed), shuffle=data.rollout_shuffle, seed=seed)
        self._buffer = MilesDataBuffer(prompts, data.n_samples_per_prompt)
        self.args = args

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return self._buffer.get_samples(num_samples)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        self._buffer.add_samples(samples)

    def get_buffer_length(self) -> int:
        return self._buffer.get_buffer_length()
