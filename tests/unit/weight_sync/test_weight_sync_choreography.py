"""The sync choreography every mode shares (``WeightSender.begin``/``finish``), seen from the engine side:
call order, ``--pause-generation-mode``, ``--update-weight-buffer-size`` and ``--check-weight-update-equal``
reaching the engines and the trainer's bucket iteration. The engine is a recording control object (the
real HTTP client and engines are covered by tests/multiprocess/test_weight_sync.py); the transport is the
real disk-delta sender writing real versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config import parse_args
from miles.weight_sync import disk_delta as dd
from miles.weight_sync.base import EngineTarget, WeightSyncError, build_weight_sender


class _Source:
    """A trainer stand-in: fixed HF-named tensors, one per bucket; records the bucket size asked for."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.tensors = {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}
        self.bucket_bytes: list[int] = []

    def iter_weight_buckets(self, bucket_bytes, dtype=None):
        self.bucket_bytes.append(bucket_bytes)
        for name, t in self.tensors.items():
            yield [(name, t)]


class _Engine:
    """Records every control call in order; answers /get_weights_by_name from ``weights``."""

    def __init__(self, url: str, log: list[tuple[str, str, object]], weights: dict[str, torch.Tensor]) -> None:
        self.url, self.log, self.weights = url, log, weights

    def _rec(self, call: str, arg: object = None) -> dict:
        self.log.append((self.url, call, arg))
        return {"success": True}

    async def pause_generation(self, mode):
        return self._rec("pause", mode)

    async def begin_weight_update(self):
        return self._rec("begin")

    async def update_weights_from_disk(self, path, weight_version=None, flush_cache=True, timeout=None):
        return self._rec("load", (Path(path).name, weight_version))

    async def end_weight_update(self):
        return self._rec("end")

    async def update_weight_version(self, v):
        return self._rec("version", v)

    async def flush_cache(self):
        return self._rec("flush")

    async def continue_generation(self):
        return self._rec("continue")

    async def get_weights_by_name(self, name, truncate_size=100):
        return self.weights[name].tolist()

    async def close(self):
        pass


def _sender(tmp_path: Path, *flags: str):
    cfg = parse_args(["--hf-checkpoint", "x", "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir",
                      str(tmp_path / "v"), "--update-weight-buffer-size", "3KiB", "--update-weight-timeout", "20", *flags],
                     validate=False).weights
    src, log = _Source(), []
    engine_weights = {k: v.clone() for k, v in src.tensors.items()}
    engines = [EngineTarget("http://e0"), EngineTarget("http://e1")]
    sender = build_weight_sender(cfg, src, is_source=True, engines=engines,
                                 control_factory=lambda e, timeout: _Engine(e.url, log, engine_weights))
    return sender, src, log, engine_weights


@pytest.mark.parametrize("mode", ["retract", "abort", "in_place"])
def test_order_pause_mode_and_buffer_size_reach_the_engines(tmp_path: Path, mode: str) -> None:
    sender, src, log, _ = _sender(tmp_path, "--pause-generation-mode", mode)
    try:
        for version in (1, 2):
            log.clear()
            assert sender.sync().version == version
            for url in ("http://e0", "http://e1"):
                calls = [(c, a) for u, c, a in log if u == url]
                loaded = dd.version_dir_name(version, "full" if version == 1 else "delta")
                expected = [("pause", mode), ("begin", None), ("load", (loaded, str(version))), ("end", None)]
                # the load carried the version (SGLang's weight_version field): no /update_weight_version
                expected += [] if mode == "in_place" else [("flush", None)]
                assert calls == expected + [("continue", None)], calls
        assert src.bucket_bytes == [3 << 10, 3 << 10]            # --update-weight-buffer-size reached the trainer
    finally:
        sender.close()


def test_check_weight_update_equal_stops_the_sync_naming_the_tensor(tmp_path: Path) -> None:
    sender, _, log, engine_weights = _sender(tmp_path, "--check-weight-update-equal")
    try:
        sender.sync()                                              # engines equal the trainer: passes
        assert sender.weight_version == 1
        engine_weights["b.bias"][2] += 1.0                         # an engine that did not apply one element
        with pytest.raises(WeightSyncError, match=r"http://e0 tensor 'b.bias' differs.*1/5 elements"):
            sender.sync()
    finally:
        sender.close()


