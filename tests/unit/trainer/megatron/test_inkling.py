"""Inkling's text model on the Megatron backend without ranks: the shape of its config.json, the HF <-> Megatron
conversion (bitwise round trip under TP, the TP layout of its own tensors, the unpadded vocabulary), one line for
what is not built. Parity with transformers: tests/multiprocess/test_megatron_inkling.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _tp_round_trip import round_trip_under_tp

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options
from miles.trainer.megatron.convert import hf_to_megatron, megatron_to_hf, partition_dim, shard
from miles.trainer.megatron.families import inkling

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tiny_inkling_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_inkling import build_tiny_inkling_model

    return build_tiny_inkling_model(tmp_path_factory.mktemp("tiny_inkling"))


def _config(model: Path, **change) -> dict:
    return json.loads((model / "config.json").read_text()) | change


def _shape(config: dict):
    from transformers import AutoConfig

    d = dict(config)
    return options.shape_of(AutoConfig.for_model(d.pop("model_type"), **d))


def _megatron_names(shape) -> list[str]:
    """Every parameter and exported buffer of the Inkling build, by its megatron name."""
    attn = ["input_layernorm.weight", "attn_conv.weight", "pre_mlp_layernorm.weight", "mlp_conv.weight"] + [
        f"self_attention.{n}" for n in ("linear_q.weight", "linear_k.weight", "linear_v.weight", "linear_r.weight",
                                        "linear_proj.weight", "k_conv.weight", "v_conv.weight",
                                        "q_layernorm.weight", "k_layernorm.weight", "rel_logits.proj")]
    dense = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.global_scale"]
    moe = ["mlp.router.weight", "mlp.router.global_scale", "mlp.router.expert_bias", "mlp.experts.gate_up_proj",
           "mlp.experts.down_proj", "mlp.sink_experts.gate_up_proj", "mlp.sink_experts.down_proj"]
    names = ["embedding.word_embeddings.weight", "embedding_norm.weight"]
    for i, sparse in enumerate(shape.moe_layer_pattern):
        names += [f"decoder.layers.{i}.{n}" for n in attn + (moe if sparse else dense)]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]


def test_shape_of_the_tiny_config(tiny_inkling_dir: Path) -> None:
    shape = _shape(_config(tiny_inkling_dir))
    g = shape.variant
    assert shape.family is inkling.FAMILY and shape.moe_layer_pattern == (0, 1, 1) and shape.num_experts == 4
    assert g.sliding == (True, False, True) and (g.swa_heads, g.swa_kv_heads, g.swa_head_dim) == (6, 2, 8)
    assert (shape.num_attention_heads, shape.num_query_groups, shape.kv_channels) == (4, 2, 12)
    assert g.mup_width_multiplier == 4.0 and g.route_scale == 2.5 and shape.moe_topk_scaling == 1.0 and g.n_shared_experts == 2


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bitwise_under_tp(tiny_inkling_dir: Path, tp: int) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(tiny_inkling_dir / "model.safetensors"))
    shape = _shape(_config(tiny_inkling_dir))
    full = round_trip_under_tp(hf, shape, _megatron_names(shape), tp)
    # the TP layout of Inkling's own tensors: K / V rows and their convolutions' channels by KV head, the relative
    # states by query head; the experts and the relative profiles whole on every rank
    for name, hf_name in (("decoder.layers.1.self_attention.linear_k.weight", "model.layers.1.self_attn.k_proj.weight"),
                          ("decoder.layers.0.self_attention.v_conv.weight",
                           "model.layers.0.self_attn.v_sconv.conv1d.weight"),
                          ("decoder.layers.2.self_attention.linear_r.weight", "model.layers.2.self_attn.r_proj.weight")):
        assert partition_dim(name) == 0
        assert torch.equal(shard(name, full[name], 0, tp - 1, tp, shape), hf[hf_name].chunk(tp)[-1]), name
    for name in ("decoder.layers.1.mlp.experts.gate_up_proj", "decoder.layers.1.mlp.sink_experts.gate_up_proj",
                 "decoder.layers.1.self_attention.rel_logits.proj", "decoder.layers.1.mlp.router.weight"):
        assert partition_dim(name) is None, name


@pytest.fixture(scope="module")
def published_inkling_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_inkling import build_tiny_inkling_model

    return build_tiny_inkling_model(tmp_path_factory.mktemp("tiny_inkling_mm"), published=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_published_layout_round_trip_is_bitwise_under_tp(published_inkling_dir: Path, tiny_inkling_dir: Path,
                                                         tp: int) -> None:
    """The released checkpoint's layout (``model.llm.*``, Thinking Machines' names, w13 interleaved: written by
    transformers' revert of its own load-time conversion): read into the same megatron tensors as the text layout's,
    split over TP and joined, exported (``export_stream``) under the checkpoint's names bit for bit; the tower tensor
    is left to ``--save-hf`` (``text_prefix``)."""
    from safetensors.torch import load_file

    from miles.trainer.megatron.convert import unshard
    from miles.trainer.megatron.model import padded_vocab_size

    native = load_file(str(published_inkling_dir / "model.safetensors"))
    shape = _shape(_config(published_inkling_dir))
    assert shape.model_type == "inkling_mm_model" and shape.family.text_prefix(shape) == "model.llm."
    names = _megatron_names(shape)
    padded = padded_vocab_size(shape.vocab_size, 128, tp)
    full = hf_to_megatron(native, shape, padded, names)
    text_layout = hf_to_megatron(load_file(str(tiny_inkling_dir / "model.safetensors")),
                                 _shape(_config(tiny_inkling_dir)), padded, names)
    assert all(torch.equal(full[n], text_layout[n]) for n in names)
    pairs = []
    for name in names:
        dim = partition_dim(name)
        pieces = [shard(name, full[name], dim, r, tp, shape) for r in range(tp)]
        pairs += megatron_to_hf(name, unshard(name, pieces, dim, shape), shape)
    back = dict(p for bucket in shape.family.export_stream(iter([pairs]), shape) for p in bucket)
    towers = {k for k in native if not k.startswith("model.llm.")}
    assert towers == {"model.visual.layers.linear_0.weight"} and back.keys() == native.keys() - towers
    assert all(back[k].dtype == native[k].dtype and torch.equal(back[k], native[k]) for k in back)


def test_unpadded_vocabulary_is_cut_and_padded_back(tiny_inkling_dir: Path) -> None:
    """``unpadded_vocab_size``: the shape's vocabulary is the unpadded one (transformers drops the other logits); the
    export gives the checkpoint's row count, the rows past it zero."""
    config = _config(tiny_inkling_dir)
    shape = _shape(config | {"unpadded_vocab_size": config["vocab_size"] - 5})
    assert shape.vocab_size == config["vocab_size"] - 5 and shape.variant.hf_vocab_size == config["vocab_size"]
    head = torch.randn(config["vocab_size"], config["hidden_size"])
    full = hf_to_megatron({"lm_head.weight": head}, shape, 128, ["output_layer.weight"])["output_layer.weight"]
    assert full.shape[0] == 128 and torch.equal(full[:shape.vocab_size], head[:-5]) and not full[shape.vocab_size:].any()
    (name, back), = megatron_to_hf("output_layer.weight", full, shape)
    assert name == "lm_head.weight" and torch.equal(back[:-5], head[:-5]) and not back[-5:].any()


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def test_vocab_size_flag_takes_the_checkpoint_rows_or_the_unpadded_vocabulary(tiny_inkling_dir: Path) -> None:
    """With ``unpadded_vocab_size`` < ``vocab_size`` (the shape's vocabulary is the unpadded one) ``--vocab-size``
    may give config.json's ``vocab_size``, as Miles's Inkling script does (``--vocab-size 201024``, the released
    config's; radixark/miles@v0.1.0 builds the model on that row count and cuts the head at ``unpadded_vocab_size``
    only when it exports), or the unpadded size; another value is one line naming both."""
    config = _config(tiny_inkling_dir)
    rows = config["vocab_size"]
    cut = config | {"unpadded_vocab_size": rows - 5}
    for value in (rows, rows - 5):
        options.preflight_check(_cfg(tiny_inkling_dir, "--vocab-size", str(value)), cut)
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_inkling_dir, "--vocab-size", str(rows - 3)), cut)
    assert str(ei.value) == (f"--vocab-size {rows - 3} does not match --hf-checkpoint's config.json (vocab_size "
                             f"{rows}, unpadded_vocab_size {rows - 5}): fix the flag or drop it (the model shape is "
                             "read from config.json)."), ei.value
    with pytest.raises(ConfigError) as ei:        # without unpadded_vocab_size: vocab_size only
        options.preflight_check(_cfg(tiny_inkling_dir, "--vocab-size", str(rows - 5)), config)
    assert str(ei.value).startswith(f"--vocab-size {rows - 5} does not match --hf-checkpoint's config.json "
                                    f"(vocab_size {rows})"), ei.value


