"""The fork server (``_zygote.py``) ends a rank as a real ``torchrun`` rank ends: the non-daemon threads are joined,
then the ``atexit`` functions run, and an uncaught exception gives exit 1 with its traceback. The same script runs
under both launchers and must leave the same record."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).resolve()


def _worker(out: str, fail: str) -> None:
    import atexit

    rank = int(os.environ["RANK"])
    path = Path(out) / f"rank{rank}.jsonl"

    def note(what: str) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(what) + "\n")

    def late() -> None:
        time.sleep(0.5)
        note("thread done")

    atexit.register(note, "atexit")
    threading.Thread(target=late, name="late-writer").start()     # non-daemon: the exit waits for it
    note("main done")
    if fail == "1" and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


@pytest.mark.parametrize("real", [False, True], ids=["fork_server", "torchrun"])
@pytest.mark.parametrize("fail", [False, True], ids=["ok", "raises"])
def test_ranks_exit_as_under_torchrun(tmp_path: Path, free_port: int, monkeypatch, real: bool, fail: bool) -> None:
    from _torchrun import torchrun_self

    if real:
        monkeypatch.setenv("MILES_TEST_REAL_TORCHRUN", "1")
    else:
        monkeypatch.delenv("MILES_TEST_REAL_TORCHRUN", raising=False)
    proc = torchrun_self(HERE, 2, free_port, str(tmp_path), "1" if fail else "0", timeout=120)
    assert proc.returncode == (1 if fail else 0), proc.stdout[-3000:]
    records = {r: [json.loads(x) for x in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    if fail:
        assert "RuntimeError: rank 1 fails on purpose" in proc.stdout, proc.stdout[-3000:]
        # rank 1 still joins its thread and runs atexit; rank 0 is stopped by the launcher or has ended already
        assert records[1] == ["main done", "thread done", "atexit"], records
    else:
        assert records == {r: ["main done", "thread done", "atexit"] for r in (0, 1)}, records


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
