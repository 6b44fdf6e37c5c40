"""Miles's Python launchers (``scripts/run_<model>.py``) on ``miles.utils.external_utils``: the dry mode prints the
job command Miles records for them, wrapped in torchrun (srun inside a Slurm allocation) instead of ``ray job
submit``; the rank count the launch gets is the one the role plan accepts; mistakes are one line.

The launchers are ours, written against Miles's API (tests/fixtures/miles_launchers/); the commands compared
against are Miles v0.1.0's recorded ones (tests/fixtures/miles_launchers/recorded/, each naming its source).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import cluster as cluster_flags
from miles.config.base import ConfigError
from miles.config.cluster import ClusterConfig
from miles.spmd.roles import build_role_plan
from miles.utils.external_utils import command_utils as U
from miles.utils.external_utils.launch import planned_ranks, read_cluster_flags
from miles.utils.external_utils.model_args_utils import load_model_args, moe_layer_freq, shell_safe_model_args

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "miles_launchers"
RUN_ID = "260101-000000-000"  # the run id Miles's snapshot harness freezes
TRAIN = str(REPO / "train.py")


def launch(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python <fixture launcher> args`` in the dry mode, with the environment Miles's recordings were made in."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "MILES_SCRIPT_"))}
    e.update(PYTHONPATH=str(REPO), MILES_SCRIPT_DRY_RUN="1", MILES_SCRIPT_RUN_ID=RUN_ID, MASTER_ADDR="127.0.0.1",
             WANDB_API_KEY="frozen-wandb-api-key", OMP_NUM_THREADS="1")
    e.update(env)
    return subprocess.run([sys.executable, str(FIXTURES / script), *args], capture_output=True, text=True,
                          timeout=120, env=e, cwd="/tmp")


def job_line(result: subprocess.CompletedProcess) -> list[str]:
    """The tokens of the printed job command (the DRY-RUN line holding train.py)."""
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("DRY-RUN:") and TRAIN in ln]
    assert len(lines) == 1, result.stdout[-3000:]
    return shlex.split(lines[0][len("DRY-RUN:"):])


def split_at_train(tokens: list[str]) -> tuple[list[str], list[str]]:
    i = tokens.index(TRAIN)
    return tokens[:i], tokens[i + 1:]


def recorded_flags(name: str) -> list[str]:
    """The flags of Miles's recorded ``python3 <REPO_ROOT>/train.py ...`` command."""
    text = (FIXTURES / "recorded" / name).read_text()
    tokens = shlex.split(" ".join(ln for ln in text.splitlines() if not ln.startswith("#")))
    assert tokens[:2] == ["python3", "<REPO_ROOT>/train.py"], tokens[:3]
    return tokens[2:]


def test_lora_launcher_prints_miles_recorded_command_under_torchrun():
    launcher, flags = split_at_train(job_line(launch("run_qwen3_5_35b_a3b_lora.py", "train")))
    assert flags == recorded_flags("run_qwen3_5_35b_a3b_lora.train.txt")
    env = [t for t in launcher if "=" in t and not t.startswith("-")]
    assert env == ["CUDA_DEVICE_MAX_CONNECTIONS=1", "NCCL_NVLS_ENABLE=0", "no_proxy=127.0.0.1"]
    assert Path(launcher[len(env)]).name == "torchrun"
    # --actor-num-gpus-per-node 8 --colocate: 8 ranks on one node
    assert launcher[len(env) + 1:] == ["--standalone", "--nnodes", "1", "--nproc-per-node", "8"]


def test_fsdp_launcher_of_typer_run_main_prints_miles_recorded_command(tmp_path):
    launcher, flags = split_at_train(job_line(launch("run_qwen3_0_6b_fsdp.py")))
    assert flags == recorded_flags("run_qwen3_0_6b_fsdp.execute.txt")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" not in launcher  # Miles leaves it unset for FSDP
    assert launcher[-5:] == ["--standalone", "--nnodes", "1", "--nproc-per-node", "4"]


