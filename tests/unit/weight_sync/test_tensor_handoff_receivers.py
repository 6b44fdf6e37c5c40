"""Same-device hand-off (``--update-weight-transfer-mode tensor``) on CPU to several engines at once.

Colocated TP 2 x CP 2 lays four engines over four trainer ranks, and the source rank posts every bucket to
all of them. Each engine here is a real separate process decoding with the embedded engine's own
``deserialize_named_tensors``, one after the other, while the sender still holds the buffer: a payload that
carries one shared-memory reference but is decoded by several receivers unlinks the file under the third.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.config import parse_args
from miles.weight_sync.base import EngineTarget, build_weight_sender

_DECODER = r"""
import hashlib, sys
import torch
from miles.engine.weights import deserialize_named_tensors, release_handles

def load(entry):  # copy out, then let go of every view (as the engine does before answering)
    h = hashlib.sha256()
    for n, t in deserialize_named_tensors(entry, "flattened_bucket"):
        h.update(n.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

for line in sys.stdin:
    entries = line.split()
    try:
        out = "OK " + load(entries[0])
    except Exception as e:
        out = "ERR " + str(e).replace("\n", " ")
    release_handles(entries[1:], "flattened_bucket")
    print(out, flush=True)
"""


def _digest(bucket: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for n, t in bucket:
        h.update(n.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _DecodingEngine:
    """The HTTP control of one engine, answered by a real decoder process (the engine's code path)."""

    def __init__(self, proc: subprocess.Popen, log: list) -> None:
        self.proc, self.log = proc, log

    async def update_weights_from_tensor(self, serialized, **kw):
        # blocking on purpose: the engines answer one after the other, the order that broke
        self.proc.stdin.write(" ".join(serialized) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        self.log.append((self, answer))
        if not answer.startswith("OK "):
            raise RuntimeError(f"HTTP 400 {answer}")
        return {"success": True}

    async def get_server_info(self):
        return {"engine": "sglang"}  # the full choreography, as with SGLang

    async def _ok(self, *a, **kw):
        return {"success": True}

    pause_generation = begin_weight_update = end_weight_update = update_weight_version = _ok
    flush_cache = continue_generation = _ok

    async def close(self):
        pass


class _Source:
    def __init__(self, buckets) -> None:
        self.buckets = buckets

    def iter_weight_buckets(self, bucket_bytes, dtype):
        yield from self.buckets


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_every_one_of_four_engines_decodes_every_bucket_of_two_syncs(device: str) -> None:
    """CPU: shared-memory files; GPU: CUDA IPC handles (every decoder process opens the sender's memory)."""
    shm = set(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))  # other tests of this process may hold some
    g = torch.Generator().manual_seed(0)
    buckets = [[("a.weight", torch.randn(8, 4, generator=g)), ("a.bias", torch.randn(8, generator=g).to(torch.bfloat16))],
               [("b.weight", torch.randn(3, 5, generator=g).double()), ("b.idx", torch.arange(6))]]
    root = str(Path(__file__).resolve().parents[3])
    procs = [subprocess.Popen([sys.executable, "-c", _DECODER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
             for _ in range(4)]
    log: list = []
    # the last engine has two TP workers: one payload each; the embedded engine loads one and releases the other
    engines = [EngineTarget(f"http://e{i}", engine_id=i, num_workers=2 if i == 3 else 1) for i in range(4)]
    controls = {e.url: _DecodingEngine(p, log) for e, p in zip(engines, procs)}
    cfg = parse_args(["--hf-checkpoint", "x", "--update-weight-timeout", "120"], validate=False).weights
    sender = build_weight_sender(cfg, _Source(buckets), colocate=True, is_source=True, engines=engines, device=device,
                                 control_factory=lambda e, timeout: controls[e.url])
    try:
        for version in (1, 2):
            log.clear()
            result = sender.sync()
            assert (result.num_buckets, sender.weight_version) == (2, version)
            want = [_digest(b) for b in buckets]
            got = {}
            for ctl, answer in log:
                got.setdefault(id(ctl), []).append(answer)
            assert sorted(got) == sorted(id(c) for c in controls.values())
            for answers in got.values():
                assert answers == [f"OK {w}" for w in want], answers
        gc.collect()
        # every reference was given back: no shared-memory file of this sender is left behind
        assert device == "cuda" or not set(Path("/dev/shm").glob(f"torch_{os.getpid()}_*")) - shm
    finally:
        sender.close()
        for p in procs:
            p.stdin.close()
            p.wait(30)
