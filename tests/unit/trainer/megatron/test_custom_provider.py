"""``--custom-model-provider-path`` on the Megatron backend (miles/trainer/megatron/provider.py).

Providers of our own (tests/fixtures/model_providers/tiny_gpt_provider.py: megatron-core's GPTModel on its own local
layer spec, whose core attention is megatron-core's unfused ``DotProductAttention`` where miles's builder puts torch
SDPA; one taking ``config`` with config.json's unpadded vocabulary, one building its config from Megatron-LM's
``get_args()`` as Miles's providers do) are called as Miles calls them and trained on CPU (one gloo rank): its
log-probs equal transformers' on the tiny Qwen3 checkpoint (so the converter loaded its weights), one GRPO step moves
its weights, and the weight sync's export holds the checkpoint's names and shapes. Providers that cannot run
are refused in one line naming the flag and the value (dry run and trainer). Miles's own Inkling provider module, from
a Miles checkout (``MILES_REPO``, a checkout or git directory; ``MILES_REV``, default v0.1.0), is refused naming
transformer-engine, the package its layers import, when imported; its path in a command is not imported but names the
Inkling family, built in its place (``miles.config.specs.PROVIDERS``: tests/unit/trainer/megatron/test_inkling.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

PROVIDERS = Path(__file__).resolve().parents[3] / "fixtures" / "model_providers"
FLAG = "--custom-model-provider-path"
MILES_REPO, MILES_REV = os.environ.get("MILES_REPO"), os.environ.get("MILES_REV", "v0.1.0")


@pytest.fixture
def provider_module(monkeypatch, tmp_path_factory):
    """The fixture providers' module on sys.path, its ``HF_CHECKPOINT`` a tiny Qwen3 checkpoint (tied embeddings,
    vocabulary not a multiple of 128)."""
    from miles.utils.tiny_model import build_tiny_model

    monkeypatch.syspath_prepend(str(PROVIDERS))
    import tiny_gpt_provider

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"))
    monkeypatch.setattr(tiny_gpt_provider, "HF_CHECKPOINT", str(model_dir))
    tiny_gpt_provider.BUILT.clear()
    yield tiny_gpt_provider
    _drop_stand_in()


def _drop_stand_in() -> None:
    """miles's stand-in ``megatron.training`` (provider.py) out of sys.modules, as before the test."""
    import megatron

    mod = sys.modules.get("megatron.training")
    if mod is not None and (mod.__doc__ or "").startswith("miles's stand-in"):
        for name in ("megatron.training", "megatron.training.global_vars"):
            sys.modules.pop(name, None)
        if getattr(megatron, "training", None) is mod:
            del megatron.training


def _trainer(model_dir, extra: list[str], group):
    from trainer_harness import build, flags

    return build(model_dir, flags("megatron", ["--lr", "3e-3"]) + extra, group=group)


# Miles's launchers pass these Megatron-LM switches (Inkling's among them); Megatron-LM's args hold them negated
MILES_FUSION_FLAGS = ["--no-masked-softmax-fusion", "--no-rope-fusion", "--no-bias-dropout-fusion",
                      "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--disable-bias-linear"]


