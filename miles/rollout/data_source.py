"""Miles's ``miles.rollout.data_source.DataSource``: the data-buffer API a rollout function's ``data_source`` has.

    groups = data_source.get_samples(n)     # n prompts, each a group of --n-samples-per-prompt fresh samples
    data_source.add_samples(unused_groups)  # give prompts back: they are served again first

The object the run passes (:class:`miles.rollout.rollout_fn.MilesDataBuffer`) is a ``DataSource``; the run's
checkpoints save and restore the data position themselves, so ``save`` / ``load`` do nothing here.
"""

from __future__ import annotations

import abc

from miles.types import Sample

__all__ = ["DataSource"]


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
