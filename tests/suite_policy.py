"""The suite's policies (pytest hooks and an autouse fixture, imported by tests/conftest.py): which skips fail,
and which launches go to real ``torchrun``.

GPU tests: every test marked ``gpu`` runs with ``MILES_TEST_REAL_TORCHRUN=1``, so ``multiprocess/_torchrun.py``
launches its ranks under real ``torchrun``, never from the fork server (``multiprocess/_zygote.py`` forks after
importing torch and megatron-core, which may initialise CUDA: a forked child cannot).

Skips:
``make setup`` installs every dependency the CPU suite uses (megatron-core, torchft, sglang-router, mpi4py,
MPICH, nvidia-resiliency-ext, wandb; Open MPI, Slurm and munge from apt where it runs as root). A test that
skips because one of them is missing would otherwise leave the run green while testing nothing, so under
``make test`` / ``make test-fast`` / ``make test-real`` (``MILES_STRICT_SKIPS=1``) and on CI (``CI=true``) a skip
whose reason names one of them is reported as a FAILURE, at collection (a module-level ``importorskip``) or
when the test runs; ``MILES_STRICT_SKIPS=0`` turns this off.

The skips that are expected even after ``make setup`` are listed in ``EXPECTED_SKIPS`` (a node-id pattern ->
the text the skip's reason contains): those stay skips. Other skips (no GPU, not root, ...) stay skips too;
the terminal summary lists every skip of the run by reason (``-ra``).
"""

from __future__ import annotations

import fnmatch
import os
import re

import pytest

# What `make setup` installs (setup.py's test extra, requirements.txt, the Makefile, tools/install-system-deps.sh),
# as skip reasons name it: module names, package names, programs.
SETUP_DEPENDENCY = re.compile(
    r"megatron[._-]core|\btorchft\b|sglang[_-]router|\bmpi4py\b|\bmpich\b|open ?mpi|\bopenmpi\b|\bmpirun\b|\bslurm"
    r"|\bmunge\b|nvidia[_-]resiliency[_-]ext|\bft_launcher\b|\bwandb\b|\bpsutil\b|make setup|install-system-deps",
    re.IGNORECASE)

# node-id pattern (fnmatch) -> the text the reason of an expected skip contains (why it is expected)
EXPECTED_SKIPS: dict[str, str] = {
    # slurmd setuids to the job's owner: the private one-node cluster needs root; CI runs as root
    "tests/multiprocess/test_launch_slurm.py::*": "the private Slurm cluster needs root",
}


def strict() -> bool:
    """Skips for a missing setup dependency fail: under the Makefile's test targets and on CI."""
    flag = os.environ.get("MILES_STRICT_SKIPS")
    if flag is not None:
        return flag not in ("", "0")
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def expected(nodeid: str, reason: str) -> bool:
    return any(fnmatch.fnmatch(nodeid, pat) and text in reason for pat, text in EXPECTED_SKIPS.items())


def forbidden(nodeid: str, reason: str) -> bool:
    """A skip that must fail: strict mode, its reason names a setup dependency, and it is not expected."""
    return strict() and bool(SETUP_DEPENDENCY.search(reason)) and not expected(nodeid, reason)


def _reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:   # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure(nodeid: str, reason: str) -> str:
    return (f"{nodeid} skipped for a dependency that `make setup` installs: {reason}. Run `make setup` (or "
            f"install it); if this skip is expected, add it to EXPECTED_SKIPS in tests/suite_policy.py with its reason "
            f"(MILES_STRICT_SKIPS=0 turns this check off)")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips at import (``pytest.importorskip`` at module level) for a setup dependency."""
    report = yield
    if report.skipped:
        _fail_if_forbidden(report, report.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skips (marker, ``pytest.skip``, ``importorskip``) for a setup dependency."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        _fail_if_forbidden(report, item.nodeid)
    return report


def _fail_if_forbidden(report, nodeid: str) -> None:
    """Turn ``report`` (a skip) into a failure when its reason names a dependency ``make setup`` installs."""
    reason = _reason(report.longrepr)
    if forbidden(nodeid, reason):
        report.outcome = "failed"
        report.longrepr = _failure(nodeid, reason)


@pytest.fixture(autouse=True)
def _gpu_tests_use_real_torchrun(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.setenv("MILES_TEST_REAL_TORCHRUN", "1")
