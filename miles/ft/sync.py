"""A weight sync that survives engines dying during it (run on every trainer rank).

The source rank (the driver) takes its targets from the recovery controller: the engines in rotation
plus those back and awaiting weights. When they changed, the sender's weight group is formed again with
exactly them. An attempt that fails (every trainer rank sees the failure, agreed over the trainer group)
takes the engines that fail a health probe out and syncs the others again with the same version; the
dead ones catch up after they return. Other trainer ranks only repeat their side of the attempts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.ft.recovery import EngineRecoveryController
from miles.utils.logging import get_logger

logger = get_logger(__name__)


def sync_weights_with_recovery(sender: Any, controller: EngineRecoveryController | None,
                               to_target: Callable[[int, str], Any], *,
                               retry_on: tuple[type[BaseException], ...] = (RuntimeError,),
                               max_attempts: int = 3, on_synced: Callable[[int], None] | None = None) -> Any:
    """One weight sync that survives engines dying during it. Call it on every trainer rank.

    ``sender`` is a ``miles.weight_sync`` sender; ``controller`` is given on its source rank (the driver)
    and None elsewhere; ``to_target(engine_id, url)`` builds the sender's engine target. On the source
    rank the targets are :meth:`EngineRecoveryController.sync_targets` (in rotation + back awaiting
    weights): when they changed, a new weight group is formed with exactly them (``reconnect``). A failed
    attempt (``retry_on``, the sender's ``WeightSyncError``; every trainer rank sees it) takes the engines
    that fail a health probe out and syncs the others again, with the same version; the dead ones catch up
    after they return. After success ``on_synced(version)`` runs, then the engines that were awaiting
    weights are verified and routed again.
    """
    last: BaseException | None = None
    for attempt in range(1, max_attempts + 1):
        targets = None
        if controller is not None:
            targets = _reconnected_targets(sender, controller, to_target, retry_on, max_attempts)
        try:
            result = sender.sync(targets)
        except retry_on as e:
            last = e
            logger.warning("weight sync attempt %d/%d failed: %s", attempt, max_attempts, e)
            if controller is not None:
                controller.on_sync_failed(e)
            continue
        if on_synced is not None:
            on_synced(sender.weight_version)
        if controller is not None:
            admitted = controller.on_weights_updated(sender.weight_version, [t.url for t in targets])
            if admitted:
                logger.info("weight sync v%d put engine(s) %s in rotation", sender.weight_version, admitted)
        return result
    raise last  # type: ignore[misc]


def _reconnected_targets(sender: Any, controller: EngineRecoveryController, to_target: Callable[[int, str], Any],
                         retry_on: tuple[type[BaseException], ...], max_attempts: int) -> list[Any]:
    """The source rank's targets, with the sender's weight group re-formed when membership changed."""
    for attempt in range(1, max_attempts + 1):
        targets = [to_target(eid, url) for eid, url in controller.sync_targets()]
        if not targets:
            logger.warning("weight sync with no engine in rotation: the trainer's weights reach engines when they return")
            if sender.engines:  # forget the dead ones (a group cannot be formed without engines: that error is moot)
                try:
                    sender.reconnect([])
                except retry_on:
                    pass
                sender.engines = []
            return targets
        if [t.url for t in targets] == [t.url for t in sender.engines]:
            return targets
        try:
            sender.reconnect(targets)
            return targets
        except retry_on as e:
            logger.warning("forming a weight group with %s failed (attempt %d/%d): %s", [t.url for t in targets],
                           attempt, max_attempts, e)
            controller.on_sync_failed(e)
    targets = [to_target(eid, url) for eid, url in controller.sync_targets()]
    sender.reconnect(targets)
    return targets
