"""Miles's ``command_utils``: the helpers ``scripts/run_<model>.py`` call, starting one SPMD job instead of Ray.

Same names and signatures as Miles's (radixark/miles@v0.1.0:miles/utils/external_utils/command_utils.py), for
what its launchers call. What differs, each said in one log line when it happens:

- ``execute_train`` builds Miles's command, ``train.py <model args> <train args>`` with Miles's job
  environment (``PYTHONUNBUFFERED``, ``CUDA_DEVICE_MAX_CONNECTIONS``, ``NCCL_NVLS_ENABLE``, ``no_proxy``,
  ``PYTHONPATH``, core-dump and extra variables), and starts it under torchrun or srun (``launch.py``), not
  ``ray job submit``; there is no ``ray start`` and nothing is ``pkill``-ed first. A ``--ref-load X_torch_dist``
  that does not exist while ``X`` is a Hugging Face directory becomes ``--ref-load X`` (the conversion below
  is skipped and the reference model is read from ``X``); a missing ``--load`` starts from ``--hf-checkpoint``.
- ``convert_checkpoint``: skipped, our Megatron backend builds the model from the HF checkpoint directly.
- ``hf_download_dataset`` and ``hf download`` commands: skipped when the target directory is already there
  (no hub is needed then); otherwise they run, and need the hub.
- ``ssh_start_ray_workers``: nothing to do (the launcher starts the ranks on every node).
- ``fp8_cast_bf16``: Miles's ``tools/fp8_cast_bf16.py`` is not part of this package: skipped when the bf16
  directory exists, else one error line.

``MILES_SCRIPT_DRY_RUN=1``: every command is printed (``DRY-RUN: ...``), nothing runs; the job's line is the
exact command that would start. ``MILES_SCRIPT_ENABLE_RAY_SUBMIT=0`` (Miles's switch) runs everything but the
job and prints the job's command.
"""

from __future__ import annotations

import base64
import ctypes
import datetime
import json
import os
import random
import shlex
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from miles.utils.external_utils.exec_command import (
    dry_run,
    exec_command_cpu,
    exec_command_gpu,
    exec_command_multi_node,
    fail,
)
from miles.utils.external_utils.launch import build_launch_argv
from miles.utils.external_utils.model_args_utils import shell_safe_model_args
from miles.utils.file_arg_utils import PSEUDO_FILE_PREFIX
from miles.utils.logging import get_logger
from miles.utils.typer_utils import dataclass_cli

__all__ = [
    "GENERATION_HARDWARE", "NUM_GPUS_OF_HARDWARE", "ExecuteTrainConfig", "check_has_nvlink", "convert_checkpoint",
    "create_run_id", "dataclass_cli", "encode_pseudo_file", "exec_command_cpu", "exec_command_gpu",
    "exec_command_multi_node", "execute_train", "fp8_cast_bf16", "get_bool_env_var", "get_default_wandb_args",
    "get_env_enable_infinite_run", "hf_download_dataset", "repo_base_dir", "resolve_extra_env_vars", "rsync_simple",
    "ssh_start_ray_workers",
]

logger = get_logger("miles.launcher")

repo_base_dir = Path(__file__).resolve().parents[3]

NUM_GPUS_OF_HARDWARE = {"H100": 8, "H200": 8, "B200": 8, "B300": 8, "GB200": 4, "GB300": 4, "MI350X": 8, "MI355X": 8}
GENERATION_HARDWARE = {"H100": "Hopper", "GB200": "Blackwell", "GB300": "Blackwell"}

_TORCH_DIST_SUFFIX = "_torch_dist"


def convert_checkpoint(model_name: str, megatron_model_type: str | None, num_gpus_per_node: int,
                       multinode: bool = False, num_nodes: int | None = None, extra_args: str = "",
                       dir_dst: str = "/root", hf_checkpoint: str | None = None,
                       megatron_path: str = "/root/Megatron-LM") -> None:
    """Skipped: Miles converts HF -> torch_dist for Megatron-LM; our Megatron backend loads the HF checkpoint."""
    hf_checkpoint = hf_checkpoint or f"/root/models/{model_name}"
    logger.info("convert_checkpoint(%s): skipped, the Megatron backend builds the model from the HF checkpoint %s "
                "directly; a --load/--ref-load of %s/%s%s is served from it", model_name, hf_checkpoint, dir_dst,
                model_name, _TORCH_DIST_SUFFIX)


def rsync_simple(path_src: str, path_dst: str, num_nodes: int | None = None) -> None:
    """Copy ``path_src/`` into ``path_dst`` on every node (one srun task per node in a Slurm allocation)."""
    exec_command_multi_node(f"mkdir -p {path_dst} && rsync -a --info=progress2 {path_src}/ {path_dst}",
                            num_nodes=num_nodes)


