"""The embedded engine as ``train.py`` drives it: many separate ``/generate`` requests in flight over HTTP.

    python benchmarks/engine_rollout.py --small                                   # CPU, tiny model (~1 min)
    python benchmarks/engine_rollout.py --device cuda --dtype bfloat16            # one GPU, Qwen3-0.6B shape
    python benchmarks/engine_rollout.py --device cuda --dtype bfloat16 --workloads http --skip-hf

Workloads (``--workloads``, default all three): ``fixed`` and ``uniform``: ``--requests`` separate
``/generate`` calls, ``--concurrency`` of them in flight at once (a client semaphore), random prompts of
``--prompt-len`` tokens, ``temperature 1``, ``return_logprob``, EOS ignored, response lengths either all
``--fixed-len`` or uniform in ``--min-len..--max-len`` (seeded). ``http``: what one rollout of ``train.py``
sends an engine: ``--concurrency`` requests of ``--fixed-len`` tokens all sent at once (no client limit: the
engine's queue holds what does not run), each with the body the rollout's default generate function sends
(``return_logprob``, temperature 1, top_p 1, top_k -1; EOS ignored so that the lengths are known), so the
engine prefills while it decodes and answers every request with its log-probs at the end. tokens/s = response
tokens asked for / wall time from the first request sent to the last answer. The model is random-weight, built
locally from a config (no downloads).

The memory bound of each workload (``memory_bound``: bytes a generated token costs when every decode step reads
every weight once and every running request's KV cache, the workload replayed as continuous batching with
``--concurrency`` slots) turns, on a GPU, into a ceiling in tokens/s at the anchor's copy bandwidth; each engine
line reports ``pct_of_memory_bound`` = its tokens/s over that ceiling.

Reference in the same run: transformers ``generate`` (static cache, sampling at temperature 1, EOS ignored) in
batches of ``--hf-batch``; each batch decodes to its longest length and counts only the tokens asked for
(what a static batch delivers), over the first ``--hf-requests`` requests (a rate, so a subset suffices).
Prints one JSON line per measurement and a final JSON summary; on a GPU first an ``anchor`` line (copy
bandwidth and a bf16 matmul) that says how fast the machine of this run was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _anchor import anchor  # noqa: E402
from engine_throughput import PRESETS, build_model, sync  # noqa: E402

WORKLOADS = ("fixed", "uniform", "http")


def workload(kind: str, n: int, a: argparse.Namespace) -> list[int]:
    rng = random.Random(7)
    if kind == "http":
        return [a.fixed_len] * a.concurrency
    if kind == "fixed":
        return [a.fixed_len] * n
    return [rng.randint(a.min_len, a.max_len) for _ in range(n)]


def memory_bound(model_dir: Path, lengths: list[int], prompt_len: int, slots: int, dtype: str) -> dict:
    """The workload's ceiling at the memory bound, as a model: continuous batching with ``slots`` running requests,
    a finished request's slot refilled at the next step, and each decode step reading every weight once plus every
    running request's whole KV cache. Returns the bytes per token (the ratio of two workloads' ceilings does not
    depend on the bandwidth) and the decode steps."""
    cfg = json.loads((model_dir / "config.json").read_text())
    el = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * el
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    queue, running, total, steps = list(lengths), [], 0, 0
    while queue or running:
        while queue and len(running) < slots:
            running.append([prompt_len, queue.pop(0)])          # [context, tokens still to generate]
        total += weights + kv_token * sum(r[0] + 1 for r in running)
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
        steps += 1
    return {"bytes_per_token": round(total / sum(lengths)), "steps": steps}


async def _client(url: str, prompts: list[list[int]], lengths: list[int], concurrency: int,
                  train_body: bool = False) -> tuple[float, int, list[float]]:
    """Send every request (``concurrency`` in flight); wall time, response tokens and each answer's arrival (seconds
    after the first request). ``train_body``: the sampling params of the rollout's default generate function."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    got, arrivals = 0, []
    params = {"temperature": 1.0, "ignore_eos": True}
    if train_body:      # miles.rollout.generate.build_sampling_params with the default --rollout-* flags
        params.update(top_p=1.0, top_k=-1, skip_special_tokens=True)

    async def one(session, p, n):
        nonlocal got
        body = {"input_ids": p, "return_logprob": True, "sampling_params": {"max_new_tokens": n, **params}}
        async with sem, session.post(url + "/generate", json=body) as r:
            r.raise_for_status()
            out = await r.json()
        assert len(out["output_ids"]) == n and len(out["meta_info"]["output_token_logprobs"]) == n
        arrivals.append(time.perf_counter() - t0)
        got += n

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(session, p, n) for p, n in zip(prompts, lengths)])
        return time.perf_counter() - t0, got, sorted(arrivals)


