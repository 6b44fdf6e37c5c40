"""Shared fixtures: tiny local models (a dense one per session; a Qwen3-MoE and a GLM-4.7-Flash per test module),
free ports, a clean environment, a one-rank gloo group, two spawned ranks; the skip policy.

Tests kill only the processes they start. Skips for a dependency that ``make setup`` installs fail under the
Makefile's test targets and on CI, and tests marked ``gpu`` launch their ranks under real ``torchrun``, never
from the fork server (``suite_policy.py``, whose hooks and fixture are imported here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from suite_policy import (  # noqa: F401 -- hooks and an autouse fixture, found by name
    _gpu_tests_use_real_torchrun,
    pytest_make_collect_report,
    pytest_runtest_makereport,
)

import miles.trainer.megatron  # noqa: F401 -- first: megatron-core's first import here is the ranks' (lean_import.py)

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Qwen3-architecture model with a char-level tokenizer, built locally."""
    from miles.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="session")
def quickstart_prepared(tmp_path_factory) -> Path:
    """``examples/quickstart/prepare.sh``'s output (the tiny model, train/eval/sft data; seed 0), built once per session
    (about 10-16 s a build on the 2-core box) and never written after: each fixture that needs it takes its own copy
    (``_miles_e2e.quickstart_copy``: 0.5 MB) instead of running prepare.sh again."""
    from _miles_e2e import QUICKSTART, check_ok, run  # tests/e2e's: only its tests ask for this

    d = tmp_path_factory.mktemp("quickstart_prepared")
    log = d / "prepare.log"
    check_ok(run(["bash", str(QUICKSTART / "prepare.sh"), str(d / "qs")], log, timeout=300), log)
    assert (d / "qs" / "model" / "config.json").is_file() and (d / "qs" / "train.jsonl").is_file()
    return d / "qs"


@pytest.fixture(scope="session")
def quickstart_sft(tmp_path_factory, quickstart_prepared: Path) -> Path:
    """The quickstart's data, tiny model and SFT warm start (``examples/quickstart/run_sft.sh``: our SFT path, 2
    ranks, the default backend), built once per session and only read after: the GRPO phases of
    tests/e2e/test_quickstart.py, test_megatron_quickstart.py and test_megatron_pp_quickstart.py start from it
    (``QUICKSTART_DIR``), each writing its runs under its own ``--output-dir`` / ``--save``."""
    from _miles_e2e import QUICKSTART, check_ok, check_run_dir, quickstart_copy, run  # tests/e2e's

    d = quickstart_copy(quickstart_prepared, tmp_path_factory.mktemp("quickstart") / "qs")   # run_sft.sh: prepared
    log = d / "sft.log"
    check_ok(run(["bash", str(QUICKSTART / "run_sft.sh")], log, timeout=600, QUICKSTART_DIR=str(d)), log)
    assert (d / "sft_model" / "config.json").is_file() and (d / "sft_model" / "model.safetensors").is_file()
    check_run_dir(d / "sft_run", num_rollout=30, num_ranks=2)
    return d


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE model (``build_tiny_moe_model``'s defaults), built once per test module."""
    from miles.utils.tiny_model import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="module")
def tiny_glm_dir(tmp_path_factory) -> Path:
    """A tiny GLM-4.7-Flash (multi-latent attention, DeepSeek-style MoE: ``build_tiny_mla_model``'s defaults), built
    once per test module."""
    from miles.utils.tiny_mla import build_tiny_mla_model

    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_glm"))


@pytest.fixture
def free_port() -> int:
    from miles.utils.net import find_free_port

    return find_free_port()


@pytest.fixture(autouse=True)
def _env_hygiene(monkeypatch):
    """No launcher variables leak into tests from the outer shell; one thread per process."""
    for k in list(os.environ):
        if (k.startswith(("TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_", "SLURM_")) and k != "SLURM_CONF") or k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    yield


@pytest.fixture
def one_rank_group(tmp_path_factory):
    """A real one-rank gloo process group, the default group (``dist.group.WORLD``), destroyed after the test.
    Trainers built on it (``trainer_harness.build``) are whole trainer groups of one rank."""
    from datetime import timedelta

    import torch.distributed as dist

    store = tmp_path_factory.mktemp("one_rank_pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def two_ranks():
    """``two_ranks(worker, scenario) -> {rank: (value, seconds)}``: ``worker(rank, port, scenario, queue)`` in
    two spawned processes (a 2-rank gloo group on a free port); each puts one ``(rank, value, seconds)``."""
    import torch.multiprocessing as mp

    from miles.utils.net import find_free_port

    def run(worker, scenario: str) -> dict:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = find_free_port()
        procs = [ctx.Process(target=worker, args=(r, port, scenario, q)) for r in range(2)]
        for p in procs:
            p.start()
        out = {}
        try:
            for _ in procs:
                rank, value, seconds = q.get(timeout=90)
                out[rank] = (value, seconds)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        return out

    return run
