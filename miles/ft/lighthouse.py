"""The torchft lighthouse on the driver's host, and the lazy torchft import every FT module uses.

The lighthouse is torchft's quorum server: replicas heartbeat to it and join quorum rounds; a round
lists the replicas that joined and are still heartbeating. Here the replicas are the driver
(``miles_driver_0``) and one per engine (``engine_<id>``, heartbeated by the engine's leader rank).

    lh = Lighthouse.start(ft_timings(cfg.ft))      # driver only
    addr = lh.address                              # share with every rank (e.g. over the control group)
    ...
    lh.shutdown()
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from types import ModuleType

from miles.ft.timing import FTTimings
from miles.utils.logging import get_logger
from miles.utils.net import host_address
from miles.utils.optional import require

logger = get_logger(__name__)

DRIVER_REPLICA_ID = "miles_driver_0"


def torchft_coordination() -> ModuleType:
    """``torchft.coordination``, imported on first use with torchft's Rust logging kept at WARN.

    torchft logs every quorum tick at INFO from Rust; ``RUST_LOG`` is read when the extension loads, so it
    is set for the import only (an explicit ``RUST_LOG`` in the environment wins).
    """
    had = "RUST_LOG" in os.environ
    if not had:
        os.environ["RUST_LOG"] = "warn"
    try:
        return require("torchft.coordination", "--use-fault-tolerance")
    finally:
        if not had:
            os.environ.pop("RUST_LOG", None)


def td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


class Lighthouse:
    """A torchft ``LighthouseServer`` running inside this process (its threads are Rust's)."""

    def __init__(self, server: object, address: str) -> None:
        self._server = server
        self.address = address

    @classmethod
    def start(cls, timings: FTTimings, bind_host: str = "0.0.0.0", port: int = 0,
              advertise_host: str | None = None) -> Lighthouse:
        """Start the lighthouse; ``address`` is what other hosts use to reach it.

        ``min_replicas`` is 1 (the driver alone is a valid quorum: a run with no live engine is the
        recovery controller's decision, not the lighthouse's).
        """
        tc = torchft_coordination()
        bind = f"[::]:{port}" if bind_host in ("0.0.0.0", "::") else f"{bind_host}:{port}"
        server = tc.LighthouseServer(
            bind=bind,
            min_replicas=1,
            join_timeout_ms=int(timings.join_timeout * 1000),
            quorum_tick_ms=50,
            heartbeat_timeout_ms=int(timings.heartbeat_timeout * 1000),
        )
        raw = server.address()
        m = re.match(r"^(?:https?://)?(.*):(\d+)$", raw)
        if m is None:
            server.shutdown()
            raise RuntimeError(f"torchft LighthouseServer returned an address miles cannot parse: {raw!r}")
        host = advertise_host or (bind_host if bind_host not in ("0.0.0.0", "::") else host_address())
        address = f"http://{host}:{m.group(2)}"
        logger.info("torchft lighthouse at %s (heartbeat timeout %.1fs, join timeout %.1fs)",
                    address, timings.heartbeat_timeout, timings.join_timeout)
        return cls(server, address)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def lighthouse_client(address: str, connect_timeout: float = 5.0) -> object:
    """A torchft ``LighthouseClient`` (gRPC; its calls release the GIL)."""
    tc = torchft_coordination()
    return tc.LighthouseClient(address, td(connect_timeout))


def engine_replica_id(engine_id: int) -> str:
    return f"engine_{engine_id}"


def parse_engine_replica_id(replica_id: str) -> int | None:
    m = re.fullmatch(r"engine_(\d+)", replica_id)
    return int(m.group(1)) if m else None