def bench_engine(model_dir: Path, a: argparse.Namespace, kv_cache: str, runs: dict[str, tuple[list, list]],
                 ceiling: dict[str, float]) -> dict:
    """Each workload of ``runs`` against one engine child (after a warm-up); ``ceiling``: a workload's tokens/s at
    the memory bound (empty off GPU)."""
    from miles.engine.testing import EngineProc

    ctx = a.prompt_len + max(a.max_len, a.fixed_len) + 1
    argv = ["--device", a.device, "--dtype", a.dtype, "--max-running-requests", str(a.concurrency),
            "--max-context-len", str(ctx), "--kv-cache", kv_cache, "--random-seed", "0"]
    if a.disable_cuda_graph:
        argv.append("--disable-cuda-graph")
    if a.disable_overlap_schedule:
        argv.append("--disable-overlap-schedule")
    log = Path(tempfile.gettempdir()) / f"engine_rollout_{kv_cache}.log"
    eng = EngineProc(model_dir, *argv, log=log, timeout=900)
    out = {}
    try:
        warm = min(a.concurrency, 64)
        asyncio.run(_client(eng.url, next(iter(runs.values()))[0][:warm], [min(64, a.fixed_len)] * warm, warm))
        for kind, (prompts, lengths) in runs.items():
            before = eng.get("/get_load").json()[0]
            everything = kind == "http"             # all at once: no client limit
            dt, toks, arrivals = asyncio.run(_client(eng.url, prompts, lengths, len(prompts) if everything else
                                                     a.concurrency, train_body=everything))
            load = eng.get("/get_load").json()[0]
            out[kind] = round(toks / dt, 1)
            steps = load["steps"] - before["steps"]  # decode steps; tokens / steps = the mean running batch
            print(json.dumps({"side": f"engine ({kv_cache})", "workload": kind, "tokens": toks, "seconds": round(dt, 2),
                              "tokens_per_s": out[kind],
                              "pct_of_memory_bound": round(100 * out[kind] / ceiling[kind], 1) if kind in ceiling else None,
                              "first_answer_s": round(arrivals[0], 3), "last_answer_s": round(arrivals[-1], 3),
                              "decode_steps": steps,
                              "mean_batch": round((load["generated_tokens"] - before["generated_tokens"]) / max(steps, 1), 1),
                              "kv_pages_peak": load.get("kv_pages_peak"), "retractions": load.get("retractions"),
                              "mixed_prefills": load.get("mixed_prefills", 0) - before.get("mixed_prefills", 0),
                              "mixed_steps": load.get("mixed_steps", 0) - before.get("mixed_steps", 0),
                              "prefills": load.get("prefills", 0) - before.get("prefills", 0),
                              "prefill_s": round(load.get("prefill_seconds", 0.0) - before.get("prefill_seconds", 0.0), 3),
                              "decode_s": round(load.get("decode_seconds", 0.0) - before.get("decode_seconds", 0.0), 3),
                              "overlap_steps": load.get("overlap_steps", 0) - before.get("overlap_steps", 0),
                              # per decode step: wall time, the time inside the scheduler's decode step, and its wait
                              # for the device (the rest of the step is host work during which the device may idle)
                              "ms_per_step": round(1e3 * dt / max(steps, 1), 3),
                              "decode_ms": _per_step(load, before, "decode_seconds", steps),
                              "decode_wait_ms": _per_step(load, before, "decode_wait_seconds", steps),
                              **{f"{k}_ms": _per_step(load, before, f"decode_{k}_seconds", steps)
                                 for k in ("grow", "inputs", "forward", "sample", "append", "remove")}}), flush=True)
    finally:
        eng.stop()
    return out


