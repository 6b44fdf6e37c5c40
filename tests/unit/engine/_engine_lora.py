"""Helpers of the embedded engine's LoRA tests (``test_engine_lora.py``, ``test_lora_experts.py``): an in-process
engine, one greedy generate call, the adapter payload as a colocated trainer sends it, and the merged checkpoints'
reference outputs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from miles.engine import protocol as P
from miles.engine.engine import Engine, EngineArgs
from miles.engine.testing import serialized_ipc as _serialized_ipc

PROMPTS = [[3, 17, 9, 41], [5, 6, 7], [60, 2, 33, 8, 11], [3, 17, 9, 41]]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def engine(model: Path, **kw) -> Engine:
    """A started engine on ``model`` (64 tokens of context, 4 running requests, seed 0); ``kw``: other EngineArgs."""
    eng = Engine(EngineArgs(**{"hf_checkpoint": str(model), "max_context_len": 64, "max_running_requests": 4,
                               "random_seed": 0, **kw}))
    eng.start()
    return eng


def gen(eng: Engine, body: dict) -> list[dict]:
    """The final outputs of one /generate body (2 minutes at most)."""
    async def go():
        specs, _ = eng.prepare(P.GenerateReqInput(**body))
        return await asyncio.wait_for(eng.wait_final(eng.submit(specs, stream=False)), 120)
    return asyncio.run(go())


def body(prompts, lora=None) -> dict:
    """6 greedy tokens (EOS ignored) with the prompt's and the output's log-probs; ``lora``: the ``lora_path``."""
    out = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
           "return_logprob": True, "logprob_start_len": 0}
    if lora is not None:
        out["lora_path"] = lora
    return out


def serialized_ipc(tensors: dict[str, torch.Tensor]) -> str:
    """The payload as a colocated trainer sends it (CPU: shared-memory files, the sender's sharing strategy)."""
    import torch.multiprocessing as mp

    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        return _serialized_ipc({k: v.clone() for k, v in tensors.items()})
    finally:
        mp.set_sharing_strategy(old)


def load_from_tensors(eng: Engine, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """``/load_lora_adapter_from_tensors`` with the adapter as one serialized ``{name: tensor}``."""
    return asyncio.run(eng.load_lora_adapter_from_tensors(P.LoadLoRAAdapterFromTensorsReqInput(
        lora_name=name, config_dict=config, serialized_tensors=serialized_ipc(tensors))))


def copy_tokenizer(model_dir: Path, out: Path) -> None:
    """The checkpoint's tokenizer files (those it has) into ``out`` (a merged checkpoint saved by transformers)."""
    for f in TOKENIZER_FILES:
        if (model_dir / f).exists():
            (out / f).write_bytes((model_dir / f).read_bytes())


def reference_outputs(models: dict[str, Path], **kw) -> dict[str, list[dict]]:
    """Key -> the outputs of ``body(PROMPTS)`` on an engine (no LoRA) serving that checkpoint, one engine at a time."""
    refs = {}
    for key, model in models.items():
        eng = engine(model, **kw)
        try:
            refs[key] = gen(eng, body(PROMPTS))
        finally:
            eng.stop()
    return refs
