"""run_main: one rank-prefixed line and exit 2 for known errors, a traceback and exit 1 for bugs."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

from miles.spmd.errors import CollectiveTimeoutError, PeerGoneError, format_error
from miles.spmd.groups import translate_collective_error
from miles.spmd.supervisor import scrubbed_env

PROGRAM = """
import sys
from miles.spmd.errors import run_main
from miles.config import ConfigError

def main():
    kind = sys.argv[1]
    if kind == "config":
        raise ConfigError("--rollout-num-gpus 3 is wrong:\\n use 4")
    if kind == "bug":
        raise KeyError("oops")
    if kind == "rc":
        return 3
    return None

run_main(main)
"""


def run(kind: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, kind], capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, **env})


def test_config_error_is_one_line_with_rank_and_exit_2():
    p = run("config", RANK="3", WORLD_SIZE="4")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["[miles r3] error: --rollout-num-gpus 3 is wrong: use 4"]
    assert "Traceback" not in p.stderr


def test_rank_prefix_comes_from_any_launcher():
    assert run("config", OMPI_COMM_WORLD_RANK="1").stderr.startswith("[miles r1] error:")
    assert run("config", SLURM_PROCID="2").stderr.startswith("[miles r2] error:")
    assert run("config").stderr.startswith("[miles] error:")


def test_bug_gives_traceback_and_exit_1():
    p = run("bug", RANK="0", WORLD_SIZE="1")
    assert p.returncode == 1
    assert "Traceback" in p.stderr and "KeyError: 'oops'" in p.stderr


def test_return_code_and_success():
    assert run("rc").returncode == 3
    assert run("ok").returncode == 0


def test_format_error_flattens_whitespace():
    assert format_error(ValueError("a\n  b"), rank=7) == "[miles r7] error: a b"


def test_backend_errors_become_group_errors():
    t = timedelta(minutes=2)
    err = translate_collective_error(RuntimeError("[gloo] Timed out waiting 120000ms for recv"), "control", t)
    assert isinstance(err, CollectiveTimeoutError)
    assert "group 'control' did not finish within 2 min" in str(err) and "--distributed-timeout-minutes" in str(err)
    err = translate_collective_error(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), "trainer", t)
    assert isinstance(err, PeerGoneError) and "member of group 'trainer' exited" in str(err)
    other = RuntimeError("shape mismatch")
    assert translate_collective_error(other, "trainer", t) is other


def test_scrubbed_env_drops_every_launcher_variable():
    base = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "ROLE_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMPI_COMM_WORLD_RANK": "1", "PMI_RANK": "1", "PMIX_RANK": "1", "MPI_LOCALRANKID": "0",
            "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_ID": "5"}
    env = scrubbed_env(base, {"MILES_ENGINE_ID": "0"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_ID": "5", "MILES_ENGINE_ID": "0"}