def _per_step(load: dict, before: dict, key: str, steps: int) -> float | None:
    if key not in load:
        return None
    return round(1e3 * (load[key] - before.get(key, 0.0)) / max(steps, 1), 3)


def bench_hf(model_dir: Path, a: argparse.Namespace, runs: dict[str, tuple[list, list]]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    out = {}
    first = next(iter(runs.values()))[0][: a.hf_batch]
    with torch.no_grad():  # warm-up: transformers compiles the static-cache decode step on first use
        x = torch.tensor(first, device=a.device)
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0,
                       cache_implementation="static", pad_token_id=0)
    for kind, (prompts, lengths) in runs.items():
        if kind == "http":                          # the same requests as "fixed" for a static batch
            continue
        prompts, lengths = prompts[: a.hf_requests], lengths[: a.hf_requests]
        total, t_all = 0, 0.0
        for i in range(0, len(prompts), a.hf_batch):
            x = torch.tensor(prompts[i: i + a.hf_batch], device=a.device)
            n = max(lengths[i: i + a.hf_batch])
            sync(a.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=True,
                                   temperature=1.0, top_k=0, top_p=1.0, cache_implementation="static", pad_token_id=0)
            sync(a.device)
            t_all += time.perf_counter() - t0
            assert y.shape[1] == x.shape[1] + n
            total += sum(lengths[i: i + a.hf_batch])
        out[kind] = round(total / t_all, 1)
        print(json.dumps({"side": "hf generate", "workload": kind, "tokens": total, "seconds": round(t_all, 2),
                          "tokens_per_s": out[kind]}), flush=True)
    model.to("cpu")
    return out


