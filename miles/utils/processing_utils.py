"""Miles's ``miles.utils.processing_utils``: tokenizer and processor loading, and images as the engines take them.

- ``load_tokenizer(name_or_path, chat_template_path=None, **kwargs)``: the checkpoint's tokenizer (cached per
  arguments), with the Jinja chat template of ``chat_template_path`` when given. A local directory whose tokenizer
  does not load is one line naming it; anything else is passed to transformers.
- ``load_processor(name_or_path, **kwargs)``: the checkpoint's multimodal processor, None for a text-only model. Where
  one of its sub-processors needs a package not installed here (Qwen-VL's video processor needs torchvision), it is
  the checkpoint's processor class with its tokenizer and image processor only (images are the media supported here).
- ``checkpoint_processor(path)``: ``load_processor`` once per checkpoint directory (what ``GenerateState(args)
  .processor`` is, as Miles's GenerateState loads it once); None without a processor or image processor config.
- ``encode_image_for_rollout_engine(image)``: a PIL image as the ``data:image/png;base64,...`` SGLang's
  ``image_data`` takes.
"""

from __future__ import annotations

from functools import lru_cache
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
    except ImportError as e:  # a sub-processor's package is missing (Qwen-VL's video processor: torchvision)
        proc = _images_only_processor(str(name_or_path), e, **kwargs)
    except (OSError, ValueError) as e:
        logger.warning("no processor loads from %s: %s", name_or_path, str(e).splitlines()[0] if str(e) else e)
        return None
    return None if isinstance(proc, PreTrainedTokenizerBase) or not isinstance(proc, ProcessorMixin) else proc


def _images_only_processor(path: str, missing: ImportError, **kwargs: Any) -> Any:
    """The checkpoint's processor class (AutoProcessor's choice for its model type) with its tokenizer and image
    processor only, for when another sub-processor needs a package not installed; None when there is no such class."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        model_type = AutoConfig.from_pretrained(path, **kwargs).model_type
    except (OSError, ValueError):
        return None
    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(model_type) or "", None)
    keep = ("tokenizer", "image_processor")
    if cls is None or not set(keep) <= set(cls.get_attributes()):
        logger.warning("no processor loads from %s: %s", path, _first_sentence(missing))
        return None
    attributes = [a for a in cls.get_attributes() if a in keep]  # in the class's order (its __init__ passes them so)

    def __call__(self: Any, *args: Any, **call_kwargs: Any) -> Any:
        # the image tensors as torch tensors, as the torchvision-backed image processor gives them (this one, without
        # torchvision, would give numpy arrays), unless the caller asks for a tensor type
        if "return_tensors" not in call_kwargs:
            call_kwargs["images_kwargs"] = {"return_tensors": "pt", **call_kwargs.get("images_kwargs", {})}
        return cls.__call__(self, *args, **call_kwargs)

    images_only = type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda c: list(attributes)),
                                              "__call__": __call__})
    tokenizer = load_tokenizer(path, **kwargs)
    others = {a: None for a in cls.get_attributes() if a not in keep}  # e.g. video_processor: not set, not called
    try:
        proc = images_only(tokenizer=tokenizer, image_processor=AutoImageProcessor.from_pretrained(path, **kwargs),
                           chat_template=tokenizer.chat_template, **others)
    except (TypeError, ValueError, ImportError, OSError) as e:
        logger.warning("no processor loads from %s: %s; %s without it: %s", path, _first_sentence(missing),
                       cls.__name__, _first_sentence(e))
        return None
    logger.info("processor of %s: %s with its tokenizer and image processor only (%s)", path, cls.__name__,
                _first_sentence(missing))
    return proc


def _first_sentence(e: BaseException) -> str:
    return " ".join(str(e).split()).split(". ")[0]


@lru_cache(maxsize=8)
def checkpoint_processor(path: str) -> Any:
    """:func:`load_processor` of a checkpoint directory, loaded once; None for a directory with neither
    ``processor_config.json`` nor ``preprocessor_config.json`` (a text-only model, for which AutoProcessor gives a
    tokenizer) and for a path that is no directory."""
    root = Path(path)
    if not any((root / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        return None
    return load_processor(path)


def encode_image_for_rollout_engine(image: Any) -> str:
    """A PIL image as ``data:image/png;base64,...`` of its RGB pixels."""
    return png_data_uri(image)
