"""Every rank's part of a run, and the driver's handle that makes all ranks do it together.

The driver (global rank 0) decides; the other ranks follow its commands, received in order over the
control group (:class:`~miles.run.control.CommandChannel`):

    {"cmd": "train", "rollout_id": k}     trainer ranks: receive their samples (wire format, scattered
                                          over the trainer group), then ``FSDPTrainer.train``
    {"cmd": "sync_weights"}               trainer ranks: ``WeightSender.sync`` (collective; ``"detach": true``
                                          from train_async.py: see ``WeightSender.sync``)
    {"cmd": "save", "rollout_id": k, "extra": {...}}   trainer ranks: crash-safe checkpoint
    {"cmd": "offload_train"} / {"cmd": "onload_train"} trainer ranks (colocated on GPU)
    {"cmd": "stop"}                       everyone: leave the loop (engine leaders stop their engine)
    {"cmd": "abort", "reason": "..."}     everyone: the driver failed; raise a MilesError naming it

Engine-only ranks take part in the control group only: they receive every command and act on stop.
The driver calls the same methods through :class:`Ranks`, which sends the command first.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from miles.dashboard import hooks as dashboard
from miles.run.control import CommandChannel
from miles.spmd.errors import MilesError
from miles.types import Sample
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.run.fleet import Placement
    from miles.run.progress import Progress
    from miles.spmd import SPMDContext

logger = get_logger(__name__)


def trainer_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The trainer's metrics under ``train/``; its phase times (``phase/<name>``: trainer rank 0's seconds,
    ``phase_max/<name>``: the slowest rank's) under ``perf/train/<name>_time`` and ``..._time_max``."""
    out = {}
    for k, v in metrics.items():
        if k.startswith("phase/"):
            out[f"perf/train/{k[len('phase/'):]}_time"] = float(v)
        elif k.startswith("phase_max/"):
            out[f"perf/train/{k[len('phase_max/'):]}_time_max"] = float(v)
        else:
            out[f"train/{k}"] = float(v)
    return out