def profile_steps(model_dir: Path, a: argparse.Namespace) -> dict:
    """Where a decode step's time goes, in process (no HTTP): the scheduler driven on this thread.

    For each running batch size: the wall time of a whole scheduler decode step (what the HTTP server's
    scheduler thread does per token), split into page growth, the forward (graph replay), sampling (GPU)
    and the host bookkeeping (appends, finish checks), each bracketed by a device sync; then the eager
    step's kernels by CUDA time (torch.profiler, graphs off) for the largest batch."""
    from miles.engine import decode_step as S  # the module whose ``sample`` the decode step calls
    from miles.engine.engine import Engine, EngineArgs
    from miles.engine.protocol import GenerateReqInput

    ctx = a.prompt_len + max(a.max_len, a.fixed_len) + 1
    eng = Engine(EngineArgs(hf_checkpoint=str(model_dir), device=a.device, dtype=a.dtype,
                            max_running_requests=a.concurrency, max_context_len=ctx, random_seed=0,
                            cuda_graph=not a.disable_cuda_graph, kv_cache=a.kv_cache.split(",")[0],
                            overlap_schedule=False if a.disable_overlap_schedule else None))
    sch, rn = eng.scheduler, eng.runner
    loop = asyncio.new_event_loop()
    g = torch.Generator().manual_seed(3)
    out: dict = {}

    def dsync():
        if rn.device.type == "cuda":
            torch.cuda.synchronize(rn.device)

    for rows in [int(x) for x in a.profile_rows.split(",")]:
        prompts = torch.randint(2, min(1000, rn.vocab_size), (rows, a.prompt_len), generator=g).tolist()
        body = GenerateReqInput(input_ids=prompts, return_logprob=True,
                                sampling_params={"max_new_tokens": ctx - a.prompt_len - 1, "temperature": 1.0,
                                                 "ignore_eos": True})
        specs, _ = eng.prepare(body)
        sch.submit(specs, loop, stream=False)
        sch._drain(block=False)
        prof_admit = rows == max(int(x) for x in a.profile_rows.split(",")) and rn.device.type == "cuda"
        dsync()
        t0 = time.perf_counter()
        if prof_admit:   # the admission's prefills: their kernels (graphs play no part in a batched prefill)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                while sch.waiting:
                    sch._admit()
                dsync()
        else:
            while sch.waiting:
                sch._admit()
        dsync()
        admit_s = time.perf_counter() - t0
        print(json.dumps({"profile_rows": rows, "admit_ms": round(admit_s * 1e3, 2),
                          "prompt_tokens": rows * a.prompt_len, "prefills": sch.prefills}), flush=True)
        if prof_admit:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70),
                  flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=70),
                  flush=True)
        for _ in range(4):  # warm-up: graph capture for this batch size
            sch._decode_step()
        dsync()
        n = a.profile_steps
        t0 = time.perf_counter()
        for _ in range(n):
            sch._decode_step()
        dsync()
        wall = (time.perf_counter() - t0) / n
        # the same steps, each phase bracketed by a sync
        times = {"grow": 0.0, "forward": 0.0, "sample": 0.0}
        orig_grow, orig_decode, orig_sample = sch._grow_pages, rn.decode, S.sample

        def timed(key, fn, times=times):
            def w(*args, **kw):
                dsync()
                t = time.perf_counter()
                res = fn(*args, **kw)
                dsync()
                times[key] += time.perf_counter() - t
                return res
            return w
        sch._grow_pages, rn.decode, S.sample = timed("grow", orig_grow), timed("forward", orig_decode), timed("sample", orig_sample)
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                sch._decode_step()
            dsync()
            synced = (time.perf_counter() - t0) / n
        finally:
            sch._grow_pages, rn.decode, S.sample = orig_grow, orig_decode, orig_sample
        ms = {k: round(v / n * 1e3, 3) for k, v in times.items()}
        ms["host_rest"] = round(synced * 1e3 - sum(ms.values()), 3)
        ctx_now = sum(r.kv_len for r in sch.running) / max(len(sch.running), 1)
        out[rows] = {"step_ms": round(wall * 1e3, 3), "synced_step_ms": round(synced * 1e3, 3), **ms,
                     "mean_context": round(ctx_now, 1), "tokens_per_s": round(rows / wall, 1)}
        print(json.dumps({"profile_rows": rows, **out[rows]}), flush=True)
        if rows == max(int(x) for x in a.profile_rows.split(",")) and rn.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            graphs, rn.impl.use_graphs = rn.impl.use_graphs, False
            sch._decode_step()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    sch._decode_step()
                dsync()
            rn.impl.use_graphs = graphs
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70), flush=True)
        sch.abort(None, True)
        loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    return out


QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)