def test_provider_params_are_built_in_the_trainers_dtype(provider_module, one_rank_group) -> None:
    """A provider that builds bf16 parameters (Megatron-LM's ``args.params_dtype`` under --bf16, as Miles's do on a
    GPU) gets them cast to the dtype miles's own build uses (fp32 masters): on an H100 (2026-12-07) such a model
    failed its first step with "attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype
    'BFloat16'" before the cast."""
    from megatron.core.parallel_state import destroy_model_parallel

    try:
        tr = _trainer(provider_module.HF_CHECKPOINT, [FLAG, "tiny_gpt_provider.bf16_params_provider",
                                                     *MILES_FUSION_FLAGS], one_rank_group)
        dtypes = {p.dtype for p in tr.model.parameters()}
        assert dtypes == {torch.float32}, dtypes
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("name", ["unfused_provider", "get_args_provider"])
def test_provider_model_trains_and_syncs(provider_module, one_rank_group, name: str) -> None:
    """``unfused_provider`` takes ``config`` (Megatron-LM's provider signature) and builds config.json's unpadded
    vocabulary; ``get_args_provider`` builds its own TransformerConfig from ``megatron.training.get_args()``, as
    Miles's providers do, with the padded vocabulary."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import destroy_model_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from trainer_harness import checkpoint_tensors, export_by_name, random_samples
    from transformers import AutoModelForCausalLM

    model_dir = provider_module.HF_CHECKPOINT
    try:
        tr = _trainer(model_dir, [FLAG, f"tiny_gpt_provider.{name}", *MILES_FUSION_FLAGS], one_rank_group)
        # called as Miles calls it: by keyword, vp_stage None, the whole model on this stage
        (built,) = provider_module.BUILT
        assert {k: built[k] for k in ("pre_process", "post_process", "vp_stage")} == {
            "pre_process": True, "post_process": True, "vp_stage": None}
        if name == "get_args_provider":         # Megatron-LM's args as Miles's providers read them
            args = built["args"]
            assert (args.hf_checkpoint, args.tensor_model_parallel_size, args.num_layers, args.padded_vocab_size,
                    args.masked_softmax_fusion, args.add_bias_linear, args.lr) == (
                str(model_dir), 1, 2, tr.padded_vocab, False, False, 3e-3)
        assert isinstance(tr.model, GPTModel)
        assert all(type(layer.self_attention.core_attention) is DotProductAttention for layer in tr.model.decoder.layers)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # the provider's own vocabulary rows: config.json's (unfused_provider) or padded to 128 (get_args_provider)
        vocab = hf.config.vocab_size
        padded = -(-vocab // 128) * 128
        assert padded != vocab and tr.padded_vocab == (vocab if name == "unfused_provider" else padded)
        ids = torch.randint(4, 90, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            tr.model.eval()
            hidden = tr.model(ids, torch.arange(7).expand(2, 7), attention_mask=None)      # [s, b, h]
            ours = (hidden.transpose(0, 1) @ tr.model.shared_embedding_or_output_weight().T).float()[..., :tr.vocab_size]
            theirs = hf(ids).logits
        # fp32 on CPU, unfused softmax attention vs transformers': max |diff| 1.49e-7 measured (this test, -s with a
        # print, torch 2.13 CPU); the bound is about twice that
        assert (ours - theirs).abs().max().item() < 3e-7
        tr.model.train()
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        metrics = tr.train(random_samples(2, 2, seed=1), rollout_id=0)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
        moved = [n for n, p in tr.model.named_parameters() if not torch.equal(p, before[n])]
        assert "embedding.word_embeddings.weight" in moved and any("linear_qkv" in n for n in moved)
        exported, ckpt = export_by_name(tr, 1 << 16), checkpoint_tensors(model_dir)
        assert sorted(exported) == sorted(ckpt)
        assert [n for n in ckpt if exported[n].shape != ckpt[n].shape] == []
        assert [n for n in ckpt if not torch.equal(exported[n], ckpt[n])]      # the trained weights are synced
    finally:
        destroy_model_parallel()


def test_provider_model_with_lora(provider_module, one_rank_group) -> None:
    """LoRA (--lora-rank, miles/trainer/lora.py) attaches to the provider's model by its module names: the base stays
    frozen, one step trains the adapters, and the synced (merged) weights move off the checkpoint's."""
    from megatron.core.parallel_state import destroy_model_parallel
    from trainer_harness import checkpoint_tensors, export_by_name, flags, random_samples

    model_dir = provider_module.HF_CHECKPOINT
    try:
        tr = _trainer(model_dir, flags("lora", [FLAG, "tiny_gpt_provider.get_args_provider", *MILES_FUSION_FLAGS]),
                      one_rank_group)
        assert tr.lora is not None and not any(p.requires_grad for p in tr.model.parameters())
        metrics = tr.train(random_samples(2, 2, seed=1), rollout_id=0)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
        exported, ckpt = export_by_name(tr, 1 << 16), checkpoint_tensors(model_dir)
        assert sorted(exported) == sorted(ckpt)
        moved = [n for n in ckpt if not torch.equal(exported[n], ckpt[n])]
        assert moved and all("proj" in n for n in moved), moved       # the adapted linears only
    finally:
        destroy_model_parallel()


