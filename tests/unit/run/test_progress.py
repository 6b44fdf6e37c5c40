"""Progress bars: the generation callback tracks done/total (growing with over-sampling); disabled is a no-op."""

from __future__ import annotations

import io

from miles.run.progress import Progress


def test_generation_and_training_bars():
    stream = io.StringIO()
    p = Progress(enabled=True, stream=stream)
    update = p.generation(3, total=8)
    update(2, 8)
    update(5, 8)
    assert p._gen.n == 5 and p._gen.total == 8
    update(9, 12)  # over-sampling launched more
    assert p._gen.total == 12 and p._gen.n == 9
    p.end_generation()
    assert p._gen is None
    p.training(3, num_steps=4)
    p.step()
    p.step()
    assert p._train.n == 2
    p.end_training()
    assert p._train is None
    assert "rollout 3 generate" in stream.getvalue() and "rollout 3 train" in stream.getvalue()


def test_disabled_is_silent():
    stream = io.StringIO()
    p = Progress(enabled=False, stream=stream)
    update = p.generation(0, total=4)
    update(1, 4)
    p.training(0, 2)
    p.step()
    p.close()
    assert stream.getvalue() == ""
