"""The trainer harness of the tests: a trainer built from a flag list the way the run builds it, flag presets as
named data, and random samples. Importable from tests/unit (``tests/`` is on ``sys.path`` through its
conftest.py) and from the multiprocess workers (``_torchrun.py`` puts ``tests/`` on their ``PYTHONPATH``):

    from trainer_harness import PRESETS, build, flags, random_samples

    tr = build(model_dir, flags("tiny", "megatron", "kl") + ["--lr", "3e-3"], group=group)
    tr.train(random_samples(1, 3, seed=rank, first_group=rank), rollout_id=0)

``build`` goes through ``parse_args`` -> ``miles.run.resolve.resolve_run`` (the run's plan: number of rollouts,
optimizer steps per rollout, global batch size) -> ``miles.trainer.build.build_run_trainer`` (``--train-backend``
picks the backend), on the given group and device; so the rollout temperature (``--rollout-temperature``), the
collective timeout (``--distributed-timeout-minutes``) and ``--custom-config-path`` reach the trainer as in a run.
The one-rank gloo group is the ``one_rank_group`` fixture of ``tests/conftest.py``; a worker of its ``two_ranks``
fixture (2 spawned ranks) runs in ``gloo_rank`` and reports a bounded collective through ``put_timed``. A trainer's
export by name is ``export_by_name``, a checkpoint's tensors ``checkpoint_tensors``; ``same_tensors`` compares them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Flag presets, composed by the tests (``flags(...)``; a later value of the same flag wins, as on a command line).
PRESETS: dict[str, list[str]] = {
    # the smallest run: one rollout of 2 prompts x 2 samples, one optimizer step; collectives bounded at 2 min
    "tiny": ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
             "--num-steps-per-rollout", "1", "--distributed-timeout-minutes", "2"],
    "fsdp": ["--train-backend", "fsdp"],
    "megatron": ["--train-backend", "megatron"],
    "megatron_tp2": ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"],
    "megatron_pp2": ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2"],
    "megatron_cp2": ["--train-backend", "megatron", "--context-parallel-size", "2"],
    # the checkpoint tests' run: 3 samples of one prompt per rank, 2 optimizer steps a rollout
    "ckpt_run": ["--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--lr", "3e-3",
                 "--num-steps-per-rollout", "2"],
    "kl": ["--use-kl-loss", "--kl-loss-coef", "0.1"],
    "dropout": ["--hidden-dropout", "0.1"],
    "cosine": ["--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--min-lr", "1e-4"],
    # GRPO with a KL loss, a KL reward, an entropy bonus and a clip-higher bound
    "grpo_kl": ["--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "k3", "--kl-coef", "0.02",
                "--entropy-coef", "0.01", "--eps-clip-high", "0.28"],
    # PPO with the critic, GAE and normalized advantages
    "ppo": ["--advantage-estimator", "ppo", "--normalize-advantages", "--gamma", "0.99", "--lambd", "0.95"],
    "lora": ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.0", "--target-modules", "all-linear"],
    # an MoE router whose numbers both backends compute alike on CPU (fp32 routing, no auxiliary loss)
    "moe_fp32_router": ["--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0"],
    # DeepSeek-V3's attention and router (MLA, sigmoid scores with a frozen expert bias)
    "mla": ["--multi-latent-attention", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "0", "--moe-aux-loss-coeff", "0"],
}


def flags(*parts: str | list[str]) -> list[str]:
    """The presets named in ``parts`` (and any literal flag lists among them), in order."""
    out: list[str] = []
    for p in parts:
        out += PRESETS[p] if isinstance(p, str) else list(p)
    return out


def parse(model_dir: str | Path, argv: list[str]) -> Any:
    """``parse_args`` of ``--hf-checkpoint model_dir`` and the preset ``tiny`` under ``argv`` (``argv`` wins)."""
    from miles.config import parse_args

    return parse_args(["--hf-checkpoint", str(model_dir), *PRESETS["tiny"], *argv])


def build(model_dir: str | Path, argv: list[str], *, group: Any = None, device: Any = "cpu", mesh: Any = None) -> Any:
    """The trainer of the flags ``argv`` (see ``parse``) over ``group`` (default: the whole world) on ``device``."""
    return build_from_config(parse(model_dir, argv), group=group, device=device, mesh=mesh)


def build_from_config(cfg: Any, *, group: Any = None, device: Any = "cpu", mesh: Any = None) -> Any:
    """The trainer of a parsed config, through the run's plan and ``build_run_trainer``."""
    import torch
    import torch.distributed as dist

    from miles.run.resolve import resolve_run
    from miles.trainer.build import build_run_trainer

    group = dist.group.WORLD if group is None else group
    plan = resolve_run(cfg, num_prompts=None, output_dir="", world_size=dist.get_world_size(group))
    ctx = SimpleNamespace(groups=SimpleNamespace(trainer_group=group, trainer_mesh=mesh),
                          world=SimpleNamespace(device=torch.device(device)))
    return build_run_trainer(cfg, ctx, plan)


