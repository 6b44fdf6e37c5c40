"""Trainer step throughput on one model with random weights: the FSDP2 trainer, the Megatron trainer and
a plain transformers + AdamW step, each measured in the same run (``--backends``).

Each measured ``train()`` call is one optimizer step over ``--samples`` x ``--seq-len`` tokens (GRPO policy
loss, one step per rollout, so no extra forward pass; every sample packed into micro-batches of
``--max-tokens-per-gpu``), split over the GPUs. Per trainer side (``fsdp_*`` / ``megatron_*`` keys): global
tokens/s of the step, achieved TFLOP/s per GPU by the 6·N·tokens count (docs/benchmarks.md, "Reference
figures"), MFU against ``--peak-tflops`` (default: the GPU's bf16 peak, metrics.PEAK_BF16_TFLOPS), peak
memory and the phases of a step; one JSON line on rank 0.

Both trainers run their GPU default precision: fp32 master weights updated by fused AdamW, bf16 parameters
and activations in the forward and backward, fp32 gradients (FSDP2 ``MixedPrecisionPolicy``; Megatron
``optim.MasterWeights``). The Megatron side is ``MegatronTrainer`` (megatron-core GPTModel, TP 1 on one
rank, ``--tensor-model-parallel-size`` otherwise). On one rank the plain side (``plain_*`` keys) loads the
same model with transformers, fp32 master weights, bf16 autocast, fused AdamW, the same samples as one
batch ``[samples, seq_len]`` with the next-token cross-entropy of the response tokens; ``*_vs_plain`` are
ratios of tokens/s.

    torchrun --nproc-per-node 1 benchmarks/train_step.py            # 1 GPU, Qwen3-1.7B shape, 8 x 2048 tokens, all sides
    torchrun --nproc-per-node 1 benchmarks/train_step.py --preset qwen3-0.6b --backends fsdp,plain
    torchrun --nproc-per-node 2 benchmarks/train_step.py --backends fsdp   # 2 GPUs (4 samples each)
    python benchmarks/train_step.py --tiny                          # CPU smoke run of the script (fp32)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from _world import init_bench_world  # benchmarks/_world.py (the script's folder is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_QWEN3 = dict(vocab_size=151936, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
              max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
PRESETS = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True),
}
BACKENDS = ("fsdp", "megatron", "plain")


def build_model(out: Path, preset: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**PRESETS[preset], torch_dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() and preset != "tiny" else "cpu"):   # fast random init
        model = Qwen3ForCausalLM(config)
    model.to("cpu", torch.bfloat16).save_pretrained(str(out))


def plain_step_tokens_per_s(model_dir: Path, samples: list, prompt_len: int, device: torch.device, warmup: int,
                            steps: int, recompute: bool) -> float:
    """Tokens/s of a plain transformers + fused AdamW step on ``samples`` (see the module docstring)."""
    import time

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    model.config.use_cache = False
    if recompute:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    ids = torch.tensor([s.tokens for s in samples], device=device)
    labels = ids.clone()
    labels[:, :prompt_len] = -100                                 # the loss on response tokens, as the trainer's
    times = []
    for it in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if it >= warmup:
            times.append(time.perf_counter() - t0)
    del model, opt
    return ids.numel() / statistics.mean(times)


def trainer_side(backend: str, a, model_dir: Path, samples: list, device: torch.device, mesh, group,
                 world: int) -> dict:
    """Build one trainer, run ``--warmup`` + ``--steps`` train() calls; its figures under ``<backend>_`` keys."""
    from miles.config import parse_args

    per_rank = len(samples)
    max_tokens = a.max_tokens_per_gpu or per_rank * a.seq_len
    argv = ["--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--lr", "1e-6", "--num-rollout", "1000", "--rollout-batch-size", "1",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens), "--num-steps-per-rollout", "1",
            "--train-backend", backend]
    if a.peak_tflops:
        argv += ["--mfu-peak-tflops", str(a.peak_tflops)]
    if a.recompute:
        argv.append("--recompute-activations")
    if backend == "megatron":
        argv += ["--tensor-model-parallel-size", str(a.tp)]
    cfg = parse_args(argv)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    from miles.trainer.build import build_trainer

    trainer = build_trainer(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=group, mesh=mesh, device=device,
                            rollout_temperature=1.0, num_rollout=1000, global_batch_size=a.samples,
                            num_steps_per_rollout=1, timeout=600)
    if backend == "fsdp":
        attention = trainer.model.lm.config._attn_implementation
    else:
        attention = "sdpa (SDPACoreAttention)"
    runs = []
    for it in range(a.warmup + a.steps):
        m = trainer.train(samples, it)
        if it >= a.warmup:
            runs.append(m)
    kernels = None
    if a.profile_dir and device.type == "cuda":
        kernels = profile_step(trainer, samples, Path(a.profile_dir) / f"{backend}_profile.txt")
    tps = statistics.mean(m["tokens_per_s"] for m in runs)
    num_params = trainer.num_params
    out = {
        "params": num_params, "attention": attention, "step_time_s": round(statistics.mean(m["step_time"] for m in runs), 4),
        "tokens_per_s": round(tps, 1), "tflops_per_gpu_6N": round(6 * num_params * tps / world / 1e12, 1),
        "mfu": round(statistics.mean(m.get("mfu", 0.0) for m in runs), 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if device.type == "cuda" else None,
        "loss_last": runs[-1]["loss"], "grad_norm_last": runs[-1]["grad_norm"],
        "phases_s": {k[len("phase/"):]: round(statistics.mean(m[k] for m in runs), 4) for k in runs[-1]
                     if k.startswith("phase/")},
    }
    if kernels is not None:
        out["attention_kernels"] = kernels
    del trainer, runs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {f"{backend}_{k}": v for k, v in out.items()}


def profile_step(trainer, samples: list, path: Path) -> list[str]:
    """One more train() under torch.profiler: the kernels by GPU time into ``path``; the attention kernels' names."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.train(samples, 10_000)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    words = ("flash", "fmha", "attn", "attention", "sdpa", "cudnn")
    return sorted({e.key[:80] for e in prof.key_averages() if any(w in e.key.lower() for w in words)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="Reuse (or create) the random model here.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-1.7b")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="Comma-separated sides to measure, in order: fsdp, megatron, plain (plain on 1 rank only).")
    p.add_argument("--tp", type=int, default=1, help="Megatron side: --tensor-model-parallel-size.")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=64, help="Prompt tokens per sample (rest is the response).")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="Default: all of a rank's tokens at once.")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator (default: the GPU's bf16 peak).")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--tiny", action="store_true", help="Tiny model, 4 x 128 tokens (CPU smoke run).")
    p.add_argument("--json-out", default=None)
    p.add_argument("--profile-dir", default=None,
                   help="GPU: one more profiled step per trainer side; kernel tables written here.")
    a = p.parse_args()
    if a.tiny:
        a.preset, a.samples, a.seq_len, a.prompt_len = "tiny", 4, 128, 16
    backends = [b for b in a.backends.split(",") if b]
    if not backends or any(b not in BACKENDS for b in backends):
        raise SystemExit(f"--backends {a.backends}: choose from {','.join(BACKENDS)}")

    from miles.types import Sample

    device, rank, world, group, mesh = init_bench_world(not a.tiny)
    model_dir = Path(a.model_dir or os.path.join(tempfile.gettempdir(), f"miles_bench_{a.preset.replace('.', '_')}"))
    if rank == 0 and not (model_dir / "config.json").is_file():
        build_model(model_dir, a.preset)
    dist.barrier(group)

    if a.samples % world:
        raise SystemExit(f"--samples {a.samples} must divide over {world} ranks")
    per_rank = a.samples // world
    gen = torch.Generator().manual_seed(1234 + rank)
    vocab = PRESETS[a.preset]["vocab_size"]
    samples = []
    for i in range(per_rank):
        tokens = torch.randint(0, vocab, (a.seq_len,), generator=gen).tolist()
        samples.append(Sample(group_index=rank * per_rank + i // 4, index=i, tokens=tokens,
                              response_length=a.seq_len - a.prompt_len, reward=float(i % 2)))
    result = {
        "model": f"{a.preset}-shaped", "gpus": world, "tokens_per_step": a.samples * a.seq_len,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "recompute": a.recompute,
    }
    for backend in backends:
        if backend == "plain":
            if world > 1:
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            plain = plain_step_tokens_per_s(model_dir, samples, a.prompt_len, device, a.warmup, a.steps, a.recompute)
            result["plain_tokens_per_s"] = round(plain, 1)
            result["plain_peak_mem_gib"] = (round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
                                            if device.type == "cuda" else None)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            result.update(trainer_side(backend, a, model_dir, samples, device, mesh, group, world))
        if rank == 0:
            print(json.dumps({k: v for k, v in result.items() if k.startswith(backend)}), file=sys.stderr, flush=True)
    for backend in ("fsdp", "megatron"):
        if f"{backend}_tokens_per_s" in result and "plain_tokens_per_s" in result:
            result[f"{backend}_vs_plain"] = round(result[f"{backend}_tokens_per_s"] / result["plain_tokens_per_s"], 3)
    if rank == 0:
        print(json.dumps(result), flush=True)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(result))
    dist.barrier(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