def ssh_start_ray_workers(master_addr: str, num_gpus_per_node: int, hostfile: str = "/root/mpi_rack_hostfile",
                          head_host: str | None = None) -> None:
    """Nothing to do: there is no Ray cluster; srun (or torchrun on each node) starts the ranks."""
    logger.info("ssh_start_ray_workers: not needed, no Ray; the job's ranks are started by srun/torchrun")


def hf_download_dataset(full_name: str, data_dir: str = "/root/datasets") -> None:
    """``hf download --repo-type dataset`` into ``data_dir/<name>``, unless that directory is already there."""
    _, name = full_name.split("/")
    exec_command_cpu(f"hf download --repo-type dataset {full_name} --local-dir {data_dir}/{name}")


def fp8_cast_bf16(path_src: str, path_dst: str) -> None:
    """Needs Miles's tools/fp8_cast_bf16.py, not part of this package: skipped if ``path_dst`` is there."""
    if (Path(path_dst) / "model.safetensors.index.json").exists():
        logger.info("fp8_cast_bf16 skip %s since it already holds model.safetensors.index.json", path_dst)
        return
    message = (f"fp8_cast_bf16: Miles's tools/fp8_cast_bf16.py is not part of this package; cast {path_src} to bf16 "
               f"into {path_dst} with it, then run the launcher again")
    if dry_run():
        print(f"DRY-RUN: (not provided here) {message}", flush=True)
        return
    fail(message)


@dataclass
class ExecuteTrainConfig:
    """Miles's launcher options every ScriptArgs extends (``num_nodes`` from ``SLURM_JOB_NUM_NODES``)."""

    cuda_core_dump: bool = False
    num_nodes: int = field(default_factory=lambda: int(os.environ.get("SLURM_JOB_NUM_NODES", "1")))
    extra_env_vars: str = ""
    output_dir: str = "/root/shared_data"


def _parse_extra_env_vars(text: str) -> dict[str, str]:
    """``--extra-env-vars``: a JSON object, or ``K=V K2=V2``."""
    text = text.strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    pairs = {}
    for item in text.split():
        key, sep, val = item.partition("=")
        if not sep or not key:
            fail(f"--extra-env-vars {text!r}: {item!r} is not KEY=VALUE; give a JSON object or KEY=VALUE pairs")
        pairs[key] = val
    return pairs


def resolve_extra_env_vars(extra_env_vars: dict[str, str], config: ExecuteTrainConfig) -> dict[str, str]:
    """The script's variables, then ``config.extra_env_vars`` over them."""
    return {**extra_env_vars, **_parse_extra_env_vars(config.extra_env_vars)}


