"""What ``--enable-deterministic-inference`` (batch-invariant outputs) costs the embedded engine.

    OMP_NUM_THREADS=1 python benchmarks/engine_deterministic.py                       # CPU, tiny + small model
    python benchmarks/engine_deterministic.py --device cuda --dtype bfloat16 --presets small --requests 256 \\
        --running 64 --max-len 256

Two measurements per model, each without and with the flag:

* ``rollout``: ``--requests`` seeded temperature-1 requests with log-probs (random prompts of 8..``--prompt-len``
  tokens, 4..``--max-len`` new tokens, EOS ignored), all submitted at once to the generation core (``Engine``
  without HTTP) with ``--running`` slots; tokens/s = generated tokens / wall time, best of ``--rounds`` (the two
  modes' rounds alternate); ``ratio``: deterministic tokens/s over default.
* ``step``: one decode forward (``ModelRunner.decode``) with ``rows`` running requests out of ``--running``
  slots: as is (the default), padded to all the slots (what the flag runs), and the rows one at a time (the
  other batch-invariant design, measured for comparison). Milliseconds, best of ``--repeat``.

Random-weight Qwen3-shaped models built locally. Prints one JSON line per model.
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
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    "small": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2),
}


def rollout(model: Path, a: argparse.Namespace) -> dict:
    """Both modes' engines side by side, their timed rounds alternating (a shared machine's load hits both)."""
    from miles.engine.engine import Engine, EngineArgs
    from miles.engine.protocol import GenerateReqInput

    g = torch.Generator().manual_seed(0)
    bodies = []
    for i in range(a.requests):
        plen = int(torch.randint(8, a.prompt_len + 1, (1,), generator=g))
        new = int(torch.randint(4, a.max_len + 1, (1,), generator=g))
        bodies.append({"input_ids": torch.randint(2, 90, (plen,), generator=g).tolist(), "return_logprob": True,
                       "sampling_params": {"max_new_tokens": new, "temperature": 1.0, "sampling_seed": i,
                                           "ignore_eos": True}})
    engines = {}
    for mode in ("default", "deterministic"):
        eng = Engine(EngineArgs(hf_checkpoint=str(model), device=a.device, dtype=a.dtype, max_running_requests=a.running,
                                max_context_len=a.prompt_len + a.max_len + 1, deterministic=mode == "deterministic",
                                random_seed=0))
        eng.start()
        eng.runner.warm_up()
        engines[mode] = eng

    def run(eng: Engine) -> tuple[float, int]:
        async def one(b):
            specs, _ = eng.prepare(GenerateReqInput(**b))
            return await eng.wait_final(eng.submit(specs, stream=False))

        async def go():
            return await asyncio.gather(*[one(b) for b in bodies])
        t0 = time.perf_counter()
        out = asyncio.run(go())
        return time.perf_counter() - t0, sum(len(o[0]["output_ids"]) for o in out)
    best = dict.fromkeys(engines, float("inf"))
    tokens = 0
    try:
        for eng in engines.values():
            run(eng)   # warm-up
        for _ in range(a.rounds):   # best of --rounds (a shared machine's noise only slows runs down)
            for mode, eng in engines.items():
                wall, tokens = run(eng)
                best[mode] = min(best[mode], wall)
    finally:
        for eng in engines.values():
            eng.stop()
    res = {mode: {"seconds": round(w, 3), "tok_per_s": round(tokens / w, 1)} for mode, w in best.items()}
    return {"tokens": tokens, **res, "ratio": round(best["default"] / best["deterministic"], 3)}


def step_times(model: Path, a: argparse.Namespace) -> list[dict]:
    from miles.engine.model_runner import ModelRunner, RunnerOptions

    runner = ModelRunner(model, RunnerOptions(device=a.device, dtype=a.dtype, max_running_requests=a.running,
                                              max_context_len=a.prompt_len + a.max_len + 1, cuda_graph=False))
    impl = runner.impl
    ctx = a.prompt_len
    runner.prefill(0, [[5] * ctx] * a.running, [False] * a.running)
    dev = runner.device

    def best(tok: torch.Tensor, pos: torch.Tensor) -> float:
        def fn():
            runner.decode(tok, pos, ctx + 1)
        fn()
        times = []
        for _ in range(a.repeat):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return round(min(times) * 1e3, 3)

    out = []
    for rows in sorted({1, max(1, a.running // 4), a.running}):
        tok = torch.full((rows,), 7, dtype=torch.long, device=dev)
        pos = torch.full((rows,), ctx, dtype=torch.long, device=dev)
        impl.deterministic = False
        plain = best(tok, pos)
        impl.deterministic = True
        padded = best(tok, pos)
        impl.deterministic = False
        one = best(tok[:1], pos[:1])
        out.append({"rows": rows, "default_ms": plain, "padded_to_all_slots_ms": padded,
                    "rows_one_at_a_time_ms": round(one * rows, 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--running", type=int, default=16, help="--max-running-requests")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=20, help="Timed decode forwards per step figure (best kept).")
    ap.add_argument("--rounds", type=int, default=5, help="Timed rollouts per mode (best kept).")
    a = ap.parse_args()
    from miles.engine.testing import build_engine_model

    for preset in a.presets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model = build_engine_model(Path(tmp), **PRESETS[preset])
            res = {"preset": preset, **PRESETS[preset], "device": a.device, "dtype": a.dtype, "running": a.running,
                   "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
            res["rollout"] = rollout(model, a)
            res["step"] = step_times(model, a)
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
