"""What recording the MoE routing (SGLang's ``return_routed_experts``, Miles's R3) costs a rollout of the embedded engine.

    OMP_NUM_THREADS=1 python benchmarks/engine_routing.py                  # CPU, tiny Qwen3-MoE (~1 min)
    OMP_NUM_THREADS=1 python benchmarks/engine_routing.py --rounds 8 --layers 8

One process, one engine (in-process, no HTTP) on a random-weight tiny Qwen3-MoE built locally (MoE routers on every
layer; generic HF path, where the recorder lives). A rollout: ``--prompts`` prompts of ``--prompt-len`` random tokens,
``n = --samples`` each, ``--new-tokens`` tokens each (temperature 1, EOS ignored), all submitted at once. Rollouts
alternate between requests without and with ``return_routed_experts`` (``--rounds`` of each, after one warm-up
pair), and each prints one JSON line: wall seconds, the process's CPU seconds (``time.process_time``: all its
threads, the scheduler thread's forwards included; less disturbed than wall time by other jobs on a shared machine)
and how many forwards armed the recorder (``RoutedExpertsRecorder.begin`` calls). The summary gives each mode's
medians and their ratios. Run against a
checkout before the recording became per request (``PYTHONPATH=<that checkout>``) it shows what a rollout without
the flag paid then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.engine.engine import Engine, EngineArgs  # noqa: E402
from miles.engine.protocol import GenerateReqInput  # noqa: E402
from miles.engine.routed_experts import RoutedExpertsRecorder  # noqa: E402
from miles.utils.tiny_model import build_tiny_moe_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()

    armed = [0]
    begin = RoutedExpertsRecorder.begin

    def counting_begin(self) -> None:
        armed[0] += 1
        begin(self)
    RoutedExpertsRecorder.begin = counting_begin

    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_moe_model(Path(d) / "moe", hidden_size=args.hidden, num_layers=args.layers,
                                     num_experts=args.experts, num_experts_per_tok=2)
        slots = args.prompts * args.samples
        eng = Engine(EngineArgs(hf_checkpoint=str(model), max_context_len=args.prompt_len + args.new_tokens + 8,
                                max_running_requests=slots, random_seed=0))
        eng.start()
        rng = random.Random(0)
        prompts = [[rng.randrange(1, 100) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True, "n": args.samples}

        async def rollout(flag: bool) -> tuple[float, float]:
            specs = []
            for p in prompts:
                specs += eng.prepare(GenerateReqInput(input_ids=p, return_routed_experts=flag,
                                                      sampling_params=params))[0]
            t0, c0 = time.perf_counter(), time.process_time()
            outs = await asyncio.wait_for(eng.wait_final(eng.submit(specs, stream=False)), 600)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert all(("routed_experts" in o["meta_info"]) == flag for o in outs)
            return dt, cpu

        times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        try:
            for r in range(args.rounds + 1):
                for flag in (False, True):
                    armed[0] = 0
                    dt, cpu = asyncio.run(rollout(flag))
                    if r:   # round 0 warms up
                        times[flag].append((dt, cpu))
                    print(json.dumps({"round": r, "return_routed_experts": flag, "wall_s": round(dt, 4),
                                      "cpu_s": round(cpu, 4), "recorder_begin_calls": armed[0]}), flush=True)
        finally:
            eng.stop()
    summary: dict[str, float] = {}
    for i, what in enumerate(("wall_s", "cpu_s")):
        off, on = (statistics.median(t[i] for t in times[flag]) for flag in (False, True))
        summary |= {f"median_{what}_without": round(off, 4), f"median_{what}_with": round(on, 4),
                    f"{what}_with_over_without": round(on / off, 3)}
    print(json.dumps({"summary": summary | {"rounds": args.rounds, "tokens_per_rollout": slots * args.new_tokens,
                                            "layers": args.layers}}))


if __name__ == "__main__":
    main()
