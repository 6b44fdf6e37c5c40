"""The driver's command channel: small JSON commands over a gloo group, every wait bounded.

    chan = CommandChannel(groups.control_group, src=plan.driver_rank, timeout=timeout_s)
    chan.send({"cmd": "train", "rollout_id": 3})      # driver
    cmd = chan.recv()                                  # every other member, in the same order

Commands are JSON (never pickle) sent with :func:`miles.run.wire.broadcast_bytes` (one gloo
broadcast carrying the size and, for a command, the whole payload), so a rank that stopped answering surfaces as a TimeoutError naming the group within
``timeout`` seconds. While the driver generates, :meth:`CommandChannel.keepalive` sends ``{"cmd":
"wait"}`` every ``keepalive_s`` so that followers waiting for their next command are never silent
for long and a dead driver is noticed. ``all_gather_json`` collects one small object per rank (e.g.
engine URLs) the same way.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from miles.run.wire import broadcast_bytes
from miles.spmd.errors import PeerGoneError
from miles.spmd.groups import translate_collective_error
from miles.utils.logging import get_logger
from miles.utils.process_groups import wait_timeout_message

logger = get_logger(__name__)

WAIT = "wait"


class CommandChannel:
    def __init__(self, group: Any, src: int, timeout: float, keepalive_s: float | None = None) -> None:
        import torch.distributed as dist

        self.group, self.src, self.timeout = group, src, float(timeout)
        self.keepalive_s = keepalive_s if keepalive_s is not None else max(1.0, min(30.0, timeout / 4))
        self.is_src = dist.get_rank() == src
        self.busy = False  # driver: the ranks are inside a command's collectives (no abort message then)
        self._lock = threading.Lock()

    def send(self, cmd: dict[str, Any], timeout: float | None = None) -> None:
        assert self.is_src, "only the driver sends commands"
        data = json.dumps(cmd).encode()
        with self._lock:
            broadcast_bytes(data, self.group, self.src, self.timeout if timeout is None else timeout)

    def abort(self, reason: str, timeout: float = 15.0) -> None:
        """Driver, on failure: tell ranks waiting for a command why the run stops (best effort)."""
        if self.busy:
            return  # they are inside a collective with the driver; its exit ends it
        try:
            self.send({"cmd": "abort", "reason": " ".join(reason.split())[:500]}, timeout=timeout)
        except (RuntimeError, TimeoutError, ValueError, PeerGoneError) as e:
            logger.debug("could not send abort: %s", e)

    def recv(self) -> dict[str, Any]:
        """The next command that is not a keep-alive."""
        while True:
            data = broadcast_bytes(None, self.group, self.src, self.timeout)
            try:
                cmd = json.loads(data.decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RuntimeError(f"malformed command from the driver (rank {self.src}): {e}") from e
            if cmd.get("cmd") != WAIT:
                return cmd

    @contextlib.contextmanager
    def keepalive(self) -> Iterator[None]:
        """On the driver: send keep-alives every ``keepalive_s`` until the block ends."""
        if not self.is_src:
            yield
            return
        stop = threading.Event()
        errors: list[BaseException] = []

        def beat() -> None:
            while not stop.wait(self.keepalive_s):
                try:
                    self.send({"cmd": WAIT})
                except (RuntimeError, TimeoutError, PeerGoneError) as e:  # surfaces at the end of the block
                    errors.append(e)
                    return

        t = threading.Thread(target=beat, name="miles-keepalive", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=self.timeout + 5)
        if errors:
            raise errors[0]


def all_gather_json(obj: Any, group: Any, timeout: float) -> list[Any]:
    """Every member's ``obj`` (JSON-able), in group-rank order; bounded by ``timeout``."""
    import torch.distributed as dist

    data = json.dumps(obj).encode()
    n = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    _wait(dist.all_gather(sizes, size, group=group, async_op=True), group, timeout, "size all-gather")
    width = int(max(int(s) for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)]
    _wait(dist.all_gather(outs, buf, group=group, async_op=True), group, timeout, "all-gather")
    return [json.loads(o[:int(s)].numpy().tobytes().decode()) for o, s in zip(outs, sizes)]


def _wait(work: Any, group: Any, timeout: float, what: str) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as e:
        gone = translate_collective_error(e, "control", timedelta(seconds=timeout))
        if isinstance(gone, PeerGoneError):  # a member exited (its connection closed): not a timeout
            raise gone from e
        raise TimeoutError(wait_timeout_message(what, group, timeout, error=e)) from e
    if ok is False:
        raise TimeoutError(wait_timeout_message(what, group, timeout))


def broadcast_json(obj: Any, group: Any, src: int, timeout: float) -> Any:
    """``obj`` from global rank ``src`` to every member of ``group`` (others pass None)."""
    import torch.distributed as dist

    data = json.dumps(obj).encode() if dist.get_rank() == src else None
    return json.loads(broadcast_bytes(data, group, src, timeout).decode())
