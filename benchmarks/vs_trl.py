"""TRL's ``GRPOTrainer`` and this project on the same GRPO task, side by side in one run.

The task is the quickstart's (one-digit addition, ``--rm-type quickstart``, examples/quickstart): a
Qwen3-architecture model built locally (``--hidden-size 128 --num-layers 4``: 0.8M parameters), an SFT
warm start with this project's SFT path (the same buggy-teacher demonstrations as the quickstart, one
rank), then GRPO from that checkpoint on both sides with the same data, reward and hyper-parameters:
8 prompts x 8 samples a step, up to 8 response tokens, temperature 1, lr 1e-4 (constant), AdamW betas
0.9/0.98, no weight decay, gradient clip 1.0, PPO clip 0.2, no KL, group mean/std advantages, one
optimizer step per rollout, per-sample token-mean loss (TRL's ``loss_type="grpo"``).

This project runs ``train_async.py`` unless ``--script train.py`` (or ``--layout colocated``) is given: the
engine generates step k+1 while the trainer trains on step k (on 2 cores: one each), so each step trains on
samples generated with the weights of one step before (one step off-policy, no importance-sampling correction:
the same loss as ``train.py``); TRL's side is on-policy. ``--script train.py`` compares the synchronous loop.

Each side runs until ``--max-steps``; the criterion is the first step at which the mean reward of the
last ``--window`` steps reaches ``--threshold``. Training time is the sum of step times (start-up
excluded: TRL from ``on_train_begin``, this project the ``perf/step_time`` of each rollout).

    python benchmarks/vs_trl.py                              # both sides, 1 trainer rank + 1 engine
    python benchmarks/vs_trl.py --layout quickstart          # this project with 2 trainer ranks + 2 engines
    python benchmarks/vs_trl.py --layout colocated           # 1 rank: the trainer and its engine share it
    python benchmarks/vs_trl.py --skip-trl --max-steps 100   # this project only
    python benchmarks/vs_trl.py --runs 3 --stop-at-threshold # 3 runs of both sides: the ratio's median
    python benchmarks/vs_trl.py --script train.py            # this project's synchronous loop (on-policy)

Threads: TRL's process uses every usable core (``--trl-threads``, torch's default); this project's processes,
with ``OMP_NUM_THREADS`` unset, each phase's share of them (docs/launching.md, "CPU threads"). On a machine
busy with other jobs give ``OMP_NUM_THREADS=1 ... --trl-threads 1`` (one thread everywhere).

TRL is installed by this script into its own virtual environment (``--trl-venv``, default
``~/.cache/miles-bench/trl-venv``): ``python -m venv``, then ``pip install torch==2.13.0`` (the CPU build
the test venv uses) and ``trl==1.16.0`` with this venv's transformers version; never into the project's
venv. When that is not possible the script says so and measures this project alone. The TRL side runs
in that venv as ``python benchmarks/vs_trl.py --trl-worker ...`` (this file imports nothing from
``miles`` at module level for that reason).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
LAYOUTS = {  # torchrun processes and train.py's role flags
    "single": (2, ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                   "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "2"]),
    "quickstart": (4, ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                       "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "4"]),
    "colocated": (1, ["--colocate", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
                      "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "1"]),
}


# ----------------------------------------------------------------------------------------------- shared
def to_threshold(rewards: list[float], step_times: list[float], window: int, threshold: float) -> tuple[int, float] | None:
    """(steps, training seconds) at the first step where the mean of the last ``window`` rewards >= threshold."""
    elapsed = 0.0
    for i, t in enumerate(step_times):
        elapsed += t
        if i + 1 >= window and sum(rewards[i + 1 - window:i + 1]) / window >= threshold:
            return i + 1, elapsed
    return None


def _env() -> dict[str, str]:
    """The runs' environment. ``OMP_NUM_THREADS`` is passed on only when the caller set it: unset, this project's
    processes take their share of the cores in each phase (docs/launching.md, "CPU threads")."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _cpu_children() -> float:
    import resource

    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> float:
    """Run ``cmd`` (its output to ``log``); returns the CPU seconds it and its waited-for descendants used."""
    cpu0 = _cpu_children()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env or _env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"vs_trl: {cmd[0]} ... failed ({proc.returncode}); log {log}:\n{tail}")
    return _cpu_children() - cpu0


