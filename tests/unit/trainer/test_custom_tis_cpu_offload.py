"""--custom-tis-function-path (Miles's call: per-sample lists in, (pg_loss, loss_masks, metrics) out) and
--fsdp-cpu-offload reach the FSDP trainer (one gloo rank, tiny model), and so does top-k OPD's per-token
estimate; the loss arithmetic of a custom TIS
step (its masks restrict the numerators, the denominators stay the step's) on plain tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_harness import build_from_config, flags, parse

from miles.config import ConfigError, parse_args
from miles.trainer.losses import LossInputs, Reducer, policy_loss, policy_loss_with_tis
from miles.types import Sample

MIS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "miles_scripts" / "plugins"
CALLS: list[dict] = []


def recording_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Zero weight on every token; records what it was called with."""
    CALLS.append({"tis_mode": args.tis_mode, "use_tis": args.use_tis, "lengths": kwargs["response_lengths"],
                  "total": kwargs["total_lengths"], "max_seq_lens": kwargs["max_seq_lens"],
                  "n": len(train_log_probs), "rollout": [t.tolist() for t in rollout_log_probs]})
    return pg_loss * 0.0, loss_masks, {"w": torch.zeros_like(pg_loss)}


def bad_tis(args, pg_loss):  # no train_log_probs / rollout_log_probs / loss_masks
    return pg_loss, [], {}


def _samples(n: int = 8) -> list[Sample]:
    """Responses of 3 tokens with the rollout log-probs -2, -2.5, -3 (what the tests below check they reach)."""
    gen = torch.Generator().manual_seed(3)
    return [Sample(group_index=i // 4, index=i, tokens=torch.randint(4, 60, (7,), generator=gen).tolist(),
                   response_length=3, loss_mask=[1, 1, 1], reward=float(i % 2), rollout_log_probs=[-2.0, -2.5, -3.0])
            for i in range(n)]


def _cfg(model_dir, *extra: str):
    return parse(model_dir, flags("fsdp", ["--num-rollout", "4", "--n-samples-per-prompt", "4", "--lr", "1e-2"],
                                  list(extra)))


def _trainer(cfg, group, device="cpu"):
    return build_from_config(cfg, group=group, device=device)


def test_custom_tis_function_is_what_the_trainer_calls(tiny_model_dir, one_rank_group, tmp_path):
    yaml = tmp_path / "mis.yaml"
    yaml.write_text("use_tis: true\ntis_mode: zero\n")  # tis_mode names no flag: it reaches args as in Miles
    cfg = _cfg(tiny_model_dir, "--custom-config-path", str(yaml),
               "--custom-tis-function-path", f"{__name__}.recording_tis")
    CALLS.clear()
    metrics = _trainer(cfg, one_rank_group).train(_samples(), rollout_id=0)
    assert CALLS and CALLS[0]["tis_mode"] == "zero" and CALLS[0]["use_tis"] is True
    assert sum(c["n"] for c in CALLS) == 8 and all(ln == 3 for c in CALLS for ln in c["lengths"])
    # Miles's kwargs: prompt + response tokens of each sample (7 here), no bshd padding
    assert all(c["total"] == [7] * c["n"] and c["max_seq_lens"] is None for c in CALLS)
    assert CALLS[0]["rollout"][0] == pytest.approx([-2.0, -2.5, -3.0])
    pg = next(v for k, v in metrics.items() if k.endswith("pg_loss"))
    assert pg == 0.0 and any(k.endswith("/w") or k == "w" for k in metrics), metrics
    plain = _trainer(_cfg(tiny_model_dir, "--use-tis"), one_rank_group).train(_samples(), rollout_id=0)
    assert next(v for k, v in plain.items() if k.endswith("pg_loss")) != 0.0


def test_custom_tis_refusals(tiny_model_dir, monkeypatch):
    with pytest.raises(ConfigError, match="^--custom-tis-function-path .* only with --use-tis"):
        _cfg(tiny_model_dir, "--custom-tis-function-path", f"{__name__}.recording_tis")
    parse_args(["--train-backend", "megatron", "--num-rollout", "1", "--rollout-batch-size", "2", "--use-tis",
                "--custom-tis-function-path", f"{__name__}.recording_tis"])   # both backends call it
    from miles.run.preflight import check_plugin

    with pytest.raises(ConfigError, match="cannot be called as .* does not take train_log_probs"):
        check_plugin("custom_tis_function_path", f"{__name__}.bad_tis")
    check_plugin("custom_tis_function_path", f"{__name__}.recording_tis")
    # Miles's Megatron form requires total_lengths and response_lengths by keyword: they are passed, so it binds
    monkeypatch.syspath_prepend(str(MIS_DIR))
    check_plugin("custom_tis_function_path",
                 "examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp")


def _inputs(n_tokens=(3, 2)):
    gen = torch.Generator().manual_seed(0)
    n = sum(n_tokens)
    lp = torch.randn(n, generator=gen) * 0.1 - 1.0
    return LossInputs(log_probs=lp.clone().requires_grad_(True), loss_mask=torch.ones(n), lengths=list(n_tokens),
                      old_log_probs=lp + 0.05, rollout_log_probs=torch.tensor([-1.0, -3.0, -1.1, -0.2, -1.0]),
                      advantages=torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0]))


