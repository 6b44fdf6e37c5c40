"""FSDP backend: SIGKILL a real trainer rank at each point of a checkpoint save, relaunch, and the resumed run ends
with exactly the parameters, losses, LR schedule and RNG of an uninterrupted one (``kill_mid_save.py``).

Points (``miles.trainer.checkpoint.faults``): ``shards`` (rank 1, its DCP shards written, its RNG file and the
metadata not), ``rename`` (rank 0, every part written, ``.tmp.step_00000002`` not renamed), ``prune`` (rank 0,
``step_00000002`` complete, ``step_00000001`` not pruned yet; the ``step_*`` layout has no tracker, so ``tracker``
is the same moment). With ``--keep-checkpoints 1 --save-retain-interval 2`` the directory ends with steps 0, 2, 4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def make_trainer(model_dir: str, flags: list[str], group):
    from trainer_harness import build

    return build(model_dir, ["--train-backend", "fsdp"] + flags, group=group)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    from kill_mid_save import reference

    out = tmp_path_factory.mktemp("fsdp_ref")
    return reference(HERE, out / "ref.pt", tiny_model_dir)


@pytest.mark.parametrize("point", ["shards", "rename", "prune"])
def test_kill_at_each_point_of_a_save_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir, reference, point):
    from kill_mid_save import kill_then_resume

    from miles.trainer.checkpoint.layout import STEP

    kill_then_resume(HERE, tmp_path, reference, point, STEP, tiny_model_dir)


def test_checkpoint_faults(tiny_model_dir: Path, tmp_path: Path) -> None:
    """FSDP: a disk that fills mid-save (a real tmpfs), corrupt newest checkpoints under an explicit --load,
    another run's --save, nothing usable (``ckpt_faults.py``)."""
    import ckpt_faults

    from miles.trainer.checkpoint.layout import STEP

    ckpt_faults.check(ckpt_faults.run(HERE, "STEP", tiny_model_dir, tmp_path), STEP, tmp_path)


if __name__ == "__main__":
    if sys.argv[1] == "kill_mid_save":
        import kill_mid_save

        kill_mid_save.worker(make_trainer, *sys.argv[2:])
    elif sys.argv[1] == "ckpt_faults":
        import ckpt_faults

        ckpt_faults.worker(make_trainer, *sys.argv[2:])
