"""Embedded engine vs HF ``generate``: decode throughput (tokens/s) on the same model and machine.

    python benchmarks/engine_throughput.py --preset tiny --batch 16                       # CPU
    python benchmarks/engine_throughput.py --preset qwen3-0.6b --device cuda --dtype bfloat16 \\
        --batch 64 --prompt-len 256 --new-tokens 512                                      # one H200

Both sides decode greedily with EOS ignored (``ignore_eos`` / ``min_new_tokens``), so every sequence
produces exactly ``--new-tokens`` tokens; tokens/s = batch x new tokens / wall time, prefill included.
The engine is measured through its generation core (``ModelRunner`` + ``Scheduler``, what the HTTP
server drives) and, with ``--http``, end to end through ``python -m miles.engine`` + ``/generate``.
Models are random-weight models built locally from a config (no downloads). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=192, vocab_size=104),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936),
}


def build_model(preset: str, dtype: str, out: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**PRESETS[preset], max_position_embeddings=40960, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=1, pad_token_id=0, dtype=dtype)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    if preset == "tiny":
        from miles.utils.tiny_model import build_tokenizer

        build_tokenizer(out)
    return out


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def bench_hf(model_dir: Path, device: str, dtype: str, ids: list[list[int]], new: int, repeat: int = 1) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    x = torch.tensor(ids, device=device)
    mask = torch.ones_like(x)

    def run(n):
        with torch.no_grad():
            return model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)

    run(4)  # warm-up
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = run(new)
        sync(device)
        best = min(best, time.perf_counter() - t0)
        assert out.shape[1] == x.shape[1] + new
    model.to("cpu")  # free the device for the next measurement
    return len(ids) * new / best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_engine_core(model_dir: Path, device: str, dtype: str, ids: list[list[int]], new: int, cuda_graph: bool,
                      repeat: int = 1, profile: bool = False) -> float:
    from miles.engine.engine import Engine, EngineArgs
    from miles.engine.protocol import GenerateReqInput

    eng = Engine(EngineArgs(hf_checkpoint=str(model_dir), device=device, dtype=dtype, max_running_requests=len(ids),
                            max_context_len=len(ids[0]) + new + 1, max_prefill_tokens=max(16384, len(ids) * len(ids[0])),
                            cuda_graph=cuda_graph))
    eng.start()

    async def run(n: int) -> float:
        body = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        specs, _ = eng.prepare(body)
        t0 = time.perf_counter()
        out = await eng.wait_final(eng.submit(specs, stream=False))
        dt = time.perf_counter() - t0
        assert all(o["meta_info"]["completion_tokens"] == n for o in out)
        return dt

    async def main() -> float:
        await run(new)  # warm-up (captures CUDA graphs for the batch sizes and context lengths of this run)
        return min([await run(new) for _ in range(repeat)])

    try:
        dt = asyncio.run(main())
    finally:
        eng.stop()
    if profile:
        profile_decode(eng, len(ids), dt / new)
    return len(ids) * new / dt


def profile_decode(eng, batch: int, step_s: float) -> None:
    """Where a decode step's time goes: the forward (graph replay) per context bucket, then sampling."""
    from miles.engine.sampling import RowParams, SamplingBatch, sample

    r = eng.runner
    dev = r.device
    toks = torch.zeros(batch, dtype=torch.long, device=dev)
    out = {"end_to_end_ms_per_step": round(step_s * 1e3, 3)}
    logits = None
    for L in getattr(r.impl, "ctx_buckets", [r.max_ctx]):
        pos = torch.full((batch,), min(L, r.max_ctx) - 1, dtype=torch.long, device=dev)
        for _ in range(3):
            logits = r.decode(toks, pos, min(L, r.max_ctx))
        sync(str(dev))
        t0 = time.perf_counter()
        for _ in range(20):
            logits = r.decode(toks, pos, min(L, r.max_ctx))
        sync(str(dev))
        out[f"forward_ms_ctx{L}"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    sb = SamplingBatch([RowParams(1.0, 1.0, 1, 0.0, i) for i in range(batch)], logits.shape[-1], dev)
    t0 = time.perf_counter()
    for _ in range(20):
        sample(logits, sb, None).tokens.tolist()
    out["greedy_sample_ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    sb = SamplingBatch([RowParams(1.0, 0.9, 50, 0.0, i) for i in range(batch)], logits.shape[-1], dev)
    steps = torch.zeros(batch, dtype=torch.long, device=dev)
    t0 = time.perf_counter()
    for _ in range(20):
        sample(logits, sb, steps, want_logprobs=True).tokens.tolist()
    out["topk_topp_sample_with_logprobs_ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    print(json.dumps({"profile": out}), flush=True)
    if dev.type == "cuda":  # the kernels of eager decode steps (graphs off), by CUDA time
        from torch.profiler import ProfilerActivity, profile

        graphs, r.impl.use_graphs = r.impl.use_graphs, False
        pos = torch.full((batch,), 255, dtype=torch.long, device=dev)
        r.decode(toks, pos, 256)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                r.decode(toks, pos, 256)
            sync(str(dev))
        r.impl.use_graphs = graphs
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)


def bench_engine_http(model_dir: Path, device: str, dtype: str, ids: list[list[int]], new: int, repeat: int = 1) -> float:
    import requests

    from miles.engine.testing import EngineProc

    eng = EngineProc(model_dir, "--device", device, "--dtype", dtype, "--max-running-requests", str(len(ids)),
                     "--max-context-len", str(len(ids[0]) + new + 1), timeout=600)
    try:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
        requests.post(eng.url + "/generate", json=body, timeout=3600).raise_for_status()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            r = requests.post(eng.url + "/generate", json=body, timeout=3600)
            best = min(best, time.perf_counter() - t0)
            r.raise_for_status()
            assert all(o["meta_info"]["completion_tokens"] == new for o in r.json())
    finally:
        eng.stop()
    return len(ids) * new / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--model", default=None, help="An existing HF model dir instead of building --preset.")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--http", action="store_true", help="Also measure through the HTTP server.")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--profile", action="store_true", help="Also break one decode step down (forward per context bucket, sampling).")
    ap.add_argument("--repeat", type=int, default=1, help="Timed runs per side; the best counts (shared machines are noisy).")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_model(args.preset, args.dtype, Path(tmp) / "model")
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        ids = prompts(args.batch, args.prompt_len, vocab)
        res = {"preset": args.model or args.preset, "device": args.device, "dtype": args.dtype, "batch": args.batch,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch": torch.__version__,
               "machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine(),
               "threads": torch.get_num_threads()}
        res["engine_tokens_per_s"] = round(bench_engine_core(model_dir, args.device, args.dtype, ids, args.new_tokens,
                                                             not args.disable_cuda_graph, args.repeat, args.profile), 1)
        print(json.dumps(res), flush=True)
        if args.http:
            res["engine_http_tokens_per_s"] = round(bench_engine_http(model_dir, args.device, args.dtype, ids, args.new_tokens,
                                                                       args.repeat), 1)
        if not args.skip_hf:
            res["hf_generate_tokens_per_s"] = round(bench_hf(model_dir, args.device, args.dtype, ids, args.new_tokens,
                                                             args.repeat), 1)
            res["speedup"] = round(res["engine_tokens_per_s"] / res["hf_generate_tokens_per_s"], 2)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
