"""Trainer step throughput on one model with random weights: the FSDP2 trainer, the Megatron trainer and
a plain transformers + AdamW step (``--backends``), each side in its own process.

Each measured ``train()`` call is one optimizer step over ``--samples`` x ``--seq-len`` tokens (GRPO policy
loss, one step per rollout, so no extra forward pass; every sample packed into micro-batches of
``--max-tokens-per-gpu``), split over the GPUs. Per trainer side (``fsdp_*`` / ``megatron_*`` keys): global
tokens/s of the step, achieved TFLOP/s per GPU by the 6·N·tokens count (docs/benchmarks.md, "Reference
figures"), MFU against ``--peak-tflops`` (default: the GPU's bf16 peak, metrics.PEAK_BF16_TFLOPS), peak
memory and the phases of a step.

The parent process touches no GPU: it starts one child per side, one after the other (``torchrun --standalone
--nproc-per-node N`` for N GPUs, a plain ``python`` for one), so no side runs in memory another side left
behind; each child prints its side's row (one JSON line); on a GPU one more child first measures the anchor
(device-to-device copy bandwidth, a bf16 matmul: how fast this machine was in this call). The parent prints
the sides as a table side by side, then one JSON line with every side's keys (``*_vs_plain``: ratios of
tokens/s), and writes that to ``--json-out``.

Both trainers run their GPU default precision: fp32 master weights updated by fused AdamW, bf16 parameters
and activations in the forward and backward, fp32 gradients (FSDP2 ``MixedPrecisionPolicy``; Megatron
``optim.MasterWeights``). The Megatron side is ``MegatronTrainer`` (megatron-core GPTModel, TP 1 on one
rank, ``--tensor-model-parallel-size`` otherwise). On one GPU the plain side (``plain_*`` keys) loads the
same model with transformers, fp32 master weights, bf16 autocast, fused AdamW, the same samples as one
batch ``[samples, seq_len]`` with the next-token cross-entropy of the response tokens.

    python benchmarks/train_step.py                  # 1 GPU, Qwen3-1.7B shape, 8 x 2048 tokens, all sides
    python benchmarks/train_step.py --preset qwen3-0.6b --backends fsdp,plain
    python benchmarks/train_step.py --nproc-per-node 2 --backends fsdp   # 2 GPUs (4 samples each)
    python benchmarks/train_step.py --tiny           # CPU smoke run of the script (fp32)

(``torchrun --nproc-per-node N benchmarks/train_step.py ...`` works too: its rank 0 becomes the parent, with
N GPUs for the children, and the other ranks exit.)
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
                            steps: int, recompute: bool) -> tuple[float, int]:
    """Tokens/s of a plain transformers + fused AdamW step on ``samples`` (see the module docstring), and the
    model's parameter count."""
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
    num_params = sum(p.numel() for p in model.parameters())
    del model, opt
    return ids.numel() / statistics.mean(times), num_params


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
    """One more train() under torch.profiler (CPU and CUDA): into ``path`` the kernels by GPU time, the host ops by
    their own CPU time, and the step's wall time against the GPU's busy time and the host syncs (``.item()`` and
    kin: ``aten::_local_scalar_dense``, stream / device synchronizes) that keep the host from running ahead; returns
    the attention kernels' names."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        trainer.train(samples, 10_000)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    kernels = averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
    host = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90)
    busy_us = sum(e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: e.count for e in averages
             if e.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                          "cudaEventSynchronize", "aten::nonzero", "aten::unique", "aten::_unique2")}
    head = (f"step wall under the profiler {wall * 1e3:.1f} ms, GPU busy (sum of kernel time) {busy_us / 1e3:.1f} ms, "
            f"host syncs by name: {syncs}\n\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + "KERNELS (by GPU time)\n" + kernels + "\nHOST OPS (by own CPU time)\n" + host)
    words = ("flash", "fmha", "attn", "attention", "sdpa", "cudnn")
    return sorted({e.key[:80] for e in averages if any(w in e.key.lower() for w in words)})


SIDE_KEYS = (("step_time_s", "step time (s)"), ("tokens_per_s", "tokens/s"), ("tflops_per_gpu_6N", "TFLOP/s per GPU (6N)"),
             ("mfu", "MFU"), ("peak_mem_gib", "peak memory (GiB)"), ("vs_plain", "tokens/s vs plain"),
             ("error", "error"))


def run_side(a, model_dir: Path, side: str) -> dict:
    """This process measures one side (``--side``), under torchrun or as a one-rank world by itself; rank 0 prints
    ``{"side": side, <side>_* keys}`` as its last stdout line."""
    from miles.types import Sample

    if side == "anchor":
        from _anchor import anchor

        print(json.dumps({"side": "anchor", "anchor": anchor("cuda") if torch.cuda.is_available() else {}}), flush=True)
        return {}
    device, rank, world, group, mesh = init_bench_world(not a.tiny)
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
    if side == "plain":
        from miles.trainer.metrics import peak_tflops

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        plain, num_params = plain_step_tokens_per_s(model_dir, samples, a.prompt_len, device, a.warmup, a.steps,
                                                    a.recompute)
        peak = peak_tflops(device, a.peak_tflops)
        row = {"plain_params": num_params, "plain_step_time_s": round(len(samples) * a.seq_len / plain, 4),
               "plain_tokens_per_s": round(plain, 1),
               "plain_tflops_per_gpu_6N": round(6 * num_params * plain / 1e12, 1),
               "plain_mfu": round(6 * num_params * plain / 1e12 / peak, 4) if peak else 0.0,
               "plain_peak_mem_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
                                      if device.type == "cuda" else None)}
    else:
        row = trainer_side(side, a, model_dir, samples, device, mesh, group, world)
    row.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", gpus=world)
    if rank == 0:
        print(json.dumps({"side": side, **row}), flush=True)
    dist.barrier(group)
    dist.destroy_process_group()
    return row


_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_child(argv: list[str], nproc: int, side: str, timeout: float) -> dict:
    """One side in its own process (group): its stdout echoed, its last JSON line returned; on a non-zero exit or
    after ``timeout`` seconds (the whole process group killed) ``{"<side>_error": why}``."""
    import signal
    import subprocess

    script = str(Path(__file__).resolve())
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script]
    else:
        cmd = [sys.executable, script]
    cmd += [*argv, "--side", side]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    print(f"[train_step] side {side}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {f"{side}_error": f"timed out after {timeout:g} s (--side-timeout)"}
    finally:
        if proc.poll() is None:             # the parent is dying (Ctrl-C, SIGTERM): its children die with it
            os.killpg(proc.pid, signal.SIGKILL)
    sys.stderr.write(out)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"side"' in line]
    if proc.returncode != 0 or not rows:
        return {f"{side}_error": f"exit code {proc.returncode}" + ("" if rows else ", no result line")}
    row = rows[-1]
    row.pop("side")
    return row


def side_table(result: dict, sides: list[str]) -> str:
    """The sides as columns, the figures as rows (markdown)."""
    lines = ["| | " + " | ".join(sides) + " |", "|---" * (len(sides) + 1) + "|"]
    for key, label in SIDE_KEYS:
        cells = [result.get(f"{s}_{key}") for s in sides]
        if all(c is None for c in cells):
            continue
        if key == "mfu":
            cells = [None if c is None else f"{100 * c:.1f}%" for c in cells]
        lines.append(f"| {label} | " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="Reuse (or create) the random model here.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-1.7b")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="Comma-separated sides to measure, in order: fsdp, megatron, plain (plain on 1 GPU only).")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="GPUs per side (default: torchrun's WORLD_SIZE, else 1).")
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
    p.add_argument("--side-timeout", type=float, default=900.0, help="Seconds a side's process may run.")
    p.add_argument("--side", choices=(*BACKENDS, "anchor"), default=None, help=argparse.SUPPRESS)   # a child's side
    argv = sys.argv[1:]
    a = p.parse_args(argv)
    if a.tiny:
        a.preset, a.samples, a.seq_len, a.prompt_len = "tiny", 4, 128, 16
    model_dir = Path(a.model_dir or os.path.join(tempfile.gettempdir(), f"miles_bench_{a.preset.replace('.', '_')}"))
    if a.side is not None:
        run_side(a, model_dir, a.side)
        return
    backends = [b for b in a.backends.split(",") if b]
    if not backends or any(b not in BACKENDS for b in backends):
        raise SystemExit(f"--backends {a.backends}: choose from {','.join(BACKENDS)}")
    if int(os.environ.get("RANK", "0")) != 0:      # under torchrun: rank 0 is the parent, the others have no part
        return
    nproc = a.nproc_per_node or int(os.environ.get("WORLD_SIZE", "1"))
    if a.samples % nproc:
        raise SystemExit(f"--samples {a.samples} must divide over {nproc} GPUs (--nproc-per-node)")
    if nproc > 1 and "plain" in backends:
        print("[train_step] plain side skipped: it runs on one GPU only", file=sys.stderr, flush=True)
        backends.remove("plain")
    result: dict = {"model": f"{a.preset}-shaped", "gpus": nproc, "tokens_per_step": a.samples * a.seq_len,
                    "torch": torch.__version__, "recompute": a.recompute}
    if not a.tiny and torch.cuda.is_available():
        result.update(run_child(argv, 1, "anchor", a.side_timeout))
    for backend in backends:
        row = run_child(argv, nproc, backend, a.side_timeout)
        result.setdefault("device", row.pop("device", None))
        row.pop("gpus", None)
        result.update(row)
    for backend in ("fsdp", "megatron"):
        if f"{backend}_tokens_per_s" in result and "plain_tokens_per_s" in result:
            result[f"{backend}_vs_plain"] = round(result[f"{backend}_tokens_per_s"] / result["plain_tokens_per_s"], 3)
    print(side_table(result, backends), flush=True)
    print(json.dumps(result), flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result))
    if any(f"{b}_error" in result for b in backends):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