def test_provider_builds_the_reference_and_the_critic(provider_module, one_rank_group) -> None:
    """PPO with a KL loss: the reference model and the critic's GPT are the provider's too (as Miles builds every role
    with it), and one step trains the critic."""
    from megatron.core.parallel_state import destroy_model_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from trainer_harness import flags, random_samples

    try:
        tr = _trainer(provider_module.HF_CHECKPOINT, flags("ppo", "kl", [FLAG, "tiny_gpt_provider.get_args_provider",
                                                                         *MILES_FUSION_FLAGS]), one_rank_group)
        assert len(provider_module.BUILT) == 3                  # the policy, the reference, the critic's GPT
        for gpt in (tr.model, tr.ref, tr.critic.model.gpt):
            assert type(gpt.decoder.layers[0].self_attention.core_attention) is DotProductAttention
        metrics = tr.train(random_samples(2, 2, seed=1), rollout_id=0)
        assert all(k in metrics and torch.isfinite(torch.tensor(metrics[k])) for k in ("value_loss", "kl_loss")), metrics
    finally:
        destroy_model_parallel()


def _tp2(rank: int, model_dir: str) -> tuple:
    """Rank ``rank`` of TP 2 + sequence parallelism with ``get_args_provider``: (export before training = the checkpoint bit for bit, max
    |logits - transformers'| over the vocabulary gathered from both TP ranks, the step's metrics finite, the export's
    names after it = the checkpoint's)."""
    import torch.distributed as dist
    from trainer_harness import build, checkpoint_tensors, export_by_name, flags, random_samples
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(PROVIDERS))
    tr = build(model_dir, flags("megatron_tp2", ["--sequence-parallel", "--lr", "3e-3", FLAG,
                                                 "tiny_gpt_provider.get_args_provider", *MILES_FUSION_FLAGS]),
               group=dist.group.WORLD)
    # megatron-core's torch norms, which refuse sequence parallelism, built as miles's own (summed over TP)
    norms = [p for n, p in tr.model.named_parameters() if n.endswith(("layernorm.weight", "final_layernorm.weight"))]
    assert norms and all(getattr(p, "sequence_parallel", False) for p in norms)
    ckpt = checkpoint_tensors(model_dir)
    before = export_by_name(tr, 1 << 16)
    bitwise = sorted(before) == sorted(ckpt) and all(torch.equal(before[n], ckpt[n]) for n in ckpt)
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    ids = torch.randint(4, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tr.model.eval()
        hidden = tr.model(ids, torch.arange(8).expand(2, 8), attention_mask=None)          # [s / 2, b, h]
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tr.groups.tp)
        shard = hidden.transpose(0, 1) @ tr.model.shared_embedding_or_output_weight().T    # this rank's vocab rows
        parts = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard.contiguous())
        ours = torch.cat(parts, dim=-1)[..., :tr.vocab_size]
        theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(ids).logits
    tr.model.train()
    metrics = tr.train(random_samples(2, 2, seed=1), rollout_id=0)
    finite = all(bool(torch.isfinite(torch.tensor(v))) for v in metrics.values() if isinstance(v, float))
    return bitwise, (ours - theirs).abs().max().item(), finite, sorted(export_by_name(tr, 1 << 16)) == sorted(ckpt)


def _tp2_worker(rank: int, port: int, scenario: str, q) -> None:
    from trainer_harness import gloo_rank, put_timed

    with gloo_rank(rank, port, q):
        put_timed(q, rank, lambda: _tp2(rank, scenario))


