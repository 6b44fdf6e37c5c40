"""Kimi-K2.5 (``kimi_k25``) on the Megatron backend (miles/trainer/megatron/families/kimi_k25.py): the shape is the
text model's (``text_config``, DeepSeek-V3: MLA, YaRN, MoE), the HF <-> megatron-core converter reads and writes the
published checkpoint's names (``language_model.model.*``, ``language_model.lm_head.weight``) bit for bit at TP 1, 2
and 4, the tower's tensors are left to ``--save-hf``'s copy; Miles's Kimi-K2.5 shape flags are checked against
config.json; a checkpoint in another layout is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import tp_round_trip
from test_mla import _cfg, _megatron_names

from miles.config import ConfigError
from miles.trainer.megatron import convert, options

K25_JSON = Path(__file__).resolve().parents[3] / "fixtures" / "miles_scripts" / "models" / "Kimi-K2.5.json"


@pytest.fixture(scope="module")
def tiny_k25_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_kimi_k25 import build_tiny_kimi_k25

    return build_tiny_kimi_k25(tmp_path_factory.mktemp("tiny_k25"))


def _shape(d: Path):
    from miles.utils.model_dir import load_config

    return options.shape_of(load_config(d, "--hf-checkpoint"))


def test_shape_is_the_text_models(tiny_k25_dir: Path) -> None:
    shape = _shape(tiny_k25_dir)
    assert shape.model_type == "kimi_k25" and shape.family.name == "Kimi-K2.5" and not shape.vision
    assert shape.mla and (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_head_dim, shape.qk_pos_emb_head_dim,
                          shape.v_head_dim) == (24, 16, 12, 8, 10)
    assert shape.yarn == (64.0, 8.0, 32.0, 1.0, 1.0, 1.0) and shape.rotary_base == 50000.0
    assert shape.moe_layer_pattern == (0, 1, 1) and shape.num_experts == 4 and shape.moe_topk_scaling == 2.827
    assert not shape.tie_embeddings and shape.family.text_prefix(shape) == "language_model.model."


def test_shape_of_the_published_config() -> None:
    """moonshotai/Kimi-K2.5's shape (tests/fixtures/miles_scripts/models/Kimi-K2.5.json, text_config of model type
    kimi_k2): Miles's scripts/models/kimi-k25.py flags agree (the fixture megatron_kimi_k25 checks them all)."""
    from transformers import AutoConfig

    d = json.loads(K25_JSON.read_text())
    shape = options.shape_of(AutoConfig.for_model(d.pop("model_type"), **d))
    assert (shape.num_layers, shape.hidden_size, shape.num_experts, shape.moe_router_topk, shape.vocab_size) == (
        61, 7168, 384, 8, 163840)
    assert shape.yarn == (64.0, 4096.0, 32.0, 1.0, 1.0, 1.0) and shape.norm_epsilon == 1e-5
    assert not shape.tie_embeddings       # transformers' Kimi_K25Config defaults the outer flag to true
    d = json.loads(K25_JSON.read_text())
    d.pop("tie_word_embeddings")
    assert not options.shape_of(AutoConfig.for_model(d.pop("model_type"), **d)).tie_embeddings


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_bitwise_under_tp(tiny_k25_dir: Path, tp: int) -> None:
    """HF -> megatron (TP shards) -> HF gives the checkpoint's text model, names and bits; what it does not give is
    the tower and projector alone (copied by --save-hf as they are)."""
    from safetensors.torch import load_file

    hf = load_file(str(tiny_k25_dir / "model.safetensors"))
    shape = _shape(tiny_k25_dir)
    _, pairs = tp_round_trip(hf, shape, _megatron_names(shape), tp)
    back: dict[str, torch.Tensor] = {}
    for k, t in pairs:
        assert k not in back, k
        back[k] = t
    text = {k for k in hf if k.startswith("language_model.")}
    assert back.keys() == text and all(back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]) for k in text)
    assert "language_model.lm_head.weight" in back and "language_model.model.layers.2.mlp.experts.3.up_proj.weight" in back
    assert {k.split(".")[0] for k in set(hf) - text} == {"vision_tower", "mm_projector", "model"}   # the towers
    assert all(k.startswith(("vision_tower.", "mm_projector.", "model.mm_projector.")) for k in set(hf) - text)


def test_another_layout_is_refused_in_one_line(tiny_k25_dir: Path) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(tiny_k25_dir / "model.safetensors"))
    native = {"model." + k[len("language_model.model."):].replace("layers.", "language_model.layers.", 1)
              if k.startswith("language_model.model.") else k: v for k, v in hf.items()}
    shape = _shape(tiny_k25_dir)
    with pytest.raises(ConfigError) as e:
        convert.hf_to_megatron(native, shape, 128, ["embedding.word_embeddings.weight"])
    msg = str(e.value)
    assert msg.startswith("--hf-checkpoint: a Kimi-K2.5 (kimi_k25) checkpoint keeps its text model under "
                          "language_model.model.*") and "\n" not in msg, msg


# the shape flags of Miles's scripts/models/kimi-k25.py (radixark/miles@v0.1.0), sizes the tiny model's
K25_FLAGS = ["--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "4",
             "--kv-channels", "64", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rope-type",
             "yarn", "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size",
             "105", "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12",
             "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10", "--qk-layernorm", "--rotary-scaling-factor", "64.0",
             "--rotary-base", "50000", "--original-max-position-embeddings", "8", "--beta-fast", "32", "--beta-slow",
             "1", "--mscale", "1.0", "--mscale-all-dim", "1.0", "--disable-bias-linear", "--num-experts", "4",
             "--moe-layer-freq", "[0,1,1]", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2",
             "--moe-shared-expert-intermediate-size", "24", "--moe-router-score-function", "sigmoid",
             "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.827"]


def test_miles_shape_flags_accepted_and_checked(tiny_k25_dir: Path) -> None:
    from test_mla import _read, _with

    options.preflight_check(_cfg(tiny_k25_dir, *K25_FLAGS), _read(tiny_k25_dir))
    for changes, message in (({"beta_fast": "1"}, "--beta-fast 1.0 does not match --hf-checkpoint's config.json "
                                                  "(rope_scaling beta_fast 32.0)"),
                             ({"q_lora_rank": "1536"}, "--q-lora-rank 1536 does not match --hf-checkpoint's "
                                                       "config.json (q_lora_rank 24)")):
        with pytest.raises(ConfigError) as e:
            options.preflight_check(_cfg(tiny_k25_dir, *_with(K25_FLAGS, **changes)), _read(tiny_k25_dir))
        assert str(e.value).startswith(message), str(e.value)


def test_model_name_names_kimi_k25(tiny_k25_dir: Path) -> None:
    """--model-name (Miles's converter pick; checked against config.json by run/preflight.check_model_name, both
    backends): Miles's recorded kimi_k25 and the config class name the checkpoint; a name of another model, Kimi-K2's
    included, is one line."""
    from test_mla import _read

    from miles.run.preflight import check_model_name

    for name in ("kimi_k25", "Kimi_K25Config"):
        check_model_name(name, _read(tiny_k25_dir))
    for name in ("deepseekv3", "kimi_k2"):
        with pytest.raises(ConfigError) as e:
            check_model_name(name, _read(tiny_k25_dir))
        assert str(e.value).startswith(f"--model-name {name} does not name --hf-checkpoint's model (config.json "
                                       "model_type kimi_k25)") and "\n" not in str(e.value), e.value
