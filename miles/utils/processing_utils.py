"""Miles's ``miles.utils.processing_utils``: tokenizer and processor loading, and images as the engines take them.

- ``load_tokenizer(name_or_path, chat_template_path=None, **kwargs)``: the checkpoint's tokenizer (cached per
  arguments), with the Jinja chat template of ``chat_template_path`` when given. A local directory whose tokenizer
  does not load is one line naming it; anything else is passed to transformers.
- ``load_processor(name_or_path, **kwargs)``: the checkpoint's multimodal processor, None for a text-only model.
- ``encode_image_for_rollout_engine(image)``: a PIL image as the ``data:image/png;base64,...`` SGLang's
  ``image_data`` takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.utils.images import png_data_uri
from miles.utils.logging import get_logger
from miles.utils.model_dir import load_tokenizer as _load_checked_tokenizer

logger = get_logger(__name__)

_TOKENIZERS: dict[tuple[Any, ...], Any] = {}


def load_tokenizer(name_or_path: str, chat_template_path: str | None = None, **kwargs: Any) -> Any:
    """The tokenizer of ``name_or_path`` (see the module docstring); the same object for the same arguments."""
    try:
        key: tuple[Any, ...] | None = (str(name_or_path), chat_template_path, tuple(sorted(kwargs.items())))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _TOKENIZERS:
        return _TOKENIZERS[key]
    if Path(name_or_path).is_dir() and not kwargs:
        tokenizer = _load_checked_tokenizer(name_or_path, flag=None, check=False)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), **kwargs)
    if chat_template_path:
        template = Path(chat_template_path)
        if not template.is_file():
            raise FileNotFoundError(f"chat_template_path {chat_template_path} is not a file; give the path of a Jinja "
                                    "chat template readable on this node")
        tokenizer.chat_template = template.read_text()
        logger.info("loaded the chat template of %s", chat_template_path)
    if key is not None:
        _TOKENIZERS[key] = tokenizer
    return tokenizer


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    """The multimodal processor of ``name_or_path``; None when it has none (a text-only model)."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    try:
        proc = AutoProcessor.from_pretrained(str(name_or_path), **kwargs)
    except (OSError, ValueError) as e:
        logger.warning("no processor loads from %s: %s", name_or_path, str(e).splitlines()[0] if str(e) else e)
        return None
    return None if isinstance(proc, PreTrainedTokenizerBase) or not isinstance(proc, ProcessorMixin) else proc


def encode_image_for_rollout_engine(image: Any) -> str:
    """A PIL image as ``data:image/png;base64,...`` of its RGB pixels."""
    return png_data_uri(image)