@pytest.mark.multiprocess
def test_provider_model_under_tensor_parallelism(provider_module, two_ranks) -> None:
    """TP 2 + sequence parallelism (2 gloo ranks): the provider's model is loaded sharded (the gathered export is the checkpoint bit for bit),
    its logits gathered over TP equal transformers', and one GRPO step runs."""
    out = two_ranks(_tp2_worker, str(provider_module.HF_CHECKPOINT))
    for rank in (0, 1):
        bitwise, diff, finite, names = out[rank][0] if isinstance(out[rank][0], tuple) else (out[rank][0],) * 4
        assert bitwise is True and finite is True and names is True, out
        # max |diff| 1.49e-7 measured on both ranks (this test with a print, -s, torch 2.13 CPU); bound twice that
        assert diff < 3e-7, out


@pytest.mark.parametrize("name,expect", [
    ("extra_param_provider", "no HF source for megatron parameter decoder.extra_scale"),
    ("not_a_gpt_provider", "returned a Linear, not a megatron-core GPTModel"),
    ("training_utils_provider", "imports 'megatron.training.arguments', which is not installed here (Megatron-LM's"),
    ("raising_provider", "raised ValueError: the provider's own check failed"),
])
def test_provider_refusals_in_the_trainer(provider_module, one_rank_group, name: str, expect: str) -> None:
    from megatron.core.parallel_state import destroy_model_parallel

    from miles.config.base import ConfigError

    try:
        with pytest.raises(ConfigError) as ei:
            _trainer(provider_module.HF_CHECKPOINT, [FLAG, f"tiny_gpt_provider.{name}"], one_rank_group)
    finally:
        destroy_model_parallel()
    msg = str(ei.value)
    assert msg.startswith(f"{FLAG} tiny_gpt_provider.{name}") and expect in msg and "\n" not in msg, msg


def _dry_run(model_dir, argv: list[str]) -> str:
    import json

    from miles.config import parse_args
    from miles.run.entry import dry_run

    data = Path(model_dir) / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "label": str(i + 1)}) + "\n" for i in range(4)))
    return dry_run(parse_args(["--hf-checkpoint", str(model_dir), "--train-backend", "megatron", "--prompt-data",
                               str(data), "--input-key", "prompt", "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "2",
                               "--n-samples-per-prompt", "2", "--colocate", "--output-dir",
                               str(Path(model_dir) / "out"), *argv, "--dry-run"]))


def test_dry_run_checks_the_provider(provider_module) -> None:
    from miles.config.base import ConfigError

    model_dir = provider_module.HF_CHECKPOINT
    assert "role plan" in _dry_run(model_dir, [FLAG, "tiny_gpt_provider.unfused_provider"])
    for path, expect in (("no_such_pkg.mod.provider", "cannot import module 'no_such_pkg.mod'"),
                         ("tiny_gpt_provider.missing", "has no attribute 'missing'"),
                         ("tiny_gpt_provider.needs_more_provider", "cannot be called as Miles calls a model provider "
                          "(post_process, pre_process by keyword, plus vp_stage and config where declared): missing a "
                          "required argument: 'model_args'")):
        with pytest.raises(ConfigError) as ei:
            _dry_run(model_dir, [FLAG, path])
        assert str(ei.value).startswith(FLAG) and expect in str(ei.value), ei.value
    with pytest.raises(ConfigError) as ei:
        _dry_run(model_dir, [FLAG, "tiny_gpt_provider.unfused_provider", "--pipeline-model-parallel-size", "2",
                             "--actor-num-gpus-per-node", "2"])
    assert "--pipeline-model-parallel-size 2 is not supported" in str(ei.value), ei.value
    with pytest.raises(ConfigError) as ei:
        _dry_run(model_dir, [FLAG, "tiny_gpt_provider.unfused_provider", "--train-backend", "fsdp"])
    assert str(ei.value).startswith(FLAG) and "needs --train-backend megatron" in str(ei.value), ei.value