class _MtpSource(_Source):
    """A Megatron trainer with --mtp-num-layers 1 over 1 decoder layer: it also exports the MTP layer as
    model.layers.1.* (mtp_weight_prefixes)."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors = {"model.layers.0.mlp.weight": torch.randn(4, 3), "model.layers.1.eh_proj.weight": torch.randn(2, 4),
                        "model.layers.1.embed_tokens.weight": torch.randn(6, 2), "lm_head.weight": torch.randn(6, 2)}

    def mtp_weight_prefixes(self):
        return ("model.layers.1.",)


def test_check_weight_update_equal_skips_the_mtp_layers_saying_so_once(tmp_path: Path, caplog) -> None:
    """Engines serve the main model (SGLang without speculative decoding and the embedded engine do not load the MTP
    layer): the check compares the served tensors, skips the MTP layer's with one warning, and still fails on a
    served tensor that differs."""
    cfg = parse_args(["--hf-checkpoint", "x", "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir",
                      str(tmp_path / "v"), "--update-weight-timeout", "20", "--check-weight-update-equal"],
                     validate=False).weights
    src, log = _MtpSource(), []
    served = {k: v.clone() for k, v in src.tensors.items() if not k.startswith("model.layers.1.")}
    asked: list[str] = []

    class _MainModelEngine(_Engine):
        async def get_weights_by_name(self, name, truncate_size=100):
            asked.append(name)
            if name not in self.weights:   # the embedded engine's HTTP 400 'no parameter named ...'
                raise WeightSyncError(f"engine {self.url}: no parameter named {name!r}")
            return self.weights[name].tolist()

    sender = build_weight_sender(cfg, src, is_source=True, engines=[EngineTarget("http://e0")],
                                 control_factory=lambda e, timeout: _MainModelEngine(e.url, log, served))
    try:
        with caplog.at_level("WARNING", logger="miles"):
            sender.sync()
            sender.sync()
        assert sorted(set(asked)) == ["lm_head.weight", "model.layers.0.mlp.weight"], asked
        assert caplog.text.count("skipped the 2 exported tensors of the MTP layers (model.layers.1.*") == 1, caplog.text
        served["lm_head.weight"][0, 1] += 1.0                      # a served tensor that differs still fails
        with pytest.raises(WeightSyncError, match=r"tensor 'lm_head.weight' differs"):
            sender.sync()
    finally:
        sender.close()


class _RefusingEngine:
    """An engine whose /init_weights_update_group fails (refused, or unreachable: the request never lands)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def init_weights_update_group(self, *args, **kwargs):
        import asyncio

        from miles.fleet.client import EngineError

        await asyncio.sleep(0.2)
        raise EngineError(self.url, "/init_weights_update_group", None, "ClientConnectorError: connection refused")

    async def close(self):
        pass


def _member_main(addr, port, rank, world, name, answers, stop) -> None:
    """A weight-group member in its own process, with the embedded engine's group code."""
    import torch as _torch

    from miles.engine.weights import WeightGroups

    groups = WeightGroups(_torch.device("cpu"))
    try:
        groups.init_group(addr, port, rank, world, name, "gloo", 60)
    except Exception as e:  # noqa: BLE001 - reported to the test
        answers.put(f"error: {e}")
        return
    answers.put("joined")
    stop.wait(60)


class _JoiningEngine:
    """An engine that really joins the group (the embedded engine's group code, in a spawned process)."""

    def __init__(self, url: str) -> None:
        import multiprocessing as mp

        self.url, self.ctx = url, mp.get_context("spawn")
        self.answers: list[tuple[str, str]] = []
        self.procs: list = []

    async def init_weights_update_group(self, addr, port, rank_offset, world, name, backend, timeout=None):
        import asyncio

        from miles.fleet.client import EngineError

        q, stop = self.ctx.Queue(), self.ctx.Event()
        proc = self.ctx.Process(target=_member_main, args=(addr, port, rank_offset, world, name, q, stop), daemon=True)
        proc.start()
        self.procs.append((proc, stop))
        answer = await asyncio.to_thread(q.get, True, 90)
        self.answers.append((name, answer))
        if answer != "joined":
            raise EngineError(self.url, "/init_weights_update_group", 200, answer)
        return {"success": True}

    async def destroy_weights_update_group(self, name, timeout=None):
        return {"success": True}

    async def close(self):
        for proc, stop in self.procs:
            stop.set()
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def test_group_formation_fails_at_once_when_an_engine_cannot_join() -> None:
    """The trainer's side of the gloo group waits in the store for every member; an engine whose init call
    failed will never arrive, so the formation must fail naming it instead of waiting out the timeout, end
    the rendezvous for the member that did arrive, and leave nothing blocking the next formation."""
    import asyncio
    import threading
    import time

    cfg = parse_args(["--hf-checkpoint", "x", "--update-weight-transfer-mode", "broadcast",
                      "--update-weight-timeout", "120"], validate=False).weights
    engines = [EngineTarget("http://e0"), EngineTarget("http://e1")]
    live = _JoiningEngine("http://e1")
    sender = build_weight_sender(cfg, _Source(), is_source=True, engines=engines, master_addr="127.0.0.1",
                                 control_factory=lambda e, timeout: live if e.url == "http://e1" else _RefusingEngine(e.url))
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"cannot form: engine\(s\) did not join \(http://e0: EngineError") as err:
            sender.connect()
        assert time.monotonic() - t0 < 10, "waited for the group timeout instead of failing fast"
        assert "connection refused" in str(err.value) and "http://e1" in str(err.value)
        deadline = time.monotonic() + 10  # the trainer's helper and e1's join both ended with the rendezvous
        while any(t.name.startswith("miles-form-") for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.name.startswith("miles-form-") for t in threading.enumerate())
        while not live.answers and time.monotonic() < deadline + 20:  # e1's answer to the failed formation
            time.sleep(0.05)
        t1 = time.monotonic()  # the next formation, with the engine that is alive, is not held up
        sender.reconnect([engines[1]])
        assert time.monotonic() - t1 < 30
        first, second = live.answers
        assert first[1].startswith("error") and second == (sender.group_name, "joined"), live.answers
    finally:
        sender.close()
        asyncio.run(live.close())