@pytest.mark.parametrize("flags, change, message", [
    (["--expert-model-parallel-size", "3"], {}, "--expert-model-parallel-size 3 does not divide config.json's "
                                                "num_experts 4"),
    (["--pipeline-model-parallel-size", "2"], {}, "--pipeline-model-parallel-size 2 with Inkling is not supported"),
    (["--context-parallel-size", "2"], {}, "--context-parallel-size 2 with Inkling is not supported"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], {"swa_num_attention_heads": 5},
     "--tensor-model-parallel-size 2 does not divide config.json's swa_num_attention_heads 5"),
    (["--mtp-num-layers", "1"], {"num_mtp_layers": 1}, "--mtp-num-layers 1 with Inkling is not supported"),
    (["--hidden-dropout", "0.1"], {}, "--hidden-dropout 0.1 with Inkling is not supported"),
    (["--moe-grouped-gemm"], {}, "--moe-grouped-gemm with Inkling is not supported"),
    (["--moe-token-dispatcher-type", "flex"], {}, "--moe-token-dispatcher-type flex with Inkling is not supported by the "
                                                  "Megatron backend (its MoE is its own torch module and dispatches "
                                                  "tokens itself; DeepEP's fused dispatcher is not wired into it); use "
                                                  "alltoall (the default with expert parallelism) or allgather."),
    ([], {"hidden_act": "gelu"}, "--hf-checkpoint: Inkling hidden_act 'gelu' is not supported"),
    ([], {"shared_expert_sink": False}, "--hf-checkpoint: Inkling MoE without shared experts scored as a sink"),
])
def test_what_is_not_built_is_one_line(tiny_inkling_dir: Path, flags: list[str], change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_inkling_dir, *flags), _config(tiny_inkling_dir, **change))
    assert str(ei.value).startswith(message) and "\n" not in str(ei.value), ei.value