def _job_env(train_backend_fsdp: bool, extra_env_vars: dict[str, str], config: ExecuteTrainConfig) -> dict[str, str]:
    """The variables Miles puts in the job's Ray runtime env (MASTER_ADDR left to the launcher)."""
    env = {"PYTHONUNBUFFERED": "1"}
    if not train_backend_fsdp:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE") or str(int(check_has_nvlink()))
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    env["no_proxy"] = ",".join(dict.fromkeys(["127.0.0.1", master, *filter(None, os.environ.get("no_proxy", "").split(","))]))
    if config.cuda_core_dump:
        env.update(CUDA_ENABLE_COREDUMP_ON_EXCEPTION="1", CUDA_COREDUMP_SHOW_PROGRESS="1",
                   CUDA_COREDUMP_GENERATION_FLAGS="skip_nonrelocated_elf_images,skip_global_memory,"
                   "skip_shared_memory,skip_local_memory,skip_constbank_memory",
                   CUDA_COREDUMP_FILE=f"{config.output_dir}/cuda_coredump_%h.%p.%t")
    env.update(resolve_extra_env_vars(extra_env_vars, config))
    paths = [str(repo_base_dir), *env.get("PYTHONPATH", "").split(os.pathsep),
             *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def _serve_skipped_conversions(argv: list[str]) -> list[str]:
    """``--ref-load X_torch_dist`` (absent) -> ``X`` when ``X`` is an HF directory: see the module docstring."""
    out = list(argv)
    for i, token in enumerate(out[:-1]):
        value = out[i + 1]
        if token not in ("--ref-load", "--load") or not value.endswith(_TORCH_DIST_SUFFIX) or Path(value).exists():
            continue
        hf_dir = value[: -len(_TORCH_DIST_SUFFIX)]
        if token == "--load":
            logger.info("--load %s does not exist: the run starts from --hf-checkpoint (as from a fresh conversion)",
                        value)
        elif (Path(hf_dir) / "config.json").is_file():
            logger.info("--ref-load %s does not exist (convert_checkpoint is skipped): reading the reference model "
                        "from %s", value, hf_dir)
            out[i + 1] = hf_dir
    return out


def _die_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies (PR_SET_PDEATHSIG), so no job outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:  # not Linux: the job then ends only with its own launcher's signals
        pass


def execute_train(train_args: str, num_gpus_per_node: int, megatron_model_type: str | None,
                  train_script: str = "train.py", before_ray_job_submit=None,
                  extra_env_vars: dict[str, str] | None = None, config: ExecuteTrainConfig | None = None,
                  megatron_path: str = "/root/Megatron-LM") -> None:
    """Start ``train_script <model args> <train args>`` as one SPMD job (module docstring; docs/launching.md)."""
    config = config if config is not None else ExecuteTrainConfig()
    script = Path(train_script) if os.path.isabs(train_script) else repo_base_dir / train_script
    if not script.is_file():
        fail(f"execute_train(train_script={train_script!r}): no such file {script}; the entry scripts (train.py, "
             "train_async.py) are in the miles checkout, run the launcher from one")
    train_backend_fsdp = "--train-backend fsdp" in train_args
    if train_backend_fsdp != (megatron_model_type is None):
        fail(f"execute_train: megatron_model_type={megatron_model_type!r} with "
             f"{'--train-backend fsdp' if train_backend_fsdp else 'the megatron backend'}; pass a model type exactly "
             "when training with megatron (None with --train-backend fsdp)")
    logger.info("no Ray: nothing to stop or start first; the job runs as one SPMD job (megatron-core and miles from "
                "this environment%s)", "" if megatron_path == "/root/Megatron-LM" else f"; megatron_path {megatron_path} is not used")
    if before_ray_job_submit is not None:
        before_ray_job_submit()
    env = _job_env(train_backend_fsdp, extra_env_vars or {}, config)
    try:
        argv = shlex.split(f"{shell_safe_model_args(megatron_model_type)} {train_args}")
    except ValueError as e:
        fail(f"execute_train: the train arguments do not split as a shell would ({e}): {train_args[:200]}")
    argv = _serve_skipped_conversions(argv)
    launch = build_launch_argv(str(script), argv, num_gpus_per_node, config.num_nodes)
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in changed.items()), shlex.join(launch)])
    if dry_run():
        print(f"DRY-RUN: {line}", flush=True)
        return
    if not get_bool_env_var("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "1"):
        print(f"NOT STARTED (MILES_SCRIPT_ENABLE_RAY_SUBMIT=0): {line}", flush=True)
        return
    print(f"EXEC: {line}", flush=True)
    proc = subprocess.Popen(launch, env={**os.environ, **env}, preexec_fn=_die_with_parent)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the job got the same SIGINT (one process group): let it stop, then leave
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait()
    if rc != 0:
        fail(f"the job exited with code {rc}: {shlex.join(launch[:8])} ...", code=rc if rc > 0 else 1)


def check_has_nvlink() -> bool:
    """Whether ``nvidia-smi topo -m`` shows NVLink (False without nvidia-smi, and in the dry mode)."""
    if dry_run():
        return False
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(word.startswith("NV") and word[2:].isdigit() for word in out.split())


def get_default_wandb_args(test_file: str, run_name_prefix: str | None = None, run_id: str | None = None) -> str:
    """Miles's W&B flags for a launcher (project ``miles-<script name>``), or "" without ``WANDB_API_KEY``."""
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        print("Skip wandb configuration since WANDB_API_KEY is not found")
        return ""
    path = Path(test_file)
    name = path.stem if len(path.stem) >= 6 else f"{path.parent.name}_{path.stem}"
    group = run_id or create_run_id()
    if (commit := os.environ.get("GITHUB_COMMIT_NAME")) is not None:
        group += f"_{commit}"
    if run_name_prefix is not None:
        group = f"{run_name_prefix}_{group}"
    return (f"--use-wandb --wandb-project miles-{name} --wandb-group {group} --wandb-key {shlex.quote(key)} "
            "--disable-wandb-random-suffix ")


def create_run_id() -> str:
    """``YYMMDD-HHMMSS-NNN`` (UTC time and three random digits)."""
    now = datetime.datetime.now(datetime.UTC).strftime("%y%m%d-%H%M%S")
    return f"{now}-{random.Random().randint(0, 999):03d}"


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """``true``/``1`` is True; ``false``/``0`` False; anything else False with one printed line."""
    value = os.getenv(name, default).lower()
    if value not in ("true", "1", "false", "0"):
        print(f"get_bool_env_var({name}) see non-understandable value={value} and treat as false")
    return value in ("true", "1")


def get_env_enable_infinite_run() -> bool:
    return get_bool_env_var("MILES_TEST_ENABLE_INFINITE_RUN", "false")


def encode_pseudo_file(text: str) -> str:
    """A flag value carrying ``text`` inline (``base64:...``), read by ``miles.utils.file_arg_utils``."""
    return PSEUDO_FILE_PREFIX + base64.b64encode(text.encode()).decode()