class Worker:
    """What this rank does on each command (see the module docstring)."""

    def __init__(self, ctx: SPMDContext, channel: CommandChannel, *, timeout: float, trainer: Any = None,
                 sender: Any = None, placement: Placement | None = None, progress: Progress | None = None) -> None:
        self.ctx, self.channel, self.timeout = ctx, channel, timeout
        self.trainer, self.sender, self.placement = trainer, sender, placement
        self.progress = progress
        self.ft: Any = None  # miles.ft.integration.FaultTolerance with --use-fault-tolerance
        self.heartbeat: Any = None  # miles.ft.launcher.LauncherHeartbeat under ft_launcher

    def beat(self) -> None:
        """One heartbeat to ft_launcher's rank monitor (when running under it) per command of the run."""
        if self.heartbeat is not None:
            self.heartbeat.beat()

    @property
    def is_trainer(self) -> bool:
        return self.trainer is not None

    def handle(self, cmd: dict[str, Any]) -> bool:
        """Run one command; False when the run is over."""
        self.beat()
        with dashboard.command(cmd.get("cmd")):  # --use-miles-dashboard: this rank's phase event
            return self._dispatch(cmd)

    def _dispatch(self, cmd: dict[str, Any]) -> bool:
        name = cmd.get("cmd")
        if name == "train":
            self.train(int(cmd["rollout_id"]), None)
        elif name == "sync_weights":
            self.sync_weights(bool(cmd.get("detach", False)), cmd.get("rollout_id"))
        elif name == "save":
            self.save(int(cmd["rollout_id"]), cmd["extra"])
        elif name == "offload_train":
            self.offload_train()
        elif name == "onload_train":
            self.onload_train()
        elif name == "stop":
            return False
        elif name == "abort":
            raise MilesError(f"the driver (rank {self.channel.src}) stopped the run: {cmd.get('reason')}")
        else:
            raise RuntimeError(f"unknown command from the driver: {cmd!r}")
        return True

    def follow(self) -> None:
        """Non-driver ranks: run commands until stop."""
        while self.handle(self.channel.recv()):
            pass

    # ------------------------------------------------------------------ trainer ranks
    def train(self, rollout_id: int, per_rank: list[list[Sample]] | None) -> dict[str, float]:
        if not self.is_trainer:
            return {}
        import torch.distributed as dist

        from miles.run.wire import scatter_samples

        with self.ctx.groups.guard("trainer"):  # a dead or stuck trainer rank: one readable error, not a traceback
            t0 = time.monotonic()
            group = self.ctx.groups.trainer_cpu_group
            if per_rank is not None and len(per_rank) == 1 and dist.get_world_size(group) == 1:
                samples = per_rank[0]           # the driver is the only trainer rank: nothing to send
            else:
                samples = scatter_samples(per_rank, group, self.ctx.plan.driver_rank, self.timeout)
            t_scatter = time.monotonic() - t0
            metrics = self.trainer.train(samples, rollout_id)
        return {"perf/train/scatter_time": t_scatter, **trainer_metrics(metrics)}

    def sync_weights(self, detach: bool = False, rollout_id: int | None = None) -> dict[str, float]:
        """``detach``: the source rank may leave the engines' answer to a thread (``WeightSender.sync``); not under
        fault tolerance, whose recovery needs the outcome at once. ``rollout_id``: the rollout whose training made
        these weights (named when a detached sync lands)."""
        if not self.is_trainer or self.sender is None:
            return {}
        with self.trainer.resident(weights_only=True):  # --offload-train-target disk: the weights read back for it
            if self.ft is not None:  # drops engines that die during the sync, re-admits returned ones
                return self.ft.sync_weights(self.sender).as_metrics()
            return self.sender.sync(detach=detach, rollout_id=rollout_id).as_metrics()

    def save(self, rollout_id: int, extra: dict[str, Any]) -> None:
        if self.is_trainer:
            with self.trainer.resident():              # --offload-train-target disk: the state read back for it
                path = self.trainer.checkpoint(rollout_id, extra)
            logger.info("checkpoint for rollout %d: %s", rollout_id, path)

    def offload_train(self) -> None:
        if self.is_trainer:
            self.trainer.offload()

    def onload_train(self) -> None:
        if self.is_trainer:
            from miles.trainer.memory_margin import keep_free

            self.trainer.onload()
            keep_free(self.trainer.device, self.trainer.cfg.train_memory_margin_bytes)  # --train-memory-margin-bytes

    def close_sender(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def close(self) -> None:
        if self.ft is not None:
            self.ft.close()
            self.ft = None
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        self.close_sender()
        if self.placement is not None:
            self.placement.stop()


class Ranks:
    """The driver's view of all ranks: each method sends the command, then does the driver's share."""

    def __init__(self, worker: Worker) -> None:
        assert worker.channel.is_src, "Ranks is the driver's handle"
        self.worker, self.channel = worker, worker.channel
        self.dp_size = len(worker.ctx.plan.trainer_ranks)

    def _command(self, cmd: dict[str, Any], local: Any, *args: Any) -> Any:
        """Send ``cmd``, then run the driver's share; ``busy`` while the ranks are inside it."""
        self.channel.busy = True
        self.worker.beat()
        self.channel.send(cmd)
        with dashboard.command(cmd["cmd"]):  # --use-miles-dashboard: the driver's phase event
            out = local(*args)
        self.channel.busy = False
        return out

    def train(self, rollout_id: int, groups: list[list[Sample]]) -> dict[str, float]:
        """Scatter whole groups to the trainer ranks (balanced by tokens) and train; trainer metrics."""
        from miles.run.wire import split_for_dp

        if not self.dp_size:
            return {}
        per_rank = split_for_dp(groups, self.dp_size)
        return self._command({"cmd": "train", "rollout_id": rollout_id}, self.worker.train, rollout_id, per_rank)

    def sync_weights(self, detach: bool = False, rollout_id: int | None = None) -> dict[str, float]:
        """``detach`` needs the driver to be the sender's source rank: only the process whose thread runs a
        detached sync can land it (``WeightSender.land``), and the driver lands it before it generates again."""
        if not self.dp_size or self.worker.sender is None:
            return {}
        if detach and not self.worker.sender.is_source:
            raise MilesError(f"a detached weight sync is landed by the driver (rank {self.channel.src}), which is not "
                             f"the weight sender's source rank (rank {self.worker.ctx.plan.trainer_ranks[0]}, the first trainer rank): "
                             "its thread would run where nothing lands it; sync without detach in this layout")
        cmd = {"cmd": "sync_weights", **({"detach": True} if detach else {}),
               **({"rollout_id": rollout_id} if rollout_id is not None else {})}
        return self._command(cmd, self.worker.sync_weights, detach, rollout_id)

    def save(self, rollout_id: int, extra: dict[str, Any]) -> float:
        t0 = time.monotonic()
        if self.dp_size:
            self._command({"cmd": "save", "rollout_id": rollout_id, "extra": extra}, self.worker.save, rollout_id, extra)
        return time.monotonic() - t0

    def offload_train(self) -> None:
        self._command({"cmd": "offload_train"}, self.worker.offload_train)

    def onload_train(self) -> None:
        self._command({"cmd": "onload_train"}, self.worker.onload_train)

    def stop(self) -> None:
        self.channel.send({"cmd": "stop"})