def test_tensor_parallel_with_sequence_parallel_is_accepted(tiny_inkling_dir: Path) -> None:
    options.preflight_check(_cfg(tiny_inkling_dir, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--position-embedding-type", "none", "--qk-layernorm", "--moe-aux-loss-coeff", "0"),
                            _config(tiny_inkling_dir))


def test_expert_parallelism_is_accepted(tiny_inkling_dir: Path) -> None:
    """EP 2 (alone and with TP 2 + SP) passes the preflight (the parity: tests/multiprocess/test_megatron_inkling.py),
    with either dispatcher Inkling's MoE runs: all-to-all (the default) and all-gather (its own pads the ranks' token
    counts, so the megatron-core families' refusal of allgather under EP, for RL's uneven micro-batches, is not
    Inkling's)."""
    for extra in ([], ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                  ["--moe-token-dispatcher-type", "alltoall"], ["--moe-token-dispatcher-type", "allgather"]):
        options.preflight_check(_cfg(tiny_inkling_dir, "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff",
                                     "0", "--actor-num-gpus-per-node", "4", *extra), _config(tiny_inkling_dir))


PROVIDER = "miles_plugins.models.inkling.model.inkling_model_provider"


def test_miles_inkling_provider_names_the_family(tiny_inkling_dir: Path, published_inkling_dir: Path,
                                                 tiny_model_dir: Path) -> None:
    """Miles's Inkling provider path (its recorded command's, ``miles.config.specs.PROVIDERS``) is not imported: it
    names the Inkling family, whose build runs in its place; on another checkpoint it is one line."""
    from miles.trainer.megatron.provider import preflight_check

    for model in (tiny_inkling_dir, published_inkling_dir):
        preflight_check(_cfg(model, "--custom-model-provider-path", PROVIDER), _config(model))
    with pytest.raises(ConfigError) as ei:
        preflight_check(_cfg(tiny_model_dir, "--custom-model-provider-path", PROVIDER), _config(tiny_model_dir))
    assert str(ei.value).startswith(f"--custom-model-provider-path {PROVIDER} is Miles's Inkling model provider "
                                    "(config.json model_type inkling_mm_model or inkling_text), but --hf-checkpoint's "
                                    "config.json has model_type qwen3") and "\n" not in str(ei.value), ei.value


def test_fsdp_policy_model_divides_by_the_mup_multiplier_and_never_packs(tiny_inkling_dir: Path) -> None:
    """The FSDP backend's log-prob head (``modeling.PolicyModel``) on transformers' ``InklingForCausalLM``: as right-
    padded rows its log-probs are transformers' own (its forward divides the final hidden states by
    ``logits_mup_width_multiplier`` before the head: measured 4.8e-7 apart, 10.4 without the division); the same two
    samples packed in one row differ (the short convolutions reach into the previous sample: measured 0.030), so
    Inkling is never packed (``modeling.NO_PACKING``)."""
    from transformers import AutoModelForCausalLM

    from miles.trainer import modeling

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_inkling_dir), dtype=torch.float32).eval()
    policy = modeling.PolicyModel(hf).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(4, 90, (9,), generator=g), torch.randint(4, 90, (6,), generator=g)
    with torch.no_grad():
        ref = [torch.log_softmax(hf(input_ids=s[None]).logits[0, :-1], -1).gather(-1, s[1:, None])[:, 0]
               for s in (a, b)]
        rows = torch.stack([a, torch.cat([b, b.new_zeros(3)])])
        pos = torch.arange(9).expand(2, -1)
        index = torch.cat([torch.arange(8), 9 + torch.arange(5)])
        targets = torch.cat([a[1:], b[1:]])
        cu = torch.tensor([0, 9, 15])
        as_rows, _ = policy(rows, pos, index, targets, cu, 9)
        packed, _ = policy(torch.cat([a, b])[None], torch.cat([torch.arange(9), torch.arange(6)])[None],
                           torch.cat([torch.arange(8), 9 + torch.arange(5)]), targets, cu, 9)
    assert float((as_rows - torch.cat(ref)).abs().max()) < 1e-6          # ~2x the measured 4.8e-7
    assert float((packed - torch.cat(ref)).abs().max()) > 1e-2          # measured 0.030
    assert "inkling_text" in modeling.NO_PACKING


