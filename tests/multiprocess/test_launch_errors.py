"""Each bad input fails fast on every rank of a real launch, with one readable line and no traceback.

mpirun starts the ranks for the bad plans (no torch import happens before the plan check, so a launch
costs little); the same failures under torchrun and sbatch are in test_launch_torchrun.py and
test_launch_slurm.py. A rank that vanishes mid-run must not leave its peers hanging either.
"""

from __future__ import annotations

import time

import pytest
from spmd_helpers import PYTHON, SMOKE, find_open_mpi, finish, job_env, run, start

OPEN_MPI = find_open_mpi()

pytestmark = pytest.mark.multiprocess

CASES = {
    "world size mismatch": (3, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"],
                            ["world size mismatch: the plan needs 4 rank(s)", "launcher started 3", "mpirun -n"]),
    "engine size does not divide rollout GPUs": (
        3, ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "3"],
        ["--rollout-num-gpus-per-engine 3 does not divide 2 rollout GPUs", "Fix:"]),
    "colocated with more rollout than trainer GPUs": (
        2, ["--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4"],
        ["colocated plan: expected at most 2 rollout GPUs", "found --rollout-num-gpus 4", "Fix:"]),
    "engine straddling a node": (
        4, ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "3",
            "--num-gpus-per-node", "2"], ["must take whole nodes"]),
    # no --master-addr, and mpi4py cannot load an MPI library to share rank 0's address
    "missing master address": (2, ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"],
                               ["no master address under openmpi", "--master-addr", "mpi4py"]),
}
ENV = {"missing master address": {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so.40"}}


@pytest.mark.mpi
@pytest.mark.skipif(OPEN_MPI is None, reason="no Open MPI mpirun (apt-get install openmpi-bin)")
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_message_on_every_rank(case):
    n, flags, needles = CASES[case]
    # orte_abort_on_non_zero_status=0: mpirun does not kill the other ranks at the first failure, so
    # each rank must find the problem and exit on its own (none may hang); a shell reports each exit code.
    env = ENV.get(case, {})
    exports = [x for k in env for x in ("-x", k)]
    job = run([OPEN_MPI, "--allow-run-as-root", "--oversubscribe", "--mca", "orte_abort_on_non_zero_status", "0",
               *exports, "-n", str(n), "sh", "-c", '"$@"; echo "EXIT $OMPI_COMM_WORLD_RANK $?"', "sh", PYTHON, *SMOKE, *flags],
              timeout=120, env=job_env(**env))
    exits = sorted(ln.split()[1:] for ln in job.stdout.splitlines() if ln.startswith("EXIT "))
    assert exits == [[str(r), "2"] for r in range(n)], job.output[-3000:]
    errors = [ln for ln in job.stderr.splitlines() if "] error:" in ln]
    ranks_seen = sorted(int(ln.split("[miles r", 1)[1].split("]", 1)[0]) for ln in errors)
    assert ranks_seen == list(range(n)), job.stderr[-3000:]
    for line in errors:
        for needle in needles:
            assert needle in line, line
    assert "Traceback" not in job.stderr and "SMOKE OK" not in job.stdout
    assert job.seconds < 30, f"took {job.seconds:.1f}s"


def test_a_vanished_peer_is_one_line_not_a_hang():
    """Rank 0 disappears (exit code 0, so no launcher would stop the job): rank 1 must not wait forever."""
    from miles.utils.net import find_free_port

    port = str(find_free_port())
    t0 = time.monotonic()
    procs = [start([PYTHON, *SMOKE, "--colocate", "--actor-num-gpus-per-node", "2", "--smoke-exit-rank", "0"],
                   env=job_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(2)]
    gone, survivor = (finish(p, 120, t0) for p in procs)
    assert gone.returncode == 0 and "SMOKE OK" not in gone.stdout
    assert survivor.returncode == 2, survivor.output[-3000:]
    assert survivor.stderr.strip().splitlines()[-1].startswith(
        "[miles r1] error: a member of group 'control' exited during a collective")
    assert "Traceback" not in survivor.stderr
    assert survivor.seconds < 60