def test_dry_mode_runs_nothing(tmp_path):
    data, models = tmp_path / "data", tmp_path / "models"
    result = launch("run_qwen3_5_35b_a3b_lora.py", "full-train", "--data-dir", str(data), "--model-dir", str(models))
    job_line(result)
    assert f"DRY-RUN: mkdir -p {data} {models}" in result.stdout
    assert f"DRY-RUN: hf download --repo-type dataset zhuzilin/gsm8k --local-dir {data}/gsm8k" in result.stdout
    assert not data.exists() and not models.exists()


def test_inside_a_slurm_allocation_the_job_is_one_srun_step():
    result = launch("run_qwen3_5_35b_a3b_lora.py", "train", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1")
    launcher, flags = split_at_train(job_line(result))
    assert flags == recorded_flags("run_qwen3_5_35b_a3b_lora.train.txt")
    i = launcher.index("srun")
    assert launcher[i:] == ["srun", "--kill-on-bad-exit=1", "--cpu-bind=none", "--nodes=1", "--ntasks=8",
                            "--ntasks-per-node=8", sys.executable]


def test_two_node_allocation_gets_two_nodes_of_ranks():
    result = launch("run_qwen3_5_35b_a3b_lora.py", "train", "--extra-args", "--actor-num-nodes 2",
                    SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2")
    launcher, flags = split_at_train(job_line(result))
    assert flags[-2:] == ["--actor-num-nodes", "2"]
    assert launcher[launcher.index("srun") + 3:] == ["--nodes=2", "--ntasks=16", "--ntasks-per-node=8", sys.executable]


def test_several_nodes_without_slurm_use_c10d_torchrun_at_master_addr():
    result = launch("run_qwen3_5_35b_a3b_lora.py", "train", "--extra-args", "--actor-num-nodes 2",
                    MASTER_ADDR="10.0.0.1")
    launcher, _ = split_at_train(job_line(result))
    assert launcher[-10:] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                              "10.0.0.1:29400", "--rdzv-id", "miles"]


@pytest.mark.parametrize(("extra", "env", "says"), [
    ("--actor-num-nodes 2", {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "1"},
     "the job needs 2 node(s) of 8 ranks (16 ranks) but this Slurm allocation has 1"),
    ("--actor-num-nodes 2", {"MASTER_ADDR": ""}, "the job needs 2 nodes and no Slurm allocation is here: set MASTER_ADDR"),
    ("--actor-num-gpus-per-node many", {}, "--actor-num-gpus-per-node many: not an integer"),
    ("--actor-num-gpus-per-node 12", {}, "the train flags plan 12 ranks over 2 nodes of 8"),
])
def test_a_launch_that_cannot_work_is_one_line(extra, env, says):
    result = launch("run_qwen3_5_35b_a3b_lora.py", "train", "--extra-args", extra, **env)
    assert result.returncode == 2, result.stdout[-2000:]
    errors = [ln for ln in result.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and says in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("argv", "expected"), [
    (["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"], 4),
    (["--actor-num-gpus-per-node", "4", "--colocate", "--rollout-num-gpus-per-engine", "2"], 4),
    (["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "8"], 16),
    (["--actor-num-gpus-per-node", "3", "--debug-train-only"], 3),
    (["--debug-rollout-only", "--rollout-num-gpus", "2"], 2),
])
def test_the_launch_has_exactly_the_ranks_the_role_plan_needs(argv, expected):
    parser = argparse.ArgumentParser()
    cluster_flags.add_arguments(parser)
    ns = parser.parse_args(argv)
    cfg = ClusterConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ClusterConfig)})
    world = planned_ranks(read_cluster_flags(argv), slots=8)
    assert world == expected
    assert build_role_plan(cfg, world).world_size == world
    for wrong in (world - 1, world + 1):
        if wrong >= 1:
            with pytest.raises(ConfigError):
                build_role_plan(cfg, wrong)