def test_published_layout_on_fsdp_is_one_line(tmp_path: Path, one_rank_group) -> None:
    """The FSDP backend on the released layout (``inkling_mm_model``): transformers' ``InklingForConditionalGeneration``
    imports scipy while it builds its vision tower; without scipy the trainer's build is one line naming the flag,
    the checkpoint, the class, the package and the fix (``modeling.missing_package_error``: any transformers model
    class that imports a package not installed), not the ``ModuleNotFoundError`` traceback."""
    import importlib.util

    from trainer_harness import build

    from miles.utils.tiny_inkling import build_tiny_inkling_model

    if importlib.util.find_spec("scipy") is not None:
        pytest.skip("scipy is installed: transformers' Inkling multimodal class builds")
    path = build_tiny_inkling_model(tmp_path / "ink_mm", published=True)
    with pytest.raises(ConfigError) as e:
        build(path, ["--train-backend", "fsdp"], group=one_rank_group)
    assert str(e.value) == (f"--hf-checkpoint {path}: the FSDP backend builds this checkpoint with transformers' "
                            "InklingForConditionalGeneration (model_type inkling_mm_model), which needs the Python "
                            "package 'scipy', not installed; install it (pip install scipy) or add --train-backend "
                            "megatron."), e.value


def _dry_run(model: Path, *extra: str) -> str:
    from miles.run.entry import dry_run

    return dry_run(parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                               "--colocate", "--rm-type", "math", "--dry-run", *extra]))


def _fsdp_dry_run(model: Path, *extra: str) -> str:
    return _dry_run(model, "--train-backend", "fsdp", *extra)


