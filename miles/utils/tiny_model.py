"""Build tiny HF models and tokenizers locally (no hub): for tests, examples and benchmarks.

    build_tiny_model("/tmp/m", hidden_size=64, num_layers=2)  # Qwen3 architecture, random init

The tokenizer is a character-level ``PreTrainedTokenizerFast`` over printable ASCII plus special
tokens, with a ChatML-style chat template, so prompts round-trip exactly and token ids are stable.
``build_tiny_causal_lm`` is what every family's tiny builder (``tiny_<family>.py``) does around its own config:
the tokenizer, the config's token fields, the seeded init, the parts redrawn, the save.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: str | Path | None = None, fixed_ids: dict[str, int] | None = None):
    """A character-level tokenizer: ids 0-3 are special, then one id per printable character. ``fixed_ids``:
    further special tokens at the given ids (e.g. a real checkpoint's vision tokens, ids far past the others)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    fixed = dict(fixed_ids or {})
    if set(fixed) & set(vocab) or set(fixed.values()) & set(vocab.values()):
        raise ValueError(f"fixed_ids {fixed} collide with the character vocabulary (ids 0-{len(vocab) - 1})")
    vocab.update(fixed)              # the model's vocabulary holds them: add_special_tokens keeps these ids
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>", unk_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *fixed],
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_causal_lm(out_dir: str | Path, config_cls, model_cls, *, seed: int = 0, dtype: str = "float32",
                         init: Callable[[Any], None] | None = None, **config: Any) -> Path:
    """Write a randomly initialised ``model_cls(config_cls(**config))`` plus the tiny tokenizer to ``out_dir``: the
    config gets the tokenizer's vocabulary size and special ids (no BOS) and ``dtype``; the weights are drawn under
    ``seed``, then ``init(model)`` (under ``no_grad``) redraws what transformers starts at constants (routers, biases,
    norms) so that each part changes the output; saved in ``dtype`` as safetensors."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    cfg = config_cls(**config, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    if init is not None:
        with torch.no_grad():
            init(model)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _shape_kwargs(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                  max_position_embeddings: int, tie_word_embeddings: bool) -> dict:
    """The Qwen3 config fields both tiny builders share (attention shape, embeddings)."""
    return dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings)


def build_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised Qwen3-architecture causal LM plus tokenizer to ``out_dir``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return build_tiny_causal_lm(
        out_dir, Qwen3Config, Qwen3ForCausalLM, seed=seed, dtype=dtype,
        intermediate_size=intermediate_size or hidden_size * 3,
        **_shape_kwargs(hidden_size, num_layers, num_heads, num_kv_heads, max_position_embeddings, tie_word_embeddings))


def build_tiny_moe_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (),
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised Qwen3-MoE causal LM (``Qwen3MoeForCausalLM``: a top-k softmax router and
    ``num_experts`` SwiGLU experts per layer, dense MLPs on ``mlp_only_layers``) plus tokenizer to ``out_dir``.
    ``norm_topk_prob`` True (renormalised top-k weights) and untied embeddings, as Qwen3-30B-A3B."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def init(model) -> None:         # transformers initialises the router to zeros: a random, distinct routing
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0.0, 0.5)

    return build_tiny_causal_lm(
        out_dir, Qwen3MoeConfig, Qwen3MoeForCausalLM, seed=seed, dtype=dtype, init=init,
        intermediate_size=hidden_size * 3, moe_intermediate_size=moe_intermediate_size, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, norm_topk_prob=norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        **_shape_kwargs(hidden_size, num_layers, num_heads, num_kv_heads, max_position_embeddings, tie_word_embeddings))
