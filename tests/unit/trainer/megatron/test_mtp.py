"""Multi-token prediction flags (miles/trainer/megatron/mtp.py): Miles's defaults, the one-line refusals of bad
combinations (checked when the flags are parsed, at the dry run against config.json, and when the checkpoint is
read), the HF <-> megatron-core names of the MTP layer, and the embedded engine skipping the MTP layer's tensors.
The model, the weight round trip and the training are tested on gloo ranks in tests/multiprocess/test_megatron_mtp.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import convert, mtp, options
from miles.trainer.megatron.model import ModelShape


@pytest.fixture(scope="module")
def glm_mtp_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_mla import build_tiny_mla_model

    return build_tiny_mla_model(tmp_path_factory.mktemp("glm_mtp") / "m", mtp_layers=1)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_mla import build_tiny_mla_model

    return build_tiny_mla_model(tmp_path_factory.mktemp("glm") / "m")


def _cfg(model: Path, *extra: str, backend: str = "megatron"):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", backend, *extra])


def _refused(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _shape(d: Path) -> ModelShape:
    from transformers import AutoConfig

    return options.shape_of(AutoConfig.from_pretrained(d))


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def test_flags_parse_with_miles_defaults(glm_mtp_dir: Path) -> None:
    m = _cfg(glm_mtp_dir).megatron
    assert (m.mtp_num_layers, m.mtp_loss_scaling_factor, m.enable_mtp_training) == (None, None, False)
    o = options.resolve(m)
    assert (o.mtp_num_layers, o.mtp_training, o.mtp_loss_scale) == (0, False, 0.2)
    cfg = _cfg(glm_mtp_dir, "--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.1")
    o = options.resolve(cfg.megatron)
    assert (o.mtp_num_layers, o.mtp_training, o.mtp_loss_scale) == (1, True, 0.1)
    options.preflight_check(cfg, _config(glm_mtp_dir))                 # config.json's num_nextn_predict_layers 1
    assert _shape(glm_mtp_dir).nextn_layers == 1


def test_bad_combinations_are_one_line(glm_mtp_dir: Path, glm_dir: Path, tiny_model_dir: Path) -> None:
    assert _refused(lambda: _cfg(glm_mtp_dir, "--enable-mtp-training")).startswith(
        "--enable-mtp-training needs --mtp-num-layers N")
    assert _refused(lambda: _cfg(glm_mtp_dir, "--enable-mtp-training", backend="fsdp")).startswith(
        "--enable-mtp-training needs --train-backend megatron")
    assert _refused(lambda: _cfg(glm_mtp_dir, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-1")).startswith(
        "--mtp-loss-scaling-factor must be a finite number >= 0, got -1")
    assert _refused(lambda: _cfg(glm_mtp_dir, "--mtp-num-layers", "0")).startswith("--mtp-num-layers must be positive")
    msg = _refused(lambda: options.preflight_check(_cfg(glm_mtp_dir, "--mtp-num-layers", "2"), _config(glm_mtp_dir)))
    assert msg.startswith("--mtp-num-layers 2 does not match --hf-checkpoint's config.json (num_nextn_predict_layers "
                          "1)") and "pass --mtp-num-layers 1" in msg, msg
    msg = _refused(lambda: options.preflight_check(_cfg(glm_dir, "--mtp-num-layers", "1"), _config(glm_dir)))
    assert "(num_nextn_predict_layers 0)" in msg and "drop the flag" in msg, msg
    dense = _config(tiny_model_dir) | {"num_nextn_predict_layers": 1}
    assert dense["tie_word_embeddings"]
    msg = _refused(lambda: options.preflight_check(
        _cfg(tiny_model_dir, "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"), dense))
    assert msg.startswith("--mtp-num-layers 1 with --pipeline-model-parallel-size 2 and tied embeddings (config.json's "
                          "tie_word_embeddings true) is not supported"), msg
    options.preflight_check(_cfg(tiny_model_dir, "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"),
                            dense | {"tie_word_embeddings": False})     # built: the block on the last stage
    options.preflight_check(_cfg(tiny_model_dir, "--mtp-num-layers", "1", "--context-parallel-size", "2"), dense)  # built


def test_checkpoint_without_its_mtp_layer_is_refused(glm_dir: Path) -> None:
    """config.json says num_nextn_predict_layers 1, the safetensors lack the layer (as the sparse dry-run models)."""
    import dataclasses

    shape = dataclasses.replace(_shape(glm_dir), nextn_layers=1, mtp_num_layers=1)
    msg = _refused(lambda: mtp.check_mtp_tensors(convert.read_hf_state_dict(glm_dir), shape))
    assert msg.startswith("--mtp-num-layers 1: --hf-checkpoint has no model.layers.3.enorm.weight"), msg


def test_mtp_names_round_trip(glm_mtp_dir: Path) -> None:
    """Every HF tensor of the MTP layer maps to one megatron-core MTP name and back, bit for bit (TP 1 tensors)."""
    import dataclasses

    shape = dataclasses.replace(_shape(glm_mtp_dir), mtp_num_layers=1)
    hf = convert.read_hf_state_dict(glm_mtp_dir)
    names = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
             "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.input_layernorm.weight",
             "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight",
             "mtp.layers.0.transformer_layer.mlp.router.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
             "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight",
             "mtp.layers.0.transformer_layer.mlp.experts.local_experts.2.linear_fc1.weight"]
    full = convert.hf_to_megatron(hf, shape, 128, names)
    back = dict(pair for n in names for pair in convert.megatron_to_hf(n, full[n], shape))
    assert all(k.startswith("model.layers.3.") for k in back) and len(back) == 12, sorted(back)
    assert all(torch.equal(back[k], hf[k]) for k in back)
    assert convert.partition_dim("mtp.layers.0.eh_proj.weight") == 0          # column-parallel, as megatron-core's
    emb = convert.megatron_to_hf("embedding.word_embeddings.weight", torch.zeros(128, 64), shape)
    assert [n for n, _ in emb] == ["model.embed_tokens.weight", "model.layers.3.embed_tokens.weight"]


def test_engine_skips_the_mtp_layer(glm_mtp_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.engine.model_runner import ParamIndex
    from miles.engine.weights import WeightUpdateError, load_from_disk, mtp_layer_names

    model = AutoModelForCausalLM.from_pretrained(glm_mtp_dir)
    live = ParamIndex(model.state_dict(keep_vars=True))          # the engine's index of its HF tensors
    is_mtp = mtp_layer_names(AutoConfig.from_pretrained(glm_mtp_dir))
    assert is_mtp("model.layers.3.eh_proj.weight") and not is_mtp("model.layers.2.mlp.gate.weight")
    state = load_from_disk(str(glm_mtp_dir), live, is_mtp)
    assert not any(n.startswith("model.layers.3.") for n in state) and "model.layers.2.mlp.gate.weight" in state
    with pytest.raises(WeightUpdateError, match="model.layers.3."):
        load_from_disk(str(glm_mtp_dir), live)                  # without the skip: refused as unknown tensors


def test_engine_weight_update_skips_the_mtp_layer(glm_mtp_dir: Path) -> None:
    """A weight update (tensor / distributed sync) from a trainer carrying the MTP block: the main model's tensors
    load, the MTP layer's are skipped, not refused (an unknown name still is)."""
    from safetensors.torch import load_file

    from miles.engine.model_runner import ModelRunner, RunnerOptions

    runner = ModelRunner(glm_mtp_dir, RunnerOptions(max_running_requests=2, max_context_len=32, max_total_tokens=64))
    disk = load_file(str(glm_mtp_dir / "model.safetensors"))
    update = {n: t + 1.0 for n, t in disk.items() if n.startswith(("model.layers.3.", "model.layers.2.input_"))}
    assert runner.load_tensors(update) == 1
    assert torch.equal(runner.named_tensors()["model.layers.2.input_layernorm.weight"],
                       update["model.layers.2.input_layernorm.weight"])
    with pytest.raises(ValueError, match="unknown parameter name 'model.layers.9.x'"):
        runner.load_tensors({"model.layers.9.x": torch.zeros(1)})