def test_unknown_model_type_is_refused(provider_module, tmp_path: Path) -> None:
    """A checkpoint whose model_type has no converter here (a made-up ``inkling``: the released Inkling's is
    ``inkling_mm_model``) is refused: its weights could not be loaded nor synced."""
    from miles.config.base import ConfigError
    from miles.trainer.megatron.provider import preflight_check

    class Cfg:
        class megatron:            # noqa: N801 -- the config's section, as the preflight reads it
            custom_model_provider_path = "tiny_gpt_provider.unfused_provider"
            pipeline_model_parallel_size = mtp_num_layers = None

    with pytest.raises(ConfigError) as ei:
        preflight_check(Cfg, {"model_type": "inkling"})
    assert "model_type 'inkling' has no HF <-> Megatron weight converter here" in str(ei.value), ei.value


def _materialise(repo: Path, rev: str, out: Path) -> Path:
    """Miles's ``miles_plugins/`` at ``rev`` written under ``out`` (read from a checkout or a git directory)."""
    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", rev, "miles_plugins"],
                           check=True, capture_output=True, text=True, timeout=60).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{name}"], check=True, capture_output=True,
                              timeout=60).stdout
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(blob)
    return out


def test_miles_inkling_provider_is_refused_naming_what_is_missing(monkeypatch, request, tmp_path: Path) -> None:
    """Miles's Inkling provider module (radixark/miles@v0.1.0:miles_plugins/models/inkling/model.py) imports
    transformer-engine at module level (its layers: TE linears and norms); without it, importing the module is
    refused naming it (a command's path to it is not imported: it names the Inkling family, ``specs.PROVIDERS``)."""
    if not MILES_REPO:
        pytest.skip("MILES_REPO (a Miles checkout or git directory) is not set: Miles's Inkling provider is not read")
    from miles.config.base import ConfigError
    from miles.trainer.megatron.provider import load_provider

    root = _materialise(Path(MILES_REPO), MILES_REV, tmp_path / "miles")
    monkeypatch.syspath_prepend(str(root))
    request.addfinalizer(_drop_stand_in)
    request.addfinalizer(lambda: [sys.modules.pop(m) for m in list(sys.modules) if m.startswith("miles_plugins")])
    path = "miles_plugins.models.inkling.model.inkling_model_provider"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError) as ei:
            load_provider(path)
        assert str(ei.value).startswith(f"{FLAG} {path}: module 'miles_plugins.models.inkling.model' imports "
                                        "'transformer_engine', which is not installed here"), ei.value
    else:
        pytest.skip("transformer-engine imports here: Inkling's remaining needs (megatron.training, triton) differ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["unfused_provider", "get_args_provider"])
def test_provider_model_trains_on_gpu(provider_module, tmp_path: Path, name: str) -> None:
    """On a GPU (one NCCL rank, bf16 by default there): the provider's model is built on the GPU, one GRPO step gives
    finite metrics and moves its weights, and the export holds the checkpoint's names and shapes."""
    import torch.distributed as dist
    from megatron.core.parallel_state import destroy_model_parallel
    from trainer_harness import build, checkpoint_tensors, export_by_name, flags, random_samples

    model_dir = provider_module.HF_CHECKPOINT
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        tr = build(model_dir, flags("megatron", ["--lr", "3e-3", FLAG, f"tiny_gpt_provider.{name}",
                                                 *MILES_FUSION_FLAGS]), group=dist.group.WORLD, device="cuda:0")
        assert tr.bf16 and all(p.device.type == "cuda" for p in tr.model.parameters())
        before = {n: p.detach().float().cpu() for n, p in tr.model.named_parameters()}
        metrics = tr.train(random_samples(2, 2, seed=1), rollout_id=0)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float)), metrics
        assert any(not torch.equal(p.detach().float().cpu(), before[n]) for n, p in tr.model.named_parameters())
        exported, ckpt = export_by_name(tr, 1 << 16), checkpoint_tensors(model_dir)
        assert sorted(exported) == sorted(ckpt)
        assert [n for n in ckpt if exported[n].shape != ckpt[n].shape] == []
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