# ----------------------------------------------------------------------------------------------- the task
def build_task(work: Path, hidden: int, layers: int, seed: int, sft_rollouts: int) -> Path:
    """The quickstart data, a model of the given size and its SFT warm start (one rank); returns the task dir."""
    task = work / f"task-h{hidden}-l{layers}-s{seed}"
    if (task / "sft_model" / "config.json").is_file():
        return task
    sys.path.insert(0, str(REPO / "examples" / "quickstart"))
    import build as qs  # examples/quickstart/build.py

    from miles.utils.tiny_model import build_tiny_model

    task.mkdir(parents=True, exist_ok=True)
    build_tiny_model(task / "model", hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, seed=seed)
    qs.write_jsonl(task / "train.jsonl", qs.train_rows(4, seed))
    qs.write_jsonl(task / "sft.jsonl", qs.sft_rows(0.2, 10, seed))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "train.py",
           "--train-backend", "fsdp", "--debug-train-only", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
           "--hf-checkpoint", str(task / "model"), "--loss-type", "sft_loss", "--prompt-data", str(task / "sft.jsonl"),
           "--input-key", "input", "--label-key", "response", "--rollout-shuffle", "--num-rollout", str(sft_rollouts),
           "--rollout-batch-size", "320", "--global-batch-size", "32", "--lr", "3e-3", "--adam-beta2", "0.98",
           "--clip-grad", "1.0", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--no-progress",
           "--save", str(task / "sft_ckpt"), "--save-interval", "100000", "--keep-checkpoints", "1", "--no-save-optim",
           "--save-hf", str(task / "sft_model"), "--output-dir", str(task / "sft_run"), "--run-name", "vs-trl-sft"]
    _run(cmd, task / "sft.log", timeout=1800)
    return task


# ----------------------------------------------------------------------------------------------- this project
def run_miles(task: Path, out: Path, layout: str, a: argparse.Namespace) -> dict:
    from miles.run.metrics import phase_breakdown, read_metrics

    nproc, roles = LAYOUTS[layout]
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), a.script,
           "--train-backend", a.train_backend, *roles, "--hf-checkpoint", str(task / "sft_model"), "--prompt-data", str(task / "train.jsonl"),
           "--input-key", "input", "--label-key", "label", "--rollout-shuffle", "--rollout-seed", str(a.seed),
           "--rm-type", "quickstart", "--num-rollout", str(a.max_steps), "--rollout-batch-size", "8",
           "--n-samples-per-prompt", "8", "--global-batch-size", "64", "--rollout-max-response-len", "8",
           "--rollout-temperature", "1.0", "--advantage-estimator", "grpo", "--lr", "1e-4", "--lr-decay-style",
           "constant", "--adam-beta2", "0.98", "--weight-decay", "0.0", "--clip-grad", "1.0", "--eps-clip", "0.2",
           "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--engine-max-running-requests", "128",
           "--seed", str(a.seed), "--no-progress", "--output-dir", str(out), "--run-name", f"vs-trl-{layout}",
           *a.miles_extra]
    t0 = time.monotonic()
    cpu = _run(cmd, out.parent / f"{out.name}.log", timeout=a.timeout)
    wall = time.monotonic() - t0
    recs = read_metrics(out / "metrics.jsonl")
    rewards = [r["rollout/raw_reward"] for r in recs]
    steps = [r["perf/step_time"] for r in recs]
    skip = min(5, len(recs) - 1)                       # the first rollouts warm up caches and allocators
    keys = [k for k, _, _ in phase_breakdown(recs[-1])]
    depth = {k: d for k, _, d in phase_breakdown(recs[-1])}
    phases = [(k, statistics.mean(r.get(k, 0.0) for r in recs[skip:]), depth[k]) for k in keys]
    return {"rewards": rewards, "step_times": steps, "wall": wall, "cpu": cpu, "phases": phases}


