"""Helpers for tests and benchmarks of the embedded engine: a tiny peaked model, a server child process.

    model = build_engine_model(tmp / "m")            # tiny Qwen3, large init: varied greedy tokens
    eng = EngineProc(model, "--max-running-requests", "4")
    eng.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}})
    eng.stop()                                        # kills only this child
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch

from miles.utils.net import find_free_port


def serialized_ipc(obj: object) -> str:
    """One ``serialized_named_tensors`` entry of ``/update_weights_from_tensor``, as SGLang's clients make it:
    ``base64(ForkingPickler(obj))``, tensors passed by handle (shared memory on CPU, CUDA IPC on GPU)."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def build_engine_model(out: Path, seed: int = 0, std: float = 0.25, **kw) -> Path:
    """A tiny Qwen3 model whose matrices have a large init, so greedy tokens are varied and argmax gaps wide."""
    from transformers import AutoModelForCausalLM

    from miles.utils.tiny_model import build_tiny_model

    d = build_tiny_model(out, hidden_size=kw.pop("hidden_size", 64), num_layers=kw.pop("num_layers", 2), seed=seed, **kw)
    model = AutoModelForCausalLM.from_pretrained(d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(d))
    return d


def build_engine_vlm(out: Path, seed: int = 0, std: float = 0.25) -> Path:
    """A tiny Qwen3-VL (``miles.utils.tiny_vlm``, its own ``lm_head``) with a large init of its text matrices (varied
    greedy tokens) and of its vision tower (images change the logits clearly)."""
    from transformers import Qwen3VLForConditionalGeneration

    from miles.utils.tiny_vlm import build_tiny_vlm

    d = build_tiny_vlm(out, seed=seed, tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration.from_pretrained(d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (std if ".visual." not in f".{name}" else 0.1))
    model.save_pretrained(str(d))
    return d


def image_data_url(seed: int, size: tuple[int, int] = (64, 64)) -> str:
    """A random RGB PNG as SGLang's ``image_data`` entry (``data:image/png;base64,...``)."""
    import base64
    import io

    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class EngineProc:
    """``python -m miles.engine`` as a child process; ``stop`` kills only this process."""

    def __init__(self, model: Path, *args: str, api_key: str | None = None, log: Path | None = None, timeout: float = 90.0):
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        argv = [sys.executable, "-m", "miles.engine", "--hf-checkpoint", str(model), "--port", str(self.port), *args]
        if api_key:
            argv += ["--api-key", api_key]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
        env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        self.log = log
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}; log: {log.read_text()[-3000:] if log else ''}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"engine at {self.url} not healthy after {timeout}s")
            time.sleep(0.2)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body=None, timeout: float = 60.0, **kw) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=self.headers, timeout=timeout, **kw)

    def get(self, path: str, timeout: float = 30.0, **kw) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers, timeout=timeout, **kw)

    def generate(self, body: dict, timeout: float = 60.0):
        r = self.post("/generate", body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
