"""Launcher detection from each launcher's real variable names, the master address, the device."""

from __future__ import annotations

import os

import pytest

from miles.config import ConfigError, parse_args
from miles.spmd.world import (
    detect_world,
    expand_hostlist,
    parse_tasks_per_node,
    read_launch_env,
    resolve_backend,
)


def cluster(*flags: str):
    return parse_args(list(flags), validate=False).cluster


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    w = detect_world(cluster("--master-addr", "elsewhere"), env)
    assert (w.launcher, w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank, w.num_nodes) == (
        "torchrun", 5, 8, 1, 4, 1, 2)
    assert (w.master_addr, w.master_port) == ("node0", 29500)  # torchrun's store wins over the flag
    assert w.device.type == "cpu"


def test_open_mpi_variables_with_a_given_master():
    env = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    w = detect_world(cluster("--master-addr", "10.1.2.3", "--master-port", "1234"), env)
    assert (w.launcher, w.rank, w.local_rank, w.node_rank, w.num_nodes) == ("openmpi", 6, 2, 1, 2)
    assert (w.master_addr, w.master_port) == ("10.1.2.3", 1234)


def test_mpich_hydra_variables_with_master_from_env():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4",
           "MASTER_ADDR": "h0", "MASTER_PORT": "4000"}
    w = detect_world(cluster(), env)
    assert (w.launcher, w.rank, w.world_size, w.local_rank, w.local_world_size, w.num_nodes) == ("mpich", 3, 4, 3, 4, 1)
    assert (w.master_addr, w.master_port) == ("h0", 4000)


def test_pmix_under_srun_takes_size_and_node_from_slurm():
    env = {"PMIX_RANK": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}
    le = read_launch_env(env)
    assert (le.launcher, le.rank, le.world_size, le.local_rank, le.node_rank, le.num_nodes) == ("pmix", 2, 4, 0, 1, 2)


def test_slurm_step_master_is_the_first_host_and_port_comes_from_the_job():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "777", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_STEP_NODELIST": "gpu[07-08]"}
    w = detect_world(cluster(), env)
    assert (w.launcher, w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank, w.num_nodes) == (
        "slurm", 5, 8, 1, 4, 1, 2)
    assert w.master_addr == "gpu07"
    assert 20000 <= w.master_port < 40000
    assert detect_world(cluster(), dict(env, SLURM_PROCID="0")).master_port == w.master_port
    assert detect_world(cluster(), dict(env, SLURM_STEP_ID="1")).master_port != w.master_port


def test_slurm_batch_step_without_srun_is_a_single_process():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "vm"}
    assert read_launch_env(env).launcher == "single"


def test_single_process_fallback():
    w = detect_world(cluster(), {})
    assert (w.launcher, w.rank, w.world_size, w.master_addr) == ("single", 0, 1, "127.0.0.1")
    assert w.master_port > 0


def test_missing_master_address_is_a_config_error():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0"}
    with pytest.raises(ConfigError, match="no master address .* --master-addr"):
        detect_world(cluster(), env)


def test_hostlists_and_task_counts():
    assert expand_hostlist("gpu[01-03,7],cpu5,a[1-2]-ib") == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5", "a1-ib", "a2-ib"]
    assert expand_hostlist("r[1-2]n[0-1]") == ["r1n0", "r1n1", "r2n0", "r2n1"]
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="cannot parse SLURM tasks-per-node value 'two'"):
        parse_tasks_per_node("two")


def test_device_and_backend_choices_on_cpu():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only checks")
    with pytest.raises(ConfigError, match="--device cuda, but this process sees no CUDA GPU"):
        detect_world(cluster("--device", "cuda"), {})
    w = detect_world(cluster(), {})
    assert cluster().distributed_backend == "nccl"  # Miles's default; a CPU rank has no NCCL
    assert resolve_backend(w, cluster()) == "gloo"
    assert resolve_backend(w, cluster("--distributed-backend", "auto")) == "gloo"
    assert resolve_backend(w, cluster("--distributed-backend", "gloo")) == "gloo"


def test_bad_launcher_values_are_named():
    with pytest.raises(ConfigError, match="RANK='x'"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_numa_binding_masks_and_clean_skips(monkeypatch):
    import torch

    from miles.spmd.numa import bind_to_gpu, cpus_from_masks

    # NVML's affinity words: word 0 holds CPUs 0..63, word 1 CPUs 64..127
    assert cpus_from_masks([0b1011, 0]) == {0, 1, 3}
    assert cpus_from_masks([0, 1 << 2]) == {66}
    assert cpus_from_masks([(1 << 64) - 1]) == set(range(64))
    before = os.sched_getaffinity(0)
    assert bind_to_gpu(torch.device("cpu")) is None  # no GPU: nothing to do, nothing changed
    monkeypatch.setenv("MILES_NUMA_BIND", "0")
    assert bind_to_gpu(torch.device("cuda", 0)) is None  # switched off before NVML is touched
    assert os.sched_getaffinity(0) == before
