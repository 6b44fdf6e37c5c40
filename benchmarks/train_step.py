"""Trainer step throughput: the FSDP2 trainer on a Qwen3-0.6B-shaped model with random weights.

Each measured ``train()`` call is one optimizer step over ``--samples`` x ``--seq-len`` tokens
(GRPO policy loss, one step per rollout, so no extra forward pass; every sample packed into
micro-batches of ``--max-tokens-per-gpu``), split over the GPUs. Reports global tokens/s of the
step, achieved TFLOP/s per GPU by the 6·N·tokens count (docs/benchmarks.md, "Reference figures"), MFU against the GPU's
bf16 peak (metrics.PEAK_BF16_TFLOPS) and peak memory, as one JSON line on rank 0.

On one rank the same run then measures the plain side (``plain_*`` keys; ``--no-plain`` skips it): the
same model loaded by transformers, fp32 master weights, bf16 autocast, fused AdamW, the same samples as
one padded-free batch ``[samples, seq_len]`` with the next-token cross-entropy of the response tokens, so
the two sides share the precision recipe and the tokens; ``trainer_vs_plain`` is the ratio of tokens/s.

    torchrun --nproc-per-node 1 benchmarks/train_step.py            # 1 GPU, 8 x 2048 tokens, and the plain side
    torchrun --nproc-per-node 2 benchmarks/train_step.py            # 2 GPUs (4 samples each)
    python benchmarks/train_step.py --tiny                          # CPU smoke run of the script
"""

from __future__ import annotations

import argparse
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

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)


def build_model(out: Path, tiny: bool) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**(TINY if tiny else QWEN3_06B), torch_dtype="bfloat16")
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out))


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="Reuse (or create) the random model here.")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=64, help="Prompt tokens per sample (rest is the response).")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="Default: all of a rank's tokens at once.")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--tiny", action="store_true", help="Tiny model, 4 x 128 tokens (CPU smoke run).")
    p.add_argument("--json-out", default=None)
    p.add_argument("--no-plain", action="store_true", help="Skip the plain transformers + AdamW side (1 rank).")
    a = p.parse_args()
    if a.tiny:
        a.samples, a.seq_len, a.prompt_len = 4, 128, 16

    from miles.config import parse_args
    from miles.trainer.fsdp import FSDPTrainer
    from miles.types import Sample

    device, rank, world, group, mesh = init_bench_world(not a.tiny)

    model_dir = Path(a.model_dir or os.path.join(tempfile.gettempdir(), f"miles_bench_{'tiny' if a.tiny else 'qwen3_06b'}"))
    if rank == 0 and not (model_dir / "config.json").is_file():
        build_model(model_dir, a.tiny)
    dist.barrier(group)

    if a.samples % world:
        raise SystemExit(f"--samples {a.samples} must divide over {world} ranks")
    per_rank = a.samples // world
    max_tokens = a.max_tokens_per_gpu or per_rank * a.seq_len
    argv = ["--hf-checkpoint", str(model_dir), "--lr", "1e-6", "--num-rollout", "1000", "--rollout-batch-size", "1",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens), "--num-steps-per-rollout", "1"]
    if a.recompute:
        argv.append("--recompute-activations")
    cfg = parse_args(argv)
    trainer = FSDPTrainer(cfg.train, cfg.algo, cfg.checkpoint, mesh=mesh, group=group, device=device,
                          rollout_temperature=1.0, num_rollout=1000, global_batch_size=a.samples,
                          num_steps_per_rollout=1, timeout=600)
    gen = torch.Generator().manual_seed(1234 + rank)
    vocab = trainer.vocab_size
    samples = []
    for i in range(per_rank):
        tokens = torch.randint(0, vocab, (a.seq_len,), generator=gen).tolist()
        samples.append(Sample(group_index=rank * per_rank + i // 4, index=i, tokens=tokens,
                              response_length=a.seq_len - a.prompt_len, reward=float(i % 2)))
    runs = []
    for it in range(a.warmup + a.steps):
        m = trainer.train(samples, it)
        if it >= a.warmup:
            runs.append(m)
    tps = statistics.mean(m["tokens_per_s"] for m in runs)
    step = statistics.mean(m["step_time"] for m in runs)
    result = {
        "model": "tiny" if a.tiny else "qwen3-0.6b-shaped", "params": trainer.num_params, "gpus": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "attention": trainer.model.lm.config._attn_implementation, "tokens_per_step": a.samples * a.seq_len,
        "step_time_s": round(step, 4), "tokens_per_s": round(tps, 1),
        "tflops_per_gpu_6N": round(6 * trainer.num_params * tps / world / 1e12, 1),
        "mfu": round(statistics.mean(m.get("mfu", 0.0) for m in runs), 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if device.type == "cuda" else None,
        "recompute": a.recompute, "loss_last": runs[-1]["loss"],
        "phases_s": {k[len("phase/"):]: round(statistics.mean(m[k] for m in runs), 4) for k in runs[-1]
                     if k.startswith("phase/")},
    }
    if world == 1 and not a.no_plain:
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        plain = plain_step_tokens_per_s(model_dir, samples, a.prompt_len, device, a.warmup, a.steps, a.recompute)
        result["plain_tokens_per_s"] = round(plain, 1)
        result["plain_peak_mem_gib"] = (round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
                                        if device.type == "cuda" else None)
        result["trainer_vs_plain"] = round(tps / plain, 3)
    if rank == 0:
        print(json.dumps(result), flush=True)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(result))
    dist.barrier(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
