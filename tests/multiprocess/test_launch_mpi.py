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


HOLD = ["--smoke-engine-argv", "builtin", "--smoke-hold", "300"]  # ranks and engine children stay up
ORPHAN_BOUND_S = 5.0  # the watch polls every 0.2 s and gives engines 1 s after SIGTERM (miles/spmd/lifeline.py)
PLAN3 = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"]  # 1 trainer + 2 engine leaders


def _check_gone_with(job, victim: int, proxy_name: str) -> float:
    from launcher_kill import children_of, kill_and_time_orphans, tagged

    procs = tagged(job.tag)
    ranks = children_of(procs, victim)
    engines = [p for r in ranks for p in children_of(procs, r.pid)]
    assert len(ranks) == 3 and len(engines) == 2, (proxy_name, procs)
    # (the ranks' "launcher is gone" line cannot be seen here: their stdio went through the process killed)
    seconds, _ = kill_and_time_orphans(job, victim, ORPHAN_BOUND_S, keep={job.proc.pid})
    print(f"every rank and engine gone {seconds:.2f}s after SIGKILL of {proxy_name}")
    return seconds


@needs_open_mpi
def test_sigkill_of_open_mpi_mpirun_takes_every_rank_and_engine_down(tmp_path):
    from launcher_kill import kill_tagged, launch, new_tag, wait_until

    tag = new_tag()
    cmd = _openmpi(3, [*PLAN3, "--smoke-dir", str(tmp_path), *HOLD], MILES_TEST_TAG=tag)
    job = launch(cmd, job_env(), tag, tmp_path)
    try:
        wait_until(job, lambda: job.stdout.read_text().count("SMOKE OK") == 3, 180, "3 SMOKE OK lines")
        _check_gone_with(job, job.proc.pid, "mpirun")  # Open MPI's local ranks are mpirun's children
        job.proc.wait(timeout=10)
    finally:
        kill_tagged(tag)


def test_sigkill_of_mpich_hydra_proxy_takes_every_rank_and_engine_down(tmp_path):
    """The ranks' parent is hydra_pmi_proxy (mpiexec only talks to it). A SIGKILLed mpiexec is handled by the
    proxy itself (it kills its ranks); a SIGKILLed proxy left them running, with mpiexec waiting for them."""
    from launcher_kill import children_of, kill_tagged, launch, new_tag, tagged, wait_until

    prefix = _mpich_prefix()
    if prefix is None:
        pytest.skip("no MPICH: pip install --prefix $VENV/mpich mpich (make setup does), or set MILES_MPICH_PREFIX")
    tag = new_tag()
    env = job_env(PATH=f"{prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    job = launch([str(prefix / "bin" / "mpiexec.hydra"), "-n", "3", "-genvall", PYTHON, *SMOKE, *PLAN3,
                  "--smoke-dir", str(tmp_path), *HOLD], env, tag, tmp_path)
    try:
        wait_until(job, lambda: job.stdout.read_text().count("SMOKE OK") == 3, 180, "3 SMOKE OK lines")
        proxies = children_of(tagged(tag), job.proc.pid)
        assert [p.comm for p in proxies] == ["hydra_pmi_proxy"], proxies
        _check_gone_with(job, proxies[0].pid, "hydra_pmi_proxy")
    finally:
        kill_tagged(tag)