def test_miles_mis_example_weights_and_rejection(monkeypatch):
    """The fixture's mis.compute_mis_weights_fsdp through policy_loss_with_tis: mask mode zeroes ratios outside
    [lower, upper], truncate caps them; use_rs drops those tokens from the numerators while the denominators
    stay the step's (sample mean: 3 and 2 tokens, 2 samples)."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(MIS_DIR))
    from examples.infra_features.train_infer_mismatch_helper.mis import compute_mis_weights_fsdp

    algo = parse_args(["--use-tis", "--num-rollout", "1", "--rollout-batch-size", "2", "--train-backend", "fsdp"]).algo
    inp = _inputs()
    ratio = (inp.old_log_probs - inp.rollout_log_probs).exp()
    keep = ((ratio >= 0.5) & (ratio <= 2.0)).float()
    assert keep.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]  # one ratio above 2, one below 0.5
    pg = -inp.advantages * (inp.log_probs.detach() - inp.old_log_probs).exp()  # inside the clip range here
    losses = {}
    for mode, use_rs, weight in (("mask", False, ratio * keep), ("truncate", False, ratio.clamp(max=2.0)),
                                 ("truncate", True, ratio.clamp(max=2.0) * keep)):
        args = SimpleNamespace(tis_mode=mode, tis_lower_bound=0.5, tis_upper_bound=2.0, use_rs=use_rs)
        reduce = Reducer(inp.loss_mask, inp.lengths, per_token=False, num_step_tokens=5, num_step_samples=2)
        loss, metrics = policy_loss_with_tis(compute_mis_weights_fsdp, args)(algo, inp, reduce)
        w = (pg * weight).tolist()
        expected = (sum(w[:3]) / 3 + sum(w[3:]) / 2) / 2
        # fp32 against float64: measured 8.4e-8 relative (CPU, 2026-12-07)
        assert float(metrics["pg_loss"]) == pytest.approx(expected, rel=2e-7), (mode, use_rs)
        assert float(metrics["mis_clipfrac"]) > 0
        losses[mode, use_rs] = float(loss.detach())
    assert losses["truncate", True] != pytest.approx(losses["truncate", False])  # RS changed the numerators
    builtin, _ = policy_loss(algo, inp, Reducer(inp.loss_mask, inp.lengths, False, 5, 2))
    assert float(builtin.detach()) == pytest.approx(losses["truncate", False])  # built-in: clamp to [0, --tis-clip 2]


def test_miles_mis_cp_form_gives_the_fsdp_form_result(monkeypatch):
    """Miles's Megatron form (``compute_mis_weights_with_cp``: required total/response lengths, its cp_utils
    gather and slice) gives what the FSDP form does: the loss holds each response whole here. cp_utils refuses
    values that are not one per response token, and bshd, in one line."""
    from types import SimpleNamespace

    from miles.backends.training_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    monkeypatch.syspath_prepend(str(MIS_DIR))
    from examples.infra_features.train_infer_mismatch_helper.mis import (
        compute_mis_weights_fsdp,
        compute_mis_weights_with_cp,
    )

    algo = parse_args(["--use-tis", "--num-rollout", "1", "--rollout-batch-size", "2", "--train-backend", "fsdp"]).algo
    args = SimpleNamespace(tis_mode="truncate", tis_lower_bound=0.5, tis_upper_bound=2.0, use_rs=True,
                           qkv_format="thd")
    out = {}
    for name, fn in (("fsdp", compute_mis_weights_fsdp), ("cp", compute_mis_weights_with_cp)):
        inp = _inputs()
        inp.total_lengths = [7, 4]
        reduce = Reducer(inp.loss_mask, inp.lengths, per_token=False, num_step_tokens=5, num_step_samples=2)
        loss, metrics = policy_loss_with_tis(fn, args)(algo, inp, reduce)
        loss.backward()
        out[name] = (float(loss.detach()), {k: float(v) for k, v in metrics.items()}, inp.log_probs.grad.tolist())
    assert out["cp"] == out["fsdp"] and out["cp"][1]["mis_clipfrac"] > 0
    x = torch.zeros(3)
    assert all_gather_with_cp(x, 5, 3) is x and slice_log_prob_with_cp([1.0, 2.0, 3.0], 5, 3) == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"^all_gather_with_cp: got 2 values for a response of 3 tokens"):
        all_gather_with_cp(torch.zeros(2), 5, 3)
    with pytest.raises(ValueError, match=r"^slice_log_prob_with_cp: qkv_format 'bshd' is not supported"):
        slice_log_prob_with_cp(x, 5, 3, "bshd", 8)


def test_fsdp_cpu_offload_reaches_the_policy_and_its_optimizer(tiny_model_dir, one_rank_group, monkeypatch):
    import miles.trainer.fsdp as fsdp

    built, adam = [], []
    real_build, real_adam = fsdp.FSDPTrainer._build_policy, fsdp.build_adamw
    monkeypatch.setattr(fsdp.FSDPTrainer, "_build_policy",
                        lambda self, path, **kw: built.append(kw.get("cpu_offload", False)) or real_build(self, path, **kw))
    monkeypatch.setattr(fsdp, "build_adamw", lambda m, **kw: adam.append(kw["device"]) or real_adam(m, **kw))
    tr = _trainer(_cfg(tiny_model_dir, "--fsdp-cpu-offload", "--use-kl-loss"), one_rank_group)
    assert built == [True, False] and adam == [torch.device("cpu")]  # the policy, then the reference model
    assert tr.policy_param_device == torch.device("cpu")
    tr.train(_samples(), rollout_id=0)
    built.clear()
    _trainer(_cfg(tiny_model_dir, "--use-kl-loss"), one_rank_group)
    assert built == [False, False]


def test_topk_opd_estimate_reaches_the_advantages(tiny_model_dir, one_rank_group):
    """--opd-log-prob-top-k: the trainer reads metadata["opd_reverse_kl"] (not teacher log-probs) into the OPD
    term; a sample without it is one error naming the key."""
    opd = ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://127.0.0.1:9/generate", "--opd-log-prob-top-k", "4",
           "--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func",
           "--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards"]
    tr = _trainer(_cfg(tiny_model_dir, *opd), one_rank_group)
    samples = _samples()
    for s in samples:
        s.metadata["opd_reverse_kl"] = [0.3, 0.3, 0.3]
    metrics = tr.train(samples, rollout_id=0)
    assert next(v for k, v in metrics.items() if k.endswith("opd_reverse_kl_mean")) == pytest.approx(0.3), metrics
    del samples[0].metadata["opd_reverse_kl"]
    with pytest.raises(ValueError, match=r'metadata\["opd_reverse_kl"\] must have one value per response token'):
        tr.train(samples, rollout_id=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fsdp_cpu_offload_keeps_the_policy_on_cpu_on_gpu(tiny_model_dir, tmp_path):
    """On a GPU: one training step with --fsdp-cpu-offload leaves the policy's parameters and AdamW state on
    CPU, and gives the loss, gradient norm and update direction of the same step without it."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        def whole(p):  # one rank: the local shard is the whole parameter
            return (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone()

        def run(*extra):
            tr = _trainer(_cfg(tiny_model_dir, *extra), dist.group.WORLD, device="cuda:0")
            before = {n: whole(p) for n, p in tr.model.named_parameters()}
            metrics = tr.train(_samples(), rollout_id=0)
            delta = torch.cat([(whole(p) - before[n]).flatten().float() for n, p in tr.model.named_parameters()])
            return tr, metrics, delta

        tr, metrics, delta = run("--fsdp-cpu-offload")
        assert all(p.device.type == "cpu" for p in tr.model.parameters())
        assert all(v.device.type == "cpu" for st in tr.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.ndim > 0)
        _, ref_metrics, ref_delta = run()
        assert delta.abs().max() > 0
        # bf16 compute on both paths: the same loss and gradient norm, and the same update direction
        for key in [k for k in ref_metrics if k.endswith(("pg_loss", "grad_norm"))]:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=2e-2, abs=1e-4), key
        assert torch.nn.functional.cosine_similarity(delta, ref_delta, dim=0) > 0.9
    finally:
        dist.destroy_process_group()