def test_engine_delta_update_skips_the_mtp_layer(glm_mtp_dir: Path, tmp_path: Path) -> None:
    """A disk-delta version written by a trainer carrying the MTP block (its tensors xor-encoded against the
    base): the engine applies the main model's changes and skips the MTP layer's, which it does not hold."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles.engine.weights import load_from_disk, mtp_layer_names
    from miles.weight_sync.disk_delta import DeltaError, write_version

    base = load_file(str(glm_mtp_dir / "model.safetensors"))
    new = {n: (t + 1.0 if n.startswith(("model.layers.3.", "model.layers.2.input_")) else t) for n, t in base.items()}
    d = write_version(tmp_path, 1, new.items(), baseline=base, encoding="xor")
    is_mtp = mtp_layer_names(AutoConfig.from_pretrained(glm_mtp_dir))
    live = {n: t.clone() for n, t in base.items() if not is_mtp(n)}   # what the engine serves
    state = load_from_disk(str(d), live, is_mtp)
    assert not any(is_mtp(n) for n in state) and "model.layers.2.input_layernorm.weight" in state
    assert all(torch.equal(state[n], new[n]) for n in state)
    with pytest.raises(DeltaError, match="has no tensor 'model.layers.3."):
        load_from_disk(str(d), live)                                # without the skip: refused