def build_on_device(cfg_kw: dict, dtype: str, device: str, out: Path) -> Path:
    """A random-weight Qwen3 initialised on the device (an 8B model in seconds), saved as safetensors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**cfg_kw, max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=1, pad_token_id=0, dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    return out


def memory_run(a: argparse.Namespace, out_dir: Path) -> dict:
    """Qwen3-8B shape: 256 requests of up to --max-len response tokens in flight on one GPU for --memory-run
    seconds (the pool cannot hold them all: requests queue and are retracted), then abort_all; every page must
    come back and the engine must still answer."""
    import aiohttp

    from miles.engine.testing import EngineProc

    model_dir = build_on_device(QWEN3_8B, a.dtype, a.device, out_dir / "qwen3-8b")
    ctx = a.prompt_len + a.max_len + 1
    eng = EngineProc(model_dir, "--device", a.device, "--dtype", a.dtype, "--max-running-requests", str(a.concurrency),
                     "--max-context-len", str(ctx), "--random-seed", "0",
                     log=Path(tempfile.gettempdir()) / "engine_memory_run.log", timeout=900)
    rng = random.Random(7)
    lengths = [rng.randint(a.min_len, a.max_len) for _ in range(a.requests)]
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, QWEN3_8B["vocab_size"], (a.requests, a.prompt_len), generator=g).tolist()
    res: dict = {"model": "qwen3-8b shape", "requests": a.requests, "response_len": [a.min_len, a.max_len]}

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=3600)) as session:
            async def one(p, n):
                body = {"input_ids": p, "return_logprob": True,
                        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
                async with session.post(eng.url + "/generate", json=body) as r:
                    r.raise_for_status()
                    return await r.json()
            t0 = time.perf_counter()
            tasks = [asyncio.ensure_future(one(p, n)) for p, n in zip(prompts, lengths)]
            peak_running = 0
            last_print = 0.0
            while time.perf_counter() - t0 < a.memory_run and not all(t.done() for t in tasks):
                await asyncio.sleep(2)
                load = eng.get("/get_load").json()[0]
                peak_running = max(peak_running, load["num_running_reqs"])
                if time.perf_counter() - last_print >= 20:
                    last_print = time.perf_counter()
                    print(json.dumps({"t": round(last_print - t0), "done": sum(t.done() for t in tasks),
                                      **{k: load.get(k) for k in ("num_running_reqs", "num_waiting_reqs",
                                                                  "generated_tokens", "retractions", "kv_pages_in_use",
                                                                  "kv_pages_total")}}), flush=True)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            res["completed_before_abort"] = all(t.done() for t in tasks)
            res["load_before_abort"] = eng.get("/get_load").json()[0]
            eng.post("/abort_request", {"abort_all": True})
            outs = await asyncio.gather(*tasks)
            res["peak_running"] = peak_running
            res["finished"] = sum(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
            res["aborted"] = sum(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
            res["generated_tokens"] = sum(len(o["output_ids"]) for o in outs)
            # every finished request has exactly the tokens it asked for, and one log-prob per token, retracted or not
            res["finished_exact"] = sum(
                o["meta_info"]["finish_reason"]["type"] == "length" and len(o["output_ids"]) == n
                and len(o["meta_info"]["output_token_logprobs"]) == n for o, n in zip(outs, lengths))
            res["tokens_per_s"] = round(res["generated_tokens"] / res["seconds"])

    try:
        asyncio.run(go())
        time.sleep(1)
        res["load_after_abort"] = eng.get("/get_load").json()[0]
        res["after"] = len(eng.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}})["output_ids"])
        info = eng.get("/get_server_info").json()
        res["max_total_num_tokens"] = info["max_total_num_tokens"]
    finally:
        eng.stop()
    print(json.dumps({"memory_run": res}), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU-sized: tiny model, 32 requests, short lengths.")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None, help="Requests in flight (also --max-running-requests).")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--fixed-len", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--kv-cache", default="paged", help="Comma-separated engine KV layouts to measure: paged, slots.")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="Comma-separated: fixed, uniform, http (see the module docstring).")
    ap.add_argument("--hf-batch", type=int, default=None)
    ap.add_argument("--hf-requests", type=int, default=None, help="Requests HF generate runs (default: all).")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--disable-overlap-schedule", action="store_true",
                    help="The engine processes each decode step's tokens before launching the next (default on CUDA: "
                         "the next step runs on the device meanwhile).")
    ap.add_argument("--profile", action="store_true", help="Break decode steps down in process (no HTTP) and exit.")
    ap.add_argument("--profile-rows", default="256,128,32", help="Running batch sizes --profile measures.")
    ap.add_argument("--profile-steps", type=int, default=30)
    ap.add_argument("--memory-run", type=float, default=None, metavar="SECONDS",
                    help="Qwen3-8B shape, 256 requests of --min-len..--max-len (default 1024..8192) tokens for SECONDS, "
                         "then abort all (GPU).")
    a = ap.parse_args()
    if a.memory_run is not None:
        for k, v in dict(dtype="bfloat16", requests=256, concurrency=256, prompt_len=256, min_len=1024, max_len=8192).items():
            if getattr(a, k) is None:
                setattr(a, k, v)
        torch.set_grad_enabled(False)
        with tempfile.TemporaryDirectory() as tmp:
            memory_run(a, Path(tmp))
        return
    small = dict(preset="tiny", dtype="float32", requests=32, concurrency=16, prompt_len=32, fixed_len=64, min_len=8,
                 max_len=128, hf_batch=8)
    big = dict(preset="qwen3-0.6b", dtype="bfloat16", requests=512, concurrency=256, prompt_len=256, fixed_len=512,
               min_len=32, max_len=1024, hf_batch=64)
    for k, v in (small if a.small else big).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.hf_requests = a.hf_requests or a.requests
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(1)
    vocab = PRESETS[a.preset]["vocab_size"]
    runs = {}
    kinds = [k for k in a.workloads.split(",") if k]
    if not kinds or any(k not in WORKLOADS for k in kinds):
        raise SystemExit(f"--workloads {a.workloads}: choose from {','.join(WORKLOADS)}")
    for kind in kinds:
        lengths = workload(kind, a.requests, a)
        prompts = torch.randint(2, vocab, (len(lengths), a.prompt_len), generator=g).tolist()
        runs[kind] = (prompts, lengths)
    res = {"preset": a.preset, "device": a.device, "dtype": a.dtype, "requests": a.requests, "concurrency": a.concurrency,
           "overlap_schedule": not a.disable_overlap_schedule and a.device.startswith("cuda"), "prompt_len": a.prompt_len, "fixed_len": a.fixed_len, "uniform": [a.min_len, a.max_len], "torch": torch.__version__,
           "machine": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor() or platform.machine()}
    res["anchor"] = anchor(a.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(a.preset, a.dtype, Path(tmp) / "model")
        if a.profile:
            res["profile"] = profile_steps(model_dir, a)
            print(json.dumps(res), flush=True)
            return
        bound = {kind: memory_bound(model_dir, lengths, a.prompt_len, a.concurrency, a.dtype)
                 for kind, (_, lengths) in runs.items()}
        if {"fixed", "uniform"} <= set(bound):     # the ceiling of uniform / fixed at the memory bound (any bandwidth)
            bound["uniform_over_fixed"] = round(bound["fixed"]["bytes_per_token"] / bound["uniform"]["bytes_per_token"], 3)
        ceiling = {}
        if res["anchor"]:                           # tokens/s at the memory bound at this call's copy bandwidth
            ceiling = {kind: res["anchor"]["copy_TB_s"] * 1e12 / bound[kind]["bytes_per_token"] for kind in runs}
            for kind in runs:
                bound[kind]["tokens_per_s_at_anchor"] = round(ceiling[kind])
        res["memory_bound"] = bound
        print(json.dumps({"memory_bound": bound}), flush=True)
        for kv in a.kv_cache.split(","):
            res[f"engine_{kv}"] = bench_engine(model_dir, a, kv, runs, ceiling)
            if ceiling:
                res[f"engine_{kv}_pct_of_memory_bound"] = {k: round(100 * v / ceiling[k], 1)
                                                           for k, v in res[f"engine_{kv}"].items()}
        if not a.skip_hf:
            res["hf_generate"] = bench_hf(model_dir, a, runs)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