def nan_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """A loss that turns NaN (as a diverging run's does): its gradients are NaN."""
    return pg_loss * float("nan"), loss_masks, {}


def test_a_nonfinite_gradient_norm_skips_the_optimizer_step(tiny_model_dir, one_rank_group):
    """Megatron-LM's check_for_nan_in_loss_and_grad, on by default: a step whose gradient norm is NaN leaves the
    weights, the optimizer state and the LR schedule as they were; --no-check-for-nan-in-loss-and-grad applies it."""
    trainer = _trainer(_cfg(tiny_model_dir, "--custom-tis-function-path", f"{__name__}.nan_tis", "--use-tis"),
                       one_rank_group)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train(_samples(), rollout_id=0)
    assert metrics["nonfinite_grad_steps"] == 1.0 and metrics["grad_norm"] != metrics["grad_norm"], metrics
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    assert not trainer.optimizer.state or all(not torch.is_tensor(v) or torch.isfinite(v).all()
                                              for s in trainer.optimizer.state.values() for v in s.values())
    assert trainer.schedule.step == 0
    healthy = _trainer(_cfg(tiny_model_dir), one_rank_group).train(_samples(), rollout_id=0)
    assert healthy["nonfinite_grad_steps"] == 0.0

    unchecked = _trainer(_cfg(tiny_model_dir, "--custom-tis-function-path", f"{__name__}.nan_tis", "--use-tis",
                               "--no-check-for-nan-in-loss-and-grad"), one_rank_group)
    out = unchecked.train(_samples(), rollout_id=0)
    assert "nonfinite_grad_steps" not in out
    assert any(not torch.isfinite(p).all() for p in unchecked.model.parameters())