def test_without_rollout_num_gpus_the_rest_of_the_slots_serve():
    """Disaggregated without --rollout-num-gpus: Miles's Ray cluster gave the engines the GPUs left over."""
    assert planned_ranks(read_cluster_flags(["--actor-num-gpus-per-node", "2"]), slots=8) == 8


def test_enable_ray_submit_0_builds_but_does_not_start(monkeypatch, capsys):
    monkeypatch.delenv("MILES_SCRIPT_DRY_RUN", raising=False)
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    U.execute_train("--actor-num-gpus-per-node 2 --colocate --train-backend fsdp", num_gpus_per_node=2,
                    megatron_model_type=None)
    out = capsys.readouterr().out
    assert "NOT STARTED (MILES_SCRIPT_ENABLE_RAY_SUBMIT=0):" in out and "--nproc-per-node 2" in out


def test_a_download_into_a_directory_already_there_is_skipped(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("MILES_SCRIPT_DRY_RUN", raising=False)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.parquet").write_bytes(b"x")
    monkeypatch.setenv("PATH", str(tmp_path))  # no `hf` anywhere: it must not be run
    with caplog.at_level("INFO", logger="miles.launcher"):
        U.hf_download_dataset("zhuzilin/gsm8k", data_dir=str(tmp_path))
    assert f"{tmp_path}/gsm8k is already there: not downloaded" in caplog.text


def test_a_failing_command_is_one_line_with_its_exit_code(monkeypatch, capsys):
    monkeypatch.delenv("MILES_SCRIPT_DRY_RUN", raising=False)
    with pytest.raises(SystemExit) as e:
        U.exec_command_cpu("exit 3")
    assert e.value.code == 3
    assert "[miles launcher] error: command exited with code 3: exit 3" in capsys.readouterr().err


def test_the_ref_load_of_a_skipped_conversion_is_the_hf_directory(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MILES_SCRIPT_DRY_RUN", "1")
    (tmp_path / "M").mkdir()
    (tmp_path / "M" / "config.json").write_text("{}")
    U.execute_train(f"--train-backend fsdp --ref-load {tmp_path}/M_torch_dist --load {tmp_path}/M_torch_dist "
                    "--actor-num-gpus-per-node 1 --colocate", num_gpus_per_node=1, megatron_model_type=None)
    _, flags = split_at_train(shlex.split(capsys.readouterr().out.split("DRY-RUN:")[-1]))
    assert flags[flags.index("--ref-load") + 1] == f"{tmp_path}/M"
    assert flags[flags.index("--load") + 1] == f"{tmp_path}/M_torch_dist"  # absent: a fresh start, as Miles's


def test_model_args_come_from_the_launchers_checkout_or_are_left_to_config_json(monkeypatch, caplog):
    monkeypatch.setenv("MILES_MODEL_SCRIPT_DIR", str(FIXTURES / "models"))
    args = load_model_args("qwen3.5-35B-A3B_lora").split()
    assert args[args.index("--moe-layer-freq") + 1] == "[" + ",".join(["1"] * 40) + "]"
    assert "'[1,1," in shell_safe_model_args("qwen3.5-35B-A3B_lora")  # quoted: a glob to the shell otherwise
    with caplog.at_level("INFO", logger="miles.launcher"):
        assert shell_safe_model_args("no-such-model") == ""
    assert "adding no shape flags (the Megatron backend reads the model's shape from --hf-checkpoint" in caplog.text
    assert moe_layer_freq(nlayers=4, first_k_dense_replace=1) == "[0,1,1,1]"


def test_megatron_model_type_must_match_the_backend(monkeypatch, capsys):
    monkeypatch.setenv("MILES_SCRIPT_DRY_RUN", "1")
    with pytest.raises(SystemExit) as e:
        U.execute_train("--train-backend fsdp", num_gpus_per_node=1, megatron_model_type="qwen3-4B")
    assert e.value.code == 2
    assert "pass a model type exactly when training with megatron" in capsys.readouterr().err
