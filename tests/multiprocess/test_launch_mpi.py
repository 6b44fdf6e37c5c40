"""The smoke test under mpirun: Debian's Open MPI, and MPICH's Hydra from the PyPI ``mpich`` wheel.

The MPICH wheel lives in its own prefix (``make setup`` puts it in ``$VENV/mpich``), so its ``mpirun``
never shadows Open MPI's; ranks point mpi4py at the launcher's own library (world.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from spmd_helpers import PYTHON, REPO, SMOKE, assert_smoke, find_open_mpi, job_env, roles, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.mpi]


def _mpich_prefix() -> Path | None:
    for prefix in (os.environ.get("MILES_MPICH_PREFIX"), str(Path(sys.prefix) / "mpich")):
        if prefix and (Path(prefix) / "bin" / "mpiexec.hydra").exists():
            return Path(prefix)
    return None


OPEN_MPI = find_open_mpi()
needs_open_mpi = pytest.mark.skipif(OPEN_MPI is None, reason="no Open MPI mpirun (apt-get install openmpi-bin)")


def _openmpi(n: int, flags: list[str], **env: str) -> list[str]:
    exports = [x for k in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", *env) for x in ("-x", k)]
    return [OPEN_MPI, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(n), *exports,
            PYTHON, *SMOKE, *flags]


@needs_open_mpi
def test_open_mpi_disaggregated_engines_of_two():
    job = run(_openmpi(4, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                           "--rollout-num-gpus-per-engine", "2"]))
    lines = assert_smoke(job, 4, "openmpi")
    assert roles(lines) == {0: {"driver", "trainer"}, 1: {"trainer"}, 2: {"engine_leader"}, 3: {"engine_worker"}}
    # no --master-addr: rank 0's address and port came over mpi4py
    assert "master 127.0.0.1:" in job.stderr


@needs_open_mpi
def test_open_mpi_colocated_through_the_template(tmp_path):
    env = job_env(NP="4", PER_NODE="4", MPIRUN_ARGS="--oversubscribe", ENTRY=" ".join(SMOKE), PYTHON=PYTHON,
                  PATH=f"{Path(OPEN_MPI).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    job = run(["bash", str(REPO / "launch/mpirun_openmpi.sh"), "--colocate", "--actor-num-gpus-per-node", "4",
               "--rollout-num-gpus-per-engine", "2", "--smoke-engine-argv", "builtin", "--smoke-dir", str(tmp_path)],
              env=env)
    lines = assert_smoke(job, 4, "openmpi")
    assert [lines[r]["engine"] for r in range(4)] == ["0", "0", "1", "1"]
    assert "engine_pid" in lines[0] and "engine_pid" in lines[2]


def test_mpich_hydra_through_the_template():
    prefix = _mpich_prefix()
    if prefix is None:
        pytest.skip("no MPICH: pip install --prefix $VENV/mpich mpich (make setup does), or set MILES_MPICH_PREFIX")
    env = job_env(PATH=f"{prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", NP="4", PER_NODE="4",
                  ENTRY=" ".join(SMOKE), PYTHON=PYTHON)
    job = run(["bash", str(REPO / "launch/mpirun_mpich.sh"), "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"],
              env=env)
    lines = assert_smoke(job, 4, "mpich")
    assert roles(lines) == {0: {"driver", "trainer"}, 1: {"trainer"}, 2: {"engine_leader"}, 3: {"engine_leader"}}
