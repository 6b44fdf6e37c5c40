"""Embedded engine processes for tests: one ``python -m miles.engine`` on the tiny model under the real supervisor,
and a bounded wait until each answers ``/health``. Shared by the fleet's client tests and the rollout tests that
need an engine (``tests/`` is on ``sys.path`` through its conftest.py: ``from embedded_engines import ...``)."""

from __future__ import annotations

import asyncio

from miles.fleet.client import EngineControl, EngineError
from miles.fleet.engines import build_engine_argv, engine_url
from miles.spmd.supervisor import EngineSupervisor
from miles.utils.net import find_free_port


def start_engine(model_dir, log_path, api_key: str | None, name: str = "engine") -> tuple[EngineSupervisor, str]:
    """One embedded engine under the real supervisor (no restarts); returns at once (see :func:`wait_engines`)."""
    port = find_free_port()
    argv = build_engine_argv("embedded", hf_checkpoint=str(model_dir), host="127.0.0.1", port=port, api_key=api_key,
                             device="cpu", max_running_requests=8, max_context_len=512)
    sup = EngineSupervisor(argv, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
                           name=name, log_path=log_path, max_restarts=0).start()
    return sup, engine_url("127.0.0.1", port)


async def wait_engines(urls_and_sups, timeout: float = 180.0) -> None:
    """Until every ``(url, supervisor)`` engine is healthy; an engine that dies or stays down fails with its log."""
    async def one(url, sup):
        async with EngineControl(url) as ctl:
            try:
                await ctl.wait_healthy(timeout, alive=lambda: sup.alive)
            except EngineError as e:
                log = sup.log_path.read_text(errors="replace")[-3000:] if sup.log_path else ""
                raise AssertionError(f"{e}\n--- engine log ---\n{log}") from e
    await asyncio.gather(*(one(u, s) for u, s in urls_and_sups))
