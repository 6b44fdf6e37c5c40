"""LoRA (``miles/trainer/lora.py``) on a plain torch model with the Megatron layer names, one process (TP 1).

Tensor parallelism, the Megatron trainer, the merged weight sync and checkpoints run on real gloo ranks in
``tests/multiprocess/test_megatron_lora.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.config import ConfigError, parse_args
from miles.config.unsupported import unsupported_message
from miles.trainer import lora
from miles.trainer.optim import build_adamw


class Block(nn.Module):
    def __init__(self, h: int = 8, f: int = 12):
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(h, 3 * h, bias=True)
        self.self_attention.linear_proj = nn.Linear(h, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(h, 2 * f, bias=False)
        self.mlp.linear_fc2 = nn.Linear(f, h, bias=False)
        self.norm = nn.RMSNorm(h)

    def forward(self, x):
        a = self.self_attention.linear_proj(torch.tanh(self.self_attention.linear_qkv(x)[..., :8]))
        g, u = self.mlp.linear_fc1(self.norm(x + a)).chunk(2, -1)
        return x + a + self.mlp.linear_fc2(nn.functional.silu(g) * u)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 20, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.layers:
            x = b(x)
        return torch.log_softmax(self.head(x), -1)


def _spec(targets="all-linear", rank=4, alpha=8, dropout=0.0, exclude=None):
    return lora.LoraSpec(rank=rank, alpha=alpha, dropout=dropout, targets=lora.resolve_targets(targets, exclude))


def test_targets_resolve_as_miles_names_them():
    mla = ("linear_kv_down_proj", "linear_kv_up_proj", "linear_q_down_proj", "linear_q_proj", "linear_q_up_proj")
    assert lora.resolve_targets("all-linear") == tuple(sorted(("linear_fc1", "linear_fc2", "linear_proj",
                                                              "linear_qkv") + mla))
    # q_proj: the fused linear_qkv, or multi-latent attention's q projection of a model without q LoRA
    assert lora.resolve_targets("q_proj,v_proj, o_proj") == ("linear_proj", "linear_q_proj", "linear_qkv")
    assert lora.resolve_targets("linear_qkv,down_proj") == ("linear_fc2", "linear_qkv")
    assert lora.resolve_targets("all-linear", "gate_proj,linear_fc2,q_a_proj,kv_b_proj") == (
        "linear_kv_down_proj", "linear_proj", "linear_q_proj", "linear_q_up_proj", "linear_qkv")
    # Miles's Kimi-K2.5 LoRA recipe (radixark/miles@v0.1.0:examples/lora/run-kimi-k25-megatron-lora.sh)
    assert lora.resolve_targets("q_a_proj,kv_a_proj_with_mqa,o_proj,gate_proj,up_proj,down_proj") == (
        "linear_fc1", "linear_fc2", "linear_kv_down_proj", "linear_proj", "linear_q_down_proj")
    with pytest.raises(ConfigError, match="--target-modules: 'lm_head'"):
        lora.resolve_targets("q_proj,lm_head")
    with pytest.raises(ConfigError, match="needs --target-modules"):
        lora.resolve_targets(None)
    with pytest.raises(ConfigError, match="leaves no LoRA target"):
        lora.resolve_targets("o_proj", "linear_proj")


def test_flags_parse_with_miles_defaults_and_refusals(tiny_model_dir):
    base = ["--hf-checkpoint", str(tiny_model_dir), "--train-backend", "megatron", "--num-rollout", "1",
            "--rollout-batch-size", "2"]
    cfg = parse_args(base + ["--lora-rank", "32", "--lora-alpha", "32", "--lora-dropout", "0.0",
                             "--target-modules", "all-linear"])
    t = cfg.train
    assert (t.lora_rank, t.lora_alpha, t.lora_dropout, t.target_modules, t.lora_type) == (32, 32, 0.0, "all-linear",
                                                                                         "lora")
    assert lora.LoraSpec.from_config(t).scale == 1.0
    d = parse_args(base).train
    assert (d.lora_rank, d.lora_alpha, d.lora_dropout, d.target_modules) == (0, 16, 0.0, None)   # Miles's defaults
    assert lora.LoraSpec.from_config(d) is None
    parse_args(base + ["--lora-rank", "4", "--target-modules", "all-linear", "--train-backend", "fsdp"])  # both
    parse_args(base + ["--lora-rank", "4", "--target-modules", "all-linear", "--train-backend", "fsdp",
                       "--experts-shared-outer-loras"])      # both backends (the model is checked at preflight)
    for extra, msg in ((["--lora-type", "canonical_lora"], "--lora-type canonical_lora is not supported"),
                       (["--lora-dropout", "1.5"], "--lora-dropout must be in"),
                       (["--target-modules", "embed"], "--target-modules: 'embed'")):
        argv = base + ["--lora-rank", "4", "--target-modules", "all-linear"] + extra
        with pytest.raises(ConfigError, match=msg):
            parse_args(argv)
    with pytest.raises(ConfigError, match="needs --target-modules"):
        parse_args(base + ["--lora-rank", "4"])
    assert "not supported" in unsupported_message("--lora-adapter-path")
    assert unsupported_message("--lora-rank") is None


def test_zero_b_gives_the_base_model_exactly_and_a_step_trains_only_lora():
    model = Toy()
    ids = torch.randint(0, 20, (2, 6))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = model(ids)
    ad = lora.attach(model, _spec(), seed=1)
    assert len(ad.targets) == 8 and not any(p.requires_grad for p in model.parameters())
    assert torch.equal(model(ids), ref)                                   # B = 0: bit for bit the base model
    opt = build_adamw(ad, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device=torch.device("cpu"))
    for _ in range(2):
        opt.zero_grad()
        (-model(ids)[..., 3].mean()).backward()
        lora.finish_grads(ad, SimpleNamespace(dp=None, dp_size=1, ep_size=1, tp_size=1, edp=None, edp_size=1))
        assert lora.clip_grad_norm(ad, 1.0) > 0
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())      # base untouched
    assert all(p.lora_B.abs().sum() > 0 for _, p in ad.named_pairs())
    assert not torch.allclose(model(ids), ref, atol=1e-4)


def test_merged_weights_equal_base_plus_scaled_b_a_and_compute_the_same():
    model = Toy()
    ad = lora.attach(model, _spec("q_proj,down_proj", rank=2, alpha=6), seed=1)
    assert sorted(ad.targets) == ["layers.0.mlp.linear_fc2", "layers.0.self_attention.linear_qkv",
                                  "layers.1.mlp.linear_fc2", "layers.1.self_attention.linear_qkv"]
    with torch.no_grad():
        for _, p in ad.named_pairs():
            p.lora_B.normal_()
    ids = torch.randint(0, 20, (2, 6))
    adapted = model(ids)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    with lora.merged(ad):
        merged = {n: p.detach().clone() for n, p in model.named_parameters()}
        # hooks off: the merged plain model computes what the adapted one does
        saved = {k: dict(m._forward_hooks) for k, m in ad.targets.items()}
        for m in ad.targets.values():
            m._forward_hooks.clear()
        plain = model(ids)
        for k, m in ad.targets.items():
            m._forward_hooks.update(saved[k])
    for name, w in merged.items():
        key = name.rsplit(".", 1)[0]
        if key in ad.targets and name.endswith("weight"):
            pair = ad.pairs[key.replace(".", "/")]
            # fp32: measured 2.4e-7 (CPU, 2026-12-07)
            assert torch.allclose(w, base[name] + 3.0 * pair.lora_B @ pair.lora_A, rtol=0, atol=5e-7)
            assert not torch.equal(w, base[name])
        else:
            assert torch.equal(w, base[name])
    assert torch.allclose(plain, adapted, rtol=0, atol=2e-6)              # measured 9.5e-7
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())      # restored after


def test_adapter_state_round_trips_and_a_mismatch_is_refused(tmp_path):
    a = Toy()
    ad = lora.attach(a, _spec(), seed=1)
    opt = build_adamw(ad, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device=torch.device("cpu"))
    ids = torch.randint(0, 20, (2, 6))
    (-a(ids)[..., 3].mean()).backward()
    opt.step()
    lora.save_files(ad, opt, tmp_path, 0, None)
    b = Toy()
    bd = lora.attach(b, _spec(), seed=2)                           # another init, then loaded
    bopt = build_adamw(bd, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device=torch.device("cpu"))
    lora.load_files(bd, bopt, tmp_path, 0)
    assert torch.equal(b(ids), a(ids))
    assert bopt.state_dict()["state"][0]["step"] == 1
    other = lora.attach(Toy(), _spec(rank=2), seed=1)
    with pytest.raises(ConfigError, match="differs from this run's"):
        lora.load_files(other, None, tmp_path, 0)
    staged = lora.attach(Toy(), _spec(), seed=1)
    staged.pp_size = 2                                             # a stage of a 2-stage pipeline: per-rank files
    with pytest.raises(ConfigError, match=r"PP 1\) differs .* PP 2\); .*--pipeline-model-parallel-size"):
        lora.load_files(staged, None, tmp_path, 0)
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        lora.load_files(bd, None, tmp_path / "nope", 0)


def test_preflight_refuses_the_layouts_lora_does_not_run(tiny_model_dir):
    import json

    pytest.importorskip("megatron.core")
    from miles.trainer.megatron import options

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    base = ["--hf-checkpoint", str(tiny_model_dir), "--train-backend", "megatron", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--lora-rank", "4", "--target-modules", "all-linear"]
    options.preflight_check(parse_args(base + ["--tensor-model-parallel-size", "2"]), hf)
    options.preflight_check(parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]), hf)
    options.preflight_check(parse_args(base + ["--pipeline-model-parallel-size", "2"]), hf)   # each stage's layers
    options.preflight_check(parse_args(base + ["--context-parallel-size", "2"]), hf)
    for extra, msg in ((["--tensor-model-parallel-size", "2", "--lora-dropout", "0.1"],
                        r"^--lora-dropout 0.1 with --tensor-model-parallel-size > 1 is not supported with --lora-rank"),):
        with pytest.raises(ConfigError, match=msg):
            options.preflight_check(parse_args(base + extra), hf)
    options.preflight_check(parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]), hf)
    options.preflight_check(parse_args(base + ["--optimizer-cpu-offload"]), hf)     # the adapters' AdamW offloaded


def test_moe_expert_lora_preflight(tiny_model_dir, tmp_path):
    """LoRA on MoE experts passes the Megatron preflight at EP 2 (per-expert and shared-outer); what it cannot
    run is refused in one line: --moe-grouped-gemm on expert targets, --experts-shared-outer-loras on a dense model,
    without expert targets, or without --lora-rank."""
    import json

    pytest.importorskip("megatron.core")
    from miles.trainer.megatron import options
    from miles.utils.tiny_model import build_tiny_moe_model

    moe_dir = build_tiny_moe_model(tmp_path / "moe")
    hf = json.loads((moe_dir / "config.json").read_text())
    base = ["--hf-checkpoint", str(moe_dir), "--train-backend", "megatron", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--lora-rank", "4", "--target-modules", "gate_proj,up_proj,down_proj",
            "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
    options.preflight_check(parse_args(base), hf)
    options.preflight_check(parse_args(base + ["--experts-shared-outer-loras"]), hf)
    with pytest.raises(ConfigError, match=r"^--moe-grouped-gemm with LoRA on the MoE experts"):
        options.preflight_check(parse_args(base + ["--moe-grouped-gemm"]), hf)
    with pytest.raises(ConfigError, match=r"^--experts-shared-outer-loras .* selects no expert linear"):
        options.preflight_check(parse_args(base[:-6] + ["--target-modules", "q_proj", "--num-experts", "4",
                                                        "--experts-shared-outer-loras"]), hf)
    dense = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"^--experts-shared-outer-loras .* the model has no MoE experts"):
        options.preflight_check(parse_args(["--hf-checkpoint", str(tiny_model_dir), "--train-backend", "megatron",
                                            "--num-rollout", "1", "--rollout-batch-size", "2",
                                            "--lora-rank", "4", "--target-modules", "all-linear",
                                            "--experts-shared-outer-loras"]), dense)
    with pytest.raises(ConfigError, match=r"^--experts-shared-outer-loras without --lora-rank"):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--experts-shared-outer-loras"])


def test_megatron_peft_names_hand_out_copies(tiny_model_dir) -> None:
    """``lora.peft_named`` (the Megatron backend's adapter export and sync): every tensor a copy, none a view of the
    live adapters, for the dense projections (q/k/v rows of ``linear_qkv``'s B are row slices of one tensor) as
    for the experts."""
    from transformers import AutoConfig

    from miles.trainer.megatron.options import shape_of

    shape = shape_of(AutoConfig.from_pretrained(tiny_model_dir))
    hidden, r = shape.hidden_size, 4
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels
    pairs = {"decoder.layers.0.self_attention.linear_qkv": (torch.randn(r, hidden), torch.randn(qkv_rows, r)),
             "decoder.layers.0.self_attention.linear_proj": (torch.randn(r, shape.num_attention_heads * shape.kv_channels),
                                                             torch.randn(hidden, r))}
    live = [t for pair in pairs.values() for t in pair]
    out = lora.peft_named(pairs, shape)
    assert {k.rsplit(".", 3)[1] for k, _ in out} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name, t in out:
        assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for x in live), name