def test_published_layout_on_fsdp_is_one_line_at_dry_run(published_inkling_dir: Path, tiny_inkling_dir: Path,
                                                         tmp_path: Path) -> None:
    """The same line as the trainer's build (above), from ``--dry-run`` (the FSDP backend's preflight,
    ``modeling.preflight_check``: transformers' Inkling vision tower imports scipy in ``plan_out_scales`` when it has
    fewer layers than scales, which ``miles.utils.build_imports.BUILD_IMPORTS`` runs without building the model). A checkpoint whose
    class needs nothing missing passes: the text layout, and the released layout with a tower of as many layers as
    scales (6 at patch size 40, temporal patch size 2), which transformers builds without scipy."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("scipy") is not None:
        pytest.skip("scipy is installed: transformers' Inkling multimodal class builds")
    expected = (f"--hf-checkpoint {published_inkling_dir}: the FSDP backend builds this checkpoint with transformers' "
                "InklingForConditionalGeneration (model_type inkling_mm_model), which needs the Python package "
                "'scipy', not installed; install it (pip install scipy) or add --train-backend megatron.")
    with pytest.raises(ConfigError) as e:
        _fsdp_dry_run(published_inkling_dir)
    assert str(e.value) == expected, e.value
    with pytest.raises(ConfigError) as e:       # the PPO critic's backbone (AutoModel: InklingModel), same tower
        _fsdp_dry_run(tiny_inkling_dir, "--advantage-estimator", "ppo", "--critic-load", str(published_inkling_dir))
    assert str(e.value) == expected.replace("--hf-checkpoint", "--critic-load").replace(
        "InklingForConditionalGeneration", "InklingModel"), e.value
    assert "role plan" in _fsdp_dry_run(tiny_inkling_dir)
    six = tmp_path / "ink_mm_6"
    shutil.copytree(published_inkling_dir, six)
    config = json.loads((six / "config.json").read_text())
    config["vision_config"]["n_layers"] = 6
    (six / "config.json").write_text(json.dumps(config))
    assert "role plan" in _fsdp_dry_run(six)


def test_published_layout_on_the_embedded_engine_is_one_line_at_dry_run(published_inkling_dir: Path,
                                                                       monkeypatch) -> None:
    """The embedded engine serves the released layout with transformers' ``InklingForConditionalGeneration`` (its
    generic path, ``build_imports.serving_class``), whose vision tower imports scipy while built, whatever trains it:
    the Megatron trainer builds its own Inkling (no transformers class, so no backend check sees the engine's), and
    the FSDP trainer's check does not run under ``--debug-rollout-only``. With scipy unimportable each run is refused
    at ``--dry-run`` in one line naming the flag, the class, the package and the fix (``preflight.check_embedded_model``:
    ``build_imports.check_embedded_engine_build``, the FSDP check's implementation), for ``--rollout-engine embedded``
    and for what auto picks without a GPU; the engine's own build gives the same line, not a traceback."""
    import sys

    from transformers import AutoConfig, AutoModelForImageTextToText

    from miles.engine.model_runner import ModelRunner
    from miles.engine.runner_options import RunnerOptions
    from miles.utils.build_imports import serving_class

    monkeypatch.setitem(sys.modules, "scipy", None)           # unimportable here, installed or not
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # auto picks the embedded engine
    line = (f"--hf-checkpoint {published_inkling_dir}: the embedded engine ({{why}}) builds this checkpoint with "
            "transformers' InklingForConditionalGeneration (model_type inkling_mm_model), which needs the Python "
            "package 'scipy', not installed; install it (pip install scipy) or use --rollout-engine sglang (SGLang "
            "installed, on GPU).")
    named, auto = "--rollout-engine embedded", "--rollout-engine auto chose it: no GPU, or SGLang not importable"
    for extra, why in ((["--train-backend", "megatron", "--rollout-engine", "embedded"], named),
                       (["--train-backend", "megatron"], auto),
                       (["--train-backend", "fsdp", "--debug-rollout-only", "--rollout-engine", "embedded"], named)):
        with pytest.raises(ConfigError) as e:
            _dry_run(published_inkling_dir, *extra)
        assert str(e.value) == line.format(why=why), (extra, e.value)
    with pytest.raises(ConfigError) as e:
        ModelRunner(published_inkling_dir, RunnerOptions(device="cpu"))
    assert str(e.value) == line.replace(" ({why})", ""), e.value
    # the class the preflight checks is the engine's for the VLM it serves with images too (Qwen3-VL)
    assert serving_class(AutoConfig.for_model("qwen3_vl")) is AutoModelForImageTextToText


def test_r2_training_forwards_replay_the_old_pass(tiny_inkling_dir: Path, group) -> None:
    """R2 (``--use-routing-replay``) on Inkling's router: the old log-prob pass records the routing, the routers are
    then shifted in place (each router's expert rows and bias rolled by one), and the 2 training steps' forwards
    still route as recorded; without R2 the (token, layer) pairs route otherwise (measured: all of them)."""
    from trainer_harness import build, flags, random_samples, spy_routing

    samples = random_samples(3, 2, seed=5, vocab=90)
    out = {}
    for flag in ("--use-routing-replay", None):
        tr = build(tiny_inkling_dir, flags("megatron", ["--rollout-batch-size", "3", "--micro-batch-size", "1",
                                                        "--lr", "1e-2", "--use-tis", "--moe-aux-loss-coeff", "0",
                                                        "--num-steps-per-rollout", "2", "--use-kl-loss",
                                                        "--kl-loss-coef", "0.01", *([flag] if flag else [])]),
                   group=group)
        tr.coalesce_tokens = lambda: 0          # one sample per forward: the spy reads the tokens in sample order
        seen = spy_routing(tr)
        prepare = tr._prepare

        def shifted_after_old_pass(smp, data, policy, prepare=prepare, tr=tr):
            got = prepare(smp, data, policy)
            with torch.no_grad():
                for router in (m for n, m in tr.model.named_modules() if n.endswith("mlp.router")):
                    e = router.expert_bias.shape[0]
                    router.weight[:e].copy_(router.weight[:e].roll(1, 0))
                    router.expert_bias.copy_(router.expert_bias.roll(1, 0))
            return got
        tr._prepare = shifted_after_old_pass
        tr.train(samples, 0)
        n = len(samples)
        old = {f["sid"][0]: f for f in seen[:n]}                     # the old log-prob pass
        bad = total = 0
        for f in seen[n:]:                                             # the training forwards of the 2 steps
            for layer, sets in f.items():
                if layer != "sid":
                    total += len(sets)
                    bad += sum(a != b for a, b in zip(sets, old[f["sid"][0]][layer]))
        out[flag] = (len(seen) - n, bad / max(total, 1))
    assert out["--use-routing-replay"] == (len(samples), 0.0)
    assert out[None][0] == len(samples) and out[None][1] > 0.5


@pytest.mark.parametrize("recompute", [["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"],
                                       ["--recompute-granularity", "full", "--recompute-method", "block",
                                        "--recompute-num-layers", "2"],
                                       ["--recompute-granularity", "selective"]], ids=["uniform", "block", "selective"])
def test_activation_recompute_trains_the_same(tiny_inkling_dir: Path, group, recompute: list[str],
                                              monkeypatch) -> None:
    """Activation recompute (Miles's Inkling command passes ``--recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1``): the decoder's layers (full) or the attention's [s, s] core (selective) recomputed in
    the backward by torch's checkpoint; one GRPO step gives the same update as without, bit for bit (measured)."""
    import torch.utils.checkpoint as ckpt
    from trainer_harness import build, export_by_name, flags, random_samples

    calls = []
    real = ckpt.checkpoint
    ours = ("_layers.<locals>.run", "InklingAttention._core")         # the decoder's recompute units

    def counted(fn, *a, **kw):
        if getattr(fn, "__qualname__", "").endswith(ours):
            calls.append(fn)
        return real(fn, *a, **kw)
    monkeypatch.setattr(ckpt, "checkpoint", counted)
    samples = random_samples(2, 2, seed=11, vocab=90)
    got = []
    for extra in ([], recompute):
        tr = build(tiny_inkling_dir, flags("megatron", ["--lr", "1e-2", "--moe-aux-loss-coeff", "0", *extra]),
                   group=group)
        assert tr.model.config.recompute_granularity == (extra[1] if extra else None)
        calls.clear()
        metrics = tr.train(samples, 0)
        got.append((metrics["grad_norm"], export_by_name(tr, 1 << 20), len(calls)))
    (g0, w0, n0), (g1, w1, n1) = got
    assert n0 == 0 and n1 > 0, (n0, n1)                    # the recompute ran (torch's checkpoint called)
    assert g0 == g1 and w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0), g0 - g1