# ----------------------------------------------------------------------------------------------- TRL
def ensure_trl_venv(venv: Path) -> tuple[Path | None, str]:
    """The TRL venv's python (created on first use), or (None, why not)."""
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import trl, torch; print(trl.__version__, torch.__version__)"]
    if py.exists() and subprocess.run(probe, capture_output=True, timeout=300).returncode == 0:
        return py, "present"
    import transformers  # the project's version, so both sides run the same model code

    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],
                 [str(py), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}",
                  f"torch=={TORCH_VERSION}"]]
        for cmd in steps:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                return None, f"`{' '.join(cmd[2:6])} ...` failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}"
        p = subprocess.run(probe, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            return None, f"trl does not import in {venv}: {p.stderr.strip().splitlines()[-1:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"could not build {venv}: {e}"
    return py, "installed"


def run_trl(py: Path, task: Path, out: Path, a: argparse.Namespace) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "trl.jsonl"
    log.unlink(missing_ok=True)
    cmd = [str(py), str(Path(__file__).resolve()), "--trl-worker", "--task", str(task), "--trl-out", str(out),
           "--max-steps", str(a.max_steps), "--seed", str(a.seed), "--threads", str(a.trl_threads),
           "--window", str(a.window), "--threshold", str(a.threshold)] + (["--stop-at-threshold"] if a.stop_at_threshold else [])
    env = {**_env(), "OMP_NUM_THREADS": str(a.trl_threads)}
    env.pop("PYTHONPATH")
    t0 = time.monotonic()
    cpu = _run(cmd, out / "trl.log", timeout=a.timeout, env=env)
    wall = time.monotonic() - t0
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    ts = [r["t"] for r in recs]
    return {"rewards": [r["reward"] for r in recs], "step_times": [t - p for t, p in zip(ts, [0.0] + ts[:-1])],
            "wall": wall, "cpu": cpu, "version": recs[0].get("trl") if recs else None}


def trl_worker(a: argparse.Namespace) -> None:
    """Runs inside the TRL venv: GRPOTrainer on the task, one JSON line per step (reward, seconds since start)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
    task, out = Path(a.task), Path(a.trl_out)
    rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines() if line.strip()]
    data = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])
    specials = ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<pad>")

    def reward(completions, label, **_):           # the quickstart verifier (miles/rollout/rm_hub/quickstart.py)
        out = []
        for text, lab in zip(completions, label):
            for tok in specials:
                text = text.replace(tok, "")
            out.append(1.0 if text.strip() == str(lab).strip() else 0.0)
        return out

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        rewards: list[float] = []

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                with (out / "trl.jsonl").open("a") as f:
                    f.write(json.dumps({"step": state.global_step, "reward": self.rewards[-1],
                                        "t": time.perf_counter() - self.t0, "trl": trl.__version__}) + "\n")
                w = a.window
                if a.stop_at_threshold and len(self.rewards) >= w and sum(self.rewards[-w:]) / w >= a.threshold:
                    control.should_training_stop = True

    cfg = GRPOConfig(
        output_dir=str(out / "run"), per_device_train_batch_size=64, num_generations=8, max_completion_length=8,
        temperature=1.0, top_p=1.0, learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        num_iterations=1, loss_type="grpo", scale_rewards="group", max_steps=a.max_steps, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=a.seed, disable_dropout=True,
        dataloader_num_workers=0, log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(str(task / "sft_model"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(task / "sft_model"))
    GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                callbacks=[Record()]).train()


# ----------------------------------------------------------------------------------------------- report
def _row(name: str, res: dict, a: argparse.Namespace) -> str:
    hit = to_threshold(res["rewards"], res["step_times"], a.window, a.threshold)
    n = len(res["step_times"])
    sps = statistics.mean(res["step_times"][min(5, n - 1):]) if n else float("nan")
    best = max((sum(res["rewards"][i - a.window:i]) / a.window for i in range(a.window, n + 1)), default=float("nan"))
    reach = f"{hit[0]} | {hit[1]:.1f}" if hit else f"not reached in {n} (best window {best:.3f}) | -"
    return (f"| {name} | {reach} | {sps:.3f} | {n} | {sum(res['step_times']):.1f} | {res['wall']:.1f} | "
            f"{res['cpu']:.1f} ({res['cpu'] / max(n, 1):.3f}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/miles-vs-trl"), help="Work directory (task, runs, logs).")
    p.add_argument("--layout", choices=[*LAYOUTS, "both"], default="single", help="This project's role layout (both: single and quickstart).")
    p.add_argument("--max-steps", type=int, default=800, help="GRPO steps on each side.")
    p.add_argument("--threshold", type=float, default=0.8, help="Mean reward to reach.")
    p.add_argument("--window", type=int, default=50, help="Steps the mean reward is taken over.")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--sft-rollouts", type=int, default=30, help="SFT warm start: rollouts of 320 demonstrations.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-venv", type=Path, default=Path.home() / ".cache" / "miles-bench" / "trl-venv")
    p.add_argument("--trl-threads", type=int, default=None,
                   help="torch threads of the TRL process (one process; default: every usable core, as torch "
                        "does). On a machine busy with other jobs more than one thread thrash (seen: 12-26 s a step "
                        "at load 13 with 2 threads on 2 cores, against ~1 s with one); there give 1, and "
                        "OMP_NUM_THREADS=1 for this project's processes.")
    p.add_argument("--train-backend", choices=["fsdp", "megatron"], default="fsdp",
                   help="This project's GRPO trainer backend (the SFT warm start always uses fsdp).")
    p.add_argument("--script", choices=["train.py", "train_async.py"], default=None,
                   help="This project's entry point. train_async.py (the default; train.py with --layout colocated, "
                        "which train_async.py refuses): generation of step k+1 overlaps "
                        "training on step k, so every step trains on samples of the weights one step old (one step "
                        "off-policy; TRL's GRPOTrainer here is on-policy); train.py: the synchronous loop.")
    p.add_argument("--runs", type=int, default=1,
                   help="Run both sides this many times (TRL, then this project, run after run); prints each run's "
                        "time-to-threshold ratio and their median.")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--stop-at-threshold", action="store_true",
                   help="Stop TRL once the threshold is reached (saves time; its s/step then covers fewer steps).")
    p.add_argument("--timeout", type=float, default=3600, help="Seconds each run may take.")
    p.add_argument("--miles-extra", nargs=argparse.REMAINDER, default=[], help="Extra train.py flags (last).")
    # the TRL side (inside the TRL venv)
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task", help=argparse.SUPPRESS)
    p.add_argument("--trl-out", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_threads is None:
        a.trl_threads = _cores()
    if a.script is None:
        a.script = "train.py" if a.layout == "colocated" else "train_async.py"
    if a.trl_worker:
        trl_worker(a)
        return
    sys.path.insert(0, str(REPO))
    a.work.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    task = build_task(a.work, a.hidden_size, a.num_layers, a.seed, a.sft_rollouts)
    trl_note, py = "skipped (--skip-trl)", None
    if not a.skip_trl:
        py, why = ensure_trl_venv(a.trl_venv)
        trl_note = f"TRL NOT MEASURED: {why}" if py is None else f"trl in {a.trl_venv} ({why})"
        if py is None:
            print(f"vs_trl: {trl_note}", file=sys.stderr)
    names = {"single": "1 trainer rank + 1 engine", "quickstart": "2 trainer ranks + 2 engines",
             "colocated": "1 rank: trainer + its engine, colocated"}
    runs: list[list[tuple[str, dict]]] = []  # per run: TRL first, then this project's layouts
    for i in range(a.runs):
        tag = f"-{i + 1}" if a.runs > 1 else ""
        results: list[tuple[str, dict]] = []
        if py is not None:
            res = run_trl(py, task, a.work / f"trl{tag}", a)
            results.append((f"TRL {res['version']} GRPOTrainer (1 process, {a.trl_threads} threads)", res))
        for layout in (("single", "quickstart") if a.layout == "both" else [a.layout]):
            res = run_miles(task, a.work / f"miles-{layout}{tag}", layout, a)
            results.append((f"miles {a.script}, {names[layout]}", res))
        runs.append(results)
    load1 = os.getloadavg()

    print(f"\nGRPO to a {a.window}-step mean reward of {a.threshold} (model {a.hidden_size}x{a.num_layers}, "
          f"8 prompts x 8 samples, <= 8 tokens, lr 1e-4, T 1, no KL); {trl_note}")
    omp = os.environ.get("OMP_NUM_THREADS")
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f} ({_cores()} usable cores); TRL "
          f"{a.trl_threads} thread(s); this project's threads: "
          + (f"OMP_NUM_THREADS={omp} in every process" if omp else "each phase's share of the cores") + "\n")
    print("| run | steps to threshold | training s to threshold | s/step | steps run | training s, all steps | "
          "wall s (with start-up) | CPU s, all processes (per step) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, results in enumerate(runs):
        for name, res in results:
            print(_row(name + (f", run {i + 1}" if a.runs > 1 else ""), res, a))
    ratios: dict[str, list[float]] = {}
    for results in runs:  # this project / TRL of the same run (TRL ran just before it)
        trl = next((r for n, r in results if n.startswith("TRL")), None)
        h_t = to_threshold(trl["rewards"], trl["step_times"], a.window, a.threshold) if trl is not None else None
        for name, res in results:
            h_m = to_threshold(res["rewards"], res["step_times"], a.window, a.threshold)
            if res is not trl and h_m and h_t:
                ratios.setdefault(name, []).append(h_m[1] / h_t[1])
    for name, rs in ratios.items():
        each = ", ".join(f"{r:.2f}" for r in rs)
        print(f"\n{name}: time to threshold / TRL's = {statistics.median(rs):.2f}"
              + (f" (median of {len(rs)} runs: {each})" if len(rs) > 1 else ""))
    for name, _ in runs[0]:
        per_run = [dict((k, (s, d)) for k, s, d in res["phases"]) for results in runs for n, res in results
                   if n == name and "phases" in res]
        if not per_run:
            continue
        print(f"\nPer-phase breakdown, {name} (mean seconds a step, rollouts 5+, mean of {len(per_run)} run(s); "
              "rank 0's clock; train parts: trainer rank 0):")
        for key, (_, depth) in per_run[0].items():
            secs = statistics.mean(r[key][0] for r in per_run if key in r)
            print(f"{'    ' * depth}{key:<{44 - 4 * depth}} {secs:8.4f}")


if __name__ == "__main__":
    main()
