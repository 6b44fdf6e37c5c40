"""Progress bars (tqdm, driver rank only): generation samples done of total, training steps.

    progress = Progress(enabled=ctx.is_driver and not cfg.output.no_progress)
    bar = progress.generation(rollout_id, total)     # a callback(done, total) for the rollout manager
    ...; progress.end_generation()
    progress.training(rollout_id, num_steps)          # advanced with step(); closed by end_training()

Bars go to stderr and leave no line behind (the per-rollout summary line is the record). With
``--no-progress`` or on other ranks every call is a no-op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Progress:
    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._gen = None
        self._train = None

    def _bar(self, desc: str, total: int, unit: str, position: int):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=False, file=self.stream, dynamic_ncols=True,
                    mininterval=0.5, position=position)

    # ------------------------------------------------------------------ generation
    def generation(self, rollout_id: int, total: int, desc: str | None = None) -> Callable[[int, int], None]:
        """Open the generation bar; returns the manager's ``progress(done, launched)`` callback."""
        self.end_generation()
        if self.enabled:
            self._gen = self._bar(desc or f"rollout {rollout_id} generate", total, "sample", 0)

        def update(done: int, launched: int) -> None:
            bar = self._gen
            if bar is None:
                return
            if launched > bar.total:  # over-sampling launched more than the batch
                bar.total = launched
                bar.refresh()
            if done > bar.n:
                bar.update(done - bar.n)

        return update

    def end_generation(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None

    # ------------------------------------------------------------------ training
    def training(self, rollout_id: int, num_steps: int) -> None:
        self.end_training()
        if self.enabled:
            self._train = self._bar(f"rollout {rollout_id} train", num_steps, "step", 1)  # beside generation (async)

    def step(self, n: int = 1) -> None:
        if self._train is not None:
            self._train.update(n)

    def end_training(self) -> None:
        if self._train is not None:
            if self._train.n < self._train.total:
                self._train.update(self._train.total - self._train.n)
            self._train.close()
            self._train = None

    def close(self) -> None:
        self.end_generation()
        self.end_training()
