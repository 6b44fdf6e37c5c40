"""A directory registered with ``miles.utils.exit_cleanup`` (a trainer rank's --offload-train-target disk spill files)
is gone however the rank ends under ``run_main``: a normal end (atexit), a known error and a bug (``os._exit``, which
skips atexit), and the launcher's SIGTERM (``miles.spmd.signals``). Real processes, real files."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = """
import sys, time
from pathlib import Path
from miles.spmd.errors import run_main
from miles.utils import exit_cleanup
from miles.utils.errors import MilesError

d, how = Path(sys.argv[1]), sys.argv[2]

def main():
    d.mkdir()
    (d / "weights.bin").write_bytes(b"x" * 4096)
    exit_cleanup.remove_at_exit(d)
    if how == "error":
        raise MilesError("boom")
    if how == "bug":
        raise RuntimeError("a bug")
    if how == "sigterm":
        print("ready", flush=True)
        time.sleep(60)
    return 0

run_main(main)
"""

CODES = {"normal": 0, "error": 2, "bug": 1, "sigterm": 128 + signal.SIGTERM}


@pytest.mark.parametrize("how", list(CODES))
def test_the_directory_is_removed_however_the_rank_ends(tmp_path: Path, how: str):
    d = tmp_path / "rank_0"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(d), how], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    if how == "sigterm":
        assert proc.stdout.readline().strip() == "ready"
        assert (d / "weights.bin").is_file()
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == CODES[how], err
    assert not d.exists(), (how, err)
