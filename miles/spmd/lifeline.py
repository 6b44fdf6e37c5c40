"""A rank dies with its launcher: no orphan keeps training, serving or writing checkpoints.

When the process that started a rank is killed outright (``kill -9`` of the torchrun agent, of Open MPI's
``mpirun``/``orted``, of MPICH's ``hydra_pmi_proxy``, of Slurm's ``slurmstepd``), the kernel re-parents
the rank (to PID 1 or a subreaper) and nothing else tells it the job is over: it would go on training and
saving into ``--save`` while a relaunch starts a second copy of the job.

``watch_launcher()`` (``run_main`` calls it before the entry point runs) starts one daemon thread that
polls ``os.getppid()`` every ``POLL_S`` seconds. The process that started us is this rank's parent under
every launcher: torchrun's agent (its workers are its children), ``mpirun`` (Open MPI's local ranks) or
``orted``/``prted`` (other nodes), ``hydra_pmi_proxy`` (MPICH), ``slurmstepd`` (srun). When the parent
changes, the rank writes one line to stderr, stops its engine children (SIGTERM to each process group,
SIGKILL after ``ENGINE_GRACE_S``) and leaves with ``os._exit(EXIT_LAUNCHER_GONE)``: no interpreter
teardown, no waiting on peers. A checkpoint being written is left as its ``.tmp.`` directory, which is
never renamed and which ``latest_checkpoint`` ignores (miles/trainer/checkpoint/layout.py).

A torchrun agent that itself runs under a launcher (``srun torchrun ...``: slurm/grpo.sh's
``LAUNCH=torchrun``; or an MPI daemon) is the rank's parent, but nothing watches the agent: once its own
launcher is gone (``slurmstepd`` SIGKILLed), the agent and its ranks would carry on. So a torchrun rank
whose agent's parent is one of ``OUTER_LAUNCHERS`` also polls the agent's parent; when it changes, the
rank sends the agent SIGTERM (so it restarts no workers and ends its others) and leaves as above.

Why a poll and not ``PR_SET_PDEATHSIG`` on the rank: the kernel sends that signal when the *thread* that
forked the rank exits, not its process, and by its default action the rank would die without stopping its
engines. The engine children do use it (supervisor.py), because their forking thread is the supervisor's
watcher, which lives as long as the rank.

Only under a launcher (torchrun, Open MPI, MPICH, PMIx, srun): a run started by hand (``nohup python
train.py &``, or ``RANK``/``WORLD_SIZE`` set by a user) outlives its shell as it always did.
``MILES_DIE_WITH_LAUNCHER=0`` turns the watch off, ``=1`` forces it on.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from miles.config.base import ConfigError

POLL_S = 0.2
ENGINE_GRACE_S = 1.0
EXIT_LAUNCHER_GONE = 129  # 128 + SIGHUP: the process in charge of us went away
WATCHED_LAUNCHERS = frozenset({"torchrun", "openmpi", "mpich", "pmix", "slurm"})
# launcher processes a torchrun agent can run under (``comm``, at most 15 characters)
OUTER_LAUNCHERS = frozenset({"slurmstepd", "orted", "prted", "hydra_pmi_proxy"})
_ENV = "MILES_DIE_WITH_LAUNCHER"
_started: threading.Thread | None = None


def process_name(pid: int) -> str:
    """``comm`` of a process (``?`` when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def parent_of(pid: int) -> int | None:
    """The parent pid of a process (None when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def should_watch(env: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank of a launcher whose death must end it (see the module docstring)."""
    env = os.environ if env is None else env
    forced = env.get(_ENV, "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return False
    if forced in ("1", "true", "yes", "on"):
        return True
    return launcher_name(env) in WATCHED_LAUNCHERS | {"launcher"}


def launcher_name(env: dict[str, str] | None = None) -> str:
    """The launcher the environment names (world.py's ``read_launch_env``), ``launcher`` if it is malformed."""
    from miles.spmd.world import read_launch_env

    try:
        return read_launch_env(dict(os.environ if env is None else env)).launcher
    except ConfigError:  # a malformed launcher variable: bootstrap reports it; a launcher is there
        return "launcher"


def _leave(parent: int, name: str, agent: int | None = None) -> None:
    from miles.spmd.errors import env_rank

    rank = env_rank()
    prefix = f"[miles r{rank}]" if rank is not None else "[miles]"
    if agent is None:
        msg = (f"{prefix} error: the launcher process that started this rank ({name}, pid {parent}) is gone "
               f"(now re-parented to pid {os.getppid()}); exiting, with its engine processes, so that nothing "
               "keeps training or writing checkpoints. Relaunch the job to resume from its last complete checkpoint.\n")
    else:
        msg = (f"{prefix} error: the launcher process that started this rank's torchrun agent (pid {agent}) is gone "
               f"({name}, pid {parent}); stopping the agent and exiting, with this rank's engine processes, so that "
               "nothing keeps training or writing checkpoints. Relaunch the job to resume from its last complete "
               "checkpoint.\n")
    backstop = threading.Timer(ENGINE_GRACE_S + 2.0, os._exit, (EXIT_LAUNCHER_GONE,))
    backstop.daemon = True
    backstop.start()  # nothing below (a log handler's lock, a dead pipe) may keep this rank alive
    try:
        os.write(2, msg.encode())  # EPIPE when the launcher carried our stderr (mpirun, hydra)
    except OSError:
        pass
    try:
        from miles.utils.logging import get_logger

        get_logger(__name__).error("%s", msg.strip())  # the rank's log file, where one is configured
    except Exception:  # noqa: BLE001 - nothing may keep this rank alive now
        pass
    if agent is not None:
        try:
            os.kill(agent, signal.SIGTERM)  # torchrun then stops its other workers and restarts none
        except OSError:
            pass
    supervisor = sys.modules.get("miles.spmd.supervisor")
    if supervisor is not None:
        try:
            supervisor.terminate_all(grace=ENGINE_GRACE_S)
        except Exception:  # noqa: BLE001 - nothing may keep this rank alive now
            pass
    os._exit(EXIT_LAUNCHER_GONE)


def _watch(parent: int, name: str, poll: float, outer: tuple[int, str] | None) -> None:
    while os.getppid() == parent:
        if outer is not None and parent_of(parent) not in (outer[0], None):
            _leave(outer[0], outer[1], agent=parent)
        time.sleep(poll)
    _leave(parent, name)


def outer_launcher(agent: int, env: dict[str, str] | None = None) -> tuple[int, str] | None:
    """(pid, description) of the launcher a torchrun rank's agent runs under, or None (see the docstring)."""
    if launcher_name(env) != "torchrun":
        return None
    outer = parent_of(agent)
    if outer is None or outer <= 1:
        return None
    comm = process_name(outer)
    return (outer, f"torchrun under {comm}") if comm in OUTER_LAUNCHERS else None


def watch_launcher(poll: float = POLL_S, env: dict[str, str] | None = None) -> threading.Thread | None:
    """Start the launcher-liveness thread once per process (no-op outside a launcher); returns it."""
    global _started
    if _started is not None and _started.is_alive():
        return _started
    if not should_watch(env):
        return None
    parent = os.getppid()
    name = f"{launcher_name(env)}: {process_name(parent)}"
    outer = outer_launcher(parent, env)
    _started = threading.Thread(target=_watch, args=(parent, name, poll, outer), name="miles-launcher-watch",
                                daemon=True)
    _started.start()
    return _started
