"""``--optimizer-cpu-offload`` (``miles.trainer.megatron.cpu_offload``): the offloaded AdamW gives the plain AdamW's
update bit for bit on CPU, splits by ``--optimizer-offload-fraction``, and exposes its state under the model's
parameters (as checkpoints read it); the flags reach the trainer's options."""

from __future__ import annotations

import torch

from miles.trainer.megatron.cpu_offload import CpuOffloadAdamW


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def _groups(m: torch.nn.Module) -> list[dict]:
    return [{"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in range(3):
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (i + 1)          # the LR schedule writes the outer groups
        m(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_offloaded_adamw_equals_adamw_bitwise() -> None:
    ref, off, half = _model(), _model(), _model()
    _train(ref, torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.98), eps=1e-8, foreach=True))
    opt = CpuOffloadAdamW(_groups(off), fraction=1.0, lr=1e-2, betas=(0.9, 0.98), eps=1e-8, device=torch.device("cpu"))
    _train(off, opt)
    hopt = CpuOffloadAdamW(_groups(half), fraction=0.7, lr=1e-2, betas=(0.9, 0.98), eps=1e-8,
                           device=torch.device("cpu"))
    _train(half, hopt)
    for a, b, c in zip(ref.parameters(), off.parameters(), half.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert opt.offloaded == 4 and 0 < hopt.offloaded < 4
    assert set(opt.state) == set(off.parameters()) and all(int(st["step"]) == 3 for st in opt.state.values())
    assert len(hopt.device_part().state) == 4 - hopt.offloaded and opt.device_part().state == {}


def test_offloaded_adamw_sees_a_weight_load() -> None:
    """A checkpoint load writes the parameters in place after the optimizer exists: the next step starts from them."""
    ref, off = _model(), _model()
    with torch.no_grad():
        for m in (ref, off):
            for p in m.parameters():
                p.add_(1.0)
    _train(ref, torch.optim.AdamW(_groups(ref), lr=1e-2, foreach=True))
    opt = CpuOffloadAdamW(_groups(off), fraction=1.0, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                          device=torch.device("cpu"))
    _train(off, opt)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), off.parameters()))


def test_offloaded_adamw_state_dict_resumes_bitwise() -> None:
    """``state_dict`` / ``load_state_dict`` (a LoRA checkpoint's optimizer): a fresh offloaded AdamW (part offloaded,
    part on the device) loaded from the state after 3 steps continues exactly as the uninterrupted one."""
    import copy

    full, resumed = _model(), _model()
    opt = CpuOffloadAdamW(_groups(full), fraction=0.7, lr=1e-2, betas=(0.9, 0.98), eps=1e-8, device=torch.device("cpu"))
    _train(full, opt)
    saved = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        for a, b in zip(resumed.parameters(), full.parameters()):
            a.copy_(b)
    again = CpuOffloadAdamW(_groups(resumed), fraction=0.7, lr=1e-2, betas=(0.9, 0.98), eps=1e-8,
                            device=torch.device("cpu"))
    again.load_state_dict(saved)
    assert 0 < again.offloaded < 4 and all(int(st["step"]) == 3 for st in again.state.values())
    _train(full, opt)
    _train(resumed, again)
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))


def _cfg(model, *extra: str):
    from miles.config import parse_args

    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def test_offload_flags_reach_the_options(tiny_model_dir) -> None:
    import json

    import pytest
    from transformers import AutoConfig

    from miles.config import ConfigError
    from miles.trainer.megatron import options

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    cfg = _cfg(tiny_model_dir, "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25",
               "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer")
    options.preflight_check(cfg, hf)
    o = options.resolve(cfg.megatron, cfg.train)
    assert o.cpu_offload_fraction == 0.25 and not o.distributed_optimizer      # ZeRO off unless asked for
    assert options.resolve(_cfg(tiny_model_dir, "--optimizer-cpu-offload").megatron).cpu_offload_fraction == 1.0
    assert options.resolve(_cfg(tiny_model_dir).megatron).cpu_offload_fraction is None
    with pytest.raises(ConfigError, match=r"^--optimizer-cpu-offload with --use-distributed-optimizer over 2 "
                                          r"data-parallel ranks is not supported"):
        options.preflight_check(_cfg(tiny_model_dir, "--optimizer-cpu-offload", "--use-distributed-optimizer",
                                     "--actor-num-gpus-per-node", "2"), hf)
    # one DP rank (Miles's Kimi-K2.5 command: TP 8 on 8 GPUs): the distributed optimizer shards nothing
    options.preflight_check(_cfg(tiny_model_dir, "--optimizer-cpu-offload", "--use-distributed-optimizer",
                                 "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"), hf)
    # under LoRA the distributed optimizer is not built (the AdamW holds only the adapters; trainer.py's
    # distributed_optimizer): Miles's Kimi-K2.5 LoRA recipe passes over 2 DP ranks, the trainer's own check too
    lora = _cfg(tiny_model_dir, "--optimizer-cpu-offload", "--use-distributed-optimizer", "--actor-num-gpus-per-node",
                "2", "--lora-rank", "4", "--target-modules", "all-linear")
    options.preflight_check(lora, hf)
    shape = options.shape_of(AutoConfig.from_pretrained(tiny_model_dir))
    o = options.resolve(lora.megatron, lora.train)
    options.check_supported(o, shape, torch.device("cpu"), 2, lora=True)
    with pytest.raises(ConfigError, match=r"^--optimizer-cpu-offload with --use-distributed-optimizer over 2 "):
        options.check_supported(o, shape, torch.device("cpu"), 2)
    with pytest.raises(ConfigError, match=r"^--optimizer-offload-fraction must be in \[0, 1\], got 1.5"):
        _cfg(tiny_model_dir, "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5")
