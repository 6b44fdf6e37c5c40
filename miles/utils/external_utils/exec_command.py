"""Miles's ``exec_command``: run a shell command from a launcher, or print it in the dry mode.

``exec_command_cpu`` / ``exec_command_gpu`` run ``bash -c CMD`` on this machine (Miles's two names differ only
in where Ray would place them; here both run locally). ``exec_command_multi_node`` runs a command once per
node: through ``srun`` (one task per node) inside a Slurm allocation, else once here as the only node, with
Miles's ``{{node_rank}}``, ``{{nnodes}}``, ``{{master_addr}}`` and ``{{node_ip}}`` placeholders filled in.

A command that is one ``hf download ... --local-dir DIR`` is skipped (one log line) when ``DIR`` already holds
files: with the model and data in place no hub is needed. ``MILES_SCRIPT_DRY_RUN=1``: nothing runs; each command is printed on stdout as ``DRY-RUN: <command>`` and a
captured output is empty. A command that fails ends the launcher with one line (the exit code and the
command) and that exit code, not a traceback.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from miles.utils.logging import get_logger, set_role

logger = get_logger("miles.launcher")
set_role("launcher")  # only a launcher process imports this: its lines read "[miles launcher] ..."

DRY_RUN_ENV = "MILES_SCRIPT_DRY_RUN"


def dry_run() -> bool:
    """True when ``MILES_SCRIPT_DRY_RUN`` is 1/true: commands are printed, not run."""
    return os.environ.get(DRY_RUN_ENV, "").strip().lower() in ("1", "true", "yes")


def fail(message: str, code: int = 2) -> None:
    """End the launcher with one line (a mistake of the user's, or a command that failed)."""
    print(f"[miles launcher] error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def exec_command_cpu(cmd: str, capture_output: bool = False) -> str | None:
    """Run ``cmd`` with bash here; with ``capture_output`` return its stdout."""
    return _exec(cmd, capture_output)


def exec_command_gpu(cmd: str, capture_output: bool = False) -> str | None:
    """Same as ``exec_command_cpu`` (Miles's GPU variant only differs in Ray placement)."""
    return _exec(cmd, capture_output)


def _download_target(cmd: str) -> str | None:
    """The ``--local-dir`` of a command that is one ``hf download`` (or ``huggingface-cli download``)."""
    try:
        tokens = shlex.split(cmd)
    except ValueError:
        return None
    if tokens[:2] not in (["hf", "download"], ["huggingface-cli", "download"]) or "--local-dir" not in tokens[:-1]:
        return None
    if any(t in ("&&", "||", ";", "|") for t in tokens):
        return None
    return tokens[tokens.index("--local-dir") + 1]


def _exec(cmd: str, capture_output: bool) -> str | None:
    target = _download_target(cmd)
    if target is not None and Path(target).is_dir() and any(Path(target).iterdir()):
        logger.info("%s is already there: not downloaded (%s)", target, cmd)
        return "" if capture_output else None
    if dry_run():
        print(f"DRY-RUN: {cmd}", flush=True)
        return "" if capture_output else None
    print(f"EXEC: {cmd}", flush=True)
    result = subprocess.run(["bash", "-c", cmd], capture_output=capture_output, text=capture_output)
    if result.returncode != 0:
        detail = f"; stderr: {result.stderr.strip()[-500:]}" if capture_output and result.stderr else ""
        hint = (f" (a download needs the Hugging Face hub; without it, put the files in {target} or pass a local "
                "--hf-checkpoint/--data-dir)" if target is not None else "")
        fail(f"command exited with code {result.returncode}: {cmd}{detail}{hint}", code=result.returncode)
    return result.stdout if capture_output else None


def in_slurm_allocation() -> bool:
    """Inside ``salloc``/``sbatch`` (a job id), where ``srun`` starts the job's steps."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def exec_command_multi_node(cmd: str, capture_output: bool = False, num_nodes: int | None = None) -> list[str | None]:
    """Run ``cmd`` once on each node (Miles: each alive Ray node); returns one output per node.

    Inside a Slurm allocation: one ``srun`` step, one task per node, the placeholders filled from the
    task's ``SLURM_NODEID`` and the step's first host (the outputs come back as one string). Elsewhere this
    machine is the only node.
    """
    if in_slurm_allocation():
        nodes = num_nodes or int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        node_cmd = (cmd.replace("{{node_rank}}", "${SLURM_NODEID}").replace("{{nnodes}}", str(nodes))
                    .replace("{{master_addr}}", "$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)")
                    .replace("{{node_ip}}", "$(hostname)"))
        srun = f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 bash -c {shlex.quote(node_cmd)}"
        return [_exec(srun, capture_output)]
    if num_nodes not in (None, 1):
        fail(f"exec_command_multi_node(num_nodes={num_nodes}) outside a Slurm allocation: only this machine is "
             "known here. Run the launcher inside salloc/sbatch, or with --num-nodes 1.")
    local = (cmd.replace("{{node_rank}}", "0").replace("{{nnodes}}", "1")
             .replace("{{master_addr}}", os.environ.get("MASTER_ADDR", "127.0.0.1"))
             .replace("{{node_ip}}", os.environ.get("MASTER_ADDR", "127.0.0.1")))
    return [_exec(local, capture_output)]