def random_samples(num_groups: int, group_size: int, *, seed: int | None = None, vocab: int = 90,
                   first_group: int = 0) -> list:
    """``num_groups`` x ``group_size`` scored samples: per group a random prompt (3-8 tokens), per sample a random
    response (2-8 tokens; the second token masked as a tool output when there are more than 3), a 0/1 reward and
    rollout log-probs in (-3, -2]. Token ids in [4, vocab). Groups are numbered from ``first_group``.
    ``seed``: a private generator; None draws from torch's global RNG (which a checkpoint restores)."""
    import torch

    from miles.types import Sample

    gen = None if seed is None else torch.Generator().manual_seed(seed)
    out = []
    for g in range(first_group, first_group + num_groups):
        prompt = torch.randint(4, vocab, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        for k in range(group_size):
            n = int(torch.randint(2, 9, (1,), generator=gen))
            resp = torch.randint(4, vocab, (n,), generator=gen).tolist()
            mask = [1] * n
            if n > 3:
                mask[1] = 0                                   # a "tool output" token inside the response
            out.append(Sample(group_index=g, index=g * group_size + k, tokens=prompt + resp, response_length=n,
                              loss_mask=mask, reward=float(torch.rand((), generator=gen) > 0.5),
                              rollout_log_probs=(-2.0 - torch.rand(n, generator=gen)).tolist()))
    return out



def export_by_name(tr: Any, bucket_bytes: int, dtype: Any = None) -> dict:
    """A trainer's weight export (``iter_weight_buckets(bucket_bytes, dtype)``) by name, each name once (asserted),
    the tensors copied to the CPU."""
    out: dict = {}
    for bucket in tr.iter_weight_buckets(bucket_bytes, dtype):
        for n, t in bucket:
            assert n not in out, n
            out[n] = t.detach().cpu().clone()
    return out


def checkpoint_tensors(model_dir: str | Path) -> dict:
    """Every tensor of a HF checkpoint directory (all its safetensors files) by name."""
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_tensors(a: dict, b: dict) -> bool:
    """The same names, and under each the same dtype, shape and bits."""
    import torch

    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                          and torch.equal(a[k], b[k]) for k in a)

@contextlib.contextmanager
def gloo_rank(rank: int, port: int, q: Any) -> Iterator[None]:
    """The body of a ``two_ranks`` worker (tests/conftest.py): rank ``rank`` of a 2-rank gloo group on ``port``
    (collectives bounded at 60 s); after it the queue ``q`` is flushed and the process exits without the group's
    teardown (a rank that never joined a collective leaves one open)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def put_timed(q: Any, rank: int, call: Callable[[], Any], *, silent_for: float = 0.0) -> None:
    """Put ``(rank, call(), seconds it took)`` on ``q``, or ``(rank, "Type: message", seconds)`` when it raised. With
    ``silent_for`` the rank stays alive that long without calling (its peer's collective must time out), then puts
    ``(rank, "slept", 0.0)``."""
    if silent_for:
        time.sleep(silent_for)
        q.put((rank, "slept", 0.0))
        return
    start = time.monotonic()
    try:
        value = call()
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - start))
        return
    q.put((rank, value, time.monotonic() - start))


def spy_routing(tr: Any, backend: str = "megatron") -> list:
    """Per policy forward of ``tr``: its sample ids and, per MoE layer, every token's sorted expert set (a list per
    forward of ``{"sid": [...], layer: [[...]]}``), read by forward hooks on the routers (Megatron: megatron-core's routing map, or
    the chosen expert ids of a family's own router, Inkling's) or the experts (FSDP)."""
    import re

    import torch

    seen: list = []
    pat = re.compile(r"layers\.(\d+)\.mlp\.(experts|router)$")
    for name, mod in tr.model.named_modules():
        m = pat.search(name)
        if m is None or (backend == "fsdp") != (m.group(2) == "experts"):
            continue
        layer = int(m.group(1))

        def hook(_mod, args, out, layer=layer):
            if backend == "fsdp":
                sets = [sorted(r) for r in args[1].tolist()]                   # top_k_index [T, k]
            elif out[1].dtype == torch.bool:
                sets = [sorted(r.nonzero().flatten().tolist()) for r in out[1]]  # routing_map [T, E]
            else:
                sets = [sorted(r) for r in out[1].tolist()]                    # a family's router: chosen ids [T, k]
            seen[-1][layer] = sets
        mod.register_forward_hook(hook)
    inner = tr._policy_forward

    def policy_forward(model, mb, **kw):
        if model is tr.model:
            seen.append({"sid": list(mb.sample_ids)})
        return inner(model, mb, **kw)
    tr._policy_forward = policy_forward
    return seen


def policy_logprobs(tr: Any, samples: list) -> list:
    """``tr``'s log-probs of ``samples`` in one eval-mode forward pass (routing replay begun first when it is on)."""
    data = [tr._sample_data(s, i) for i, s in enumerate(samples)]
    if tr.routing_replay is not None:
        tr.routing_replay.begin(samples)
    if getattr(tr, "_images", None) is not None:      # a vision-language model: these samples' images (as train's)
        tr._mm = [tr._images.sample_inputs(s, f"sample {i}") for i, s in enumerate(samples)]
    tr.model.eval()
    out = tr._forward_pass(tr.model, lambda mb: tr._policy_forward(tr.model, mb)[0], data)
    tr._mm = None
    return [x.tolist() for x in out]
