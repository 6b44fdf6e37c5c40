"""Checks of a local HF model directory before anything loads it; each failure is one line naming the flag.

    check_model_dir(path, "--hf-checkpoint", tokenizer=True)   # raises ModelDirError (a ValueError too)
    num_params(path)                                           # from the safetensors headers, no tensor read
    load_config(path, flag) / load_tokenizer(path, flag)       # transformers' loaders, failures as one line
    read_chat_template(path)                                   # --chat-template-path: a Jinja file that compiles

A model directory holds ``config.json`` (a JSON object with ``model_type``), weights (``*.safetensors``,
with ``model.safetensors.index.json`` naming the shards when sharded, or ``pytorch_model*.bin``) and,
for the policy, a tokenizer. Each safetensors file's header is read and the file's size compared with
the size the header describes, so a truncated or corrupt file is named here instead of failing inside
``from_pretrained`` with a traceback. A path that does not exist is an error, never a hub repository id:
nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from miles.utils.errors import MilesError
from miles.utils.hf_aliases import register_for
from miles.utils.logging import get_logger

logger = get_logger(__name__)

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model")
_INDEXES = ("model.safetensors.index.json",)
_BIN_GLOBS = ("pytorch_model*.bin", "model*.pt")


class ModelDirError(MilesError, ValueError):
    """A model directory that cannot be loaded; the message names the flag, the path and the fix."""


def _where(flag: str | None, path: Path | str) -> str:
    return f"{flag} {path}" if flag else f"model directory {path}"


def safetensors_header(file: Path, flag: str | None = None) -> dict[str, Any]:
    """The tensor entries of one safetensors file's header; ModelDirError when it is truncated or corrupt."""
    where = _where(flag, file.parent)
    fix = "copy or download the model again (the file is damaged)"
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelDirError(f"{where}: {file.name} is truncated ({size} bytes, no safetensors header); {fix}.")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ModelDirError(f"{where}: {file.name} is truncated or not a safetensors file (header of {n} bytes "
                                f"announced, file has {size}); {fix}.")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelDirError(f"{where}: {file.name} has a corrupt safetensors header ({e}); {fix}.") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{where}: {file.name} has a corrupt safetensors header (not a JSON object); {fix}.")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] or not isinstance(info.get("shape"), list)):
            raise ModelDirError(f"{where}: {file.name} has a corrupt safetensors header (entry {name!r}); {fix}.")
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size != expected:
        what = "is truncated" if size < expected else "is corrupt"
        raise ModelDirError(f"{where}: {file.name} {what}: {size} bytes, its header describes {expected}; {fix}.")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def weight_files(path: Path, flag: str | None = None) -> list[Path]:
    """The safetensors files of a model directory (the index's shards when there is one), or []."""
    where = _where(flag, path)
    for index_name in _INDEXES:
        index = path / index_name
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelDirError(f"{where}: {index_name} is unreadable ({type(e).__name__}: {e}); copy or download "
                                "the model again.") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelDirError(f"{where}: {index_name} names {len(missing)} shard(s) that are missing, e.g. "
                                f"{missing[0]}; copy or download the model again.")
        return [path / s for s in shards]
    return sorted(path.glob("*.safetensors"))


def check_model_dir(path: str | Path, flag: str | None = None, *, tokenizer: bool = False) -> Path:
    """Raise ModelDirError unless ``path`` is a loadable local HF model directory (see the module docstring)."""
    p = Path(path)
    where = _where(flag, path)
    if not p.exists():
        raise ModelDirError(f"{where}: no such directory; give a local HF model directory (config.json, weights"
                            f"{', tokenizer' if tokenizer else ''}). Models are not downloaded from the hub: fetch it "
                            "first (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`).")
    if not p.is_dir():
        raise ModelDirError(f"{where} is a file, not a directory; give the HF model directory (the one with "
                            "config.json).")
    config = p / "config.json"
    if not config.is_file():
        raise ModelDirError(f"{where} is not a HF model directory (no config.json); give a directory written by "
                            "save_pretrained.")
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelDirError(f"{where}: config.json is not valid JSON ({e}); restore it from the original model.") from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ModelDirError(f"{where}: config.json has no model_type, so it is not a transformers model config; "
                            "give a directory written by save_pretrained.")
    register_for(data["model_type"])          # kimi_k2: DeepSeek-V3's architecture (hf_aliases)
    files = weight_files(p, flag)
    if files:
        for f in files:
            safetensors_header(f, flag)
    elif not any(any(p.glob(g)) for g in _BIN_GLOBS):
        raise ModelDirError(f"{where} has no weights (*.safetensors or pytorch_model.bin); give a directory written "
                            "by save_pretrained.")
    if tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{where} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...); copy the tokenizer "
                            "files of the base model into it (tokenizer.save_pretrained(DIR)).")
    return p


def num_params(path: str | Path) -> int | None:
    """Parameters stored in the directory's safetensors files (read from their headers), or None without any."""
    files = weight_files(Path(path))
    if not files:
        return None
    return sum(math.prod(entry["shape"]) for f in files for entry in safetensors_header(f).values())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def load_config(path: str | Path, flag: str | None = None, *, check: bool = True) -> Any:
    """``AutoConfig.from_pretrained`` of a checked directory (``check=False``: checked already); a failure
    (unknown model_type, ...) is one line."""
    from transformers import AutoConfig

    if check:
        check_model_dir(path, flag)
    else:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            register_for(json.loads((Path(path) / "config.json").read_text()).get("model_type"))
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelDirError(f"{_where(flag, path)}: transformers cannot read its config.json ({_first_line(e)}); "
                            "upgrade transformers or give a supported model.") from None


CHAT_TEMPLATE_FLAG = "--chat-template-path"


def read_chat_template(path: str | Path, flag: str = CHAT_TEMPLATE_FLAG) -> str:
    """The text of a Jinja chat template file; ModelDirError (one line naming ``flag``, the path and the fix) when
    it is not a readable UTF-8 file or transformers' Jinja environment does not compile it."""
    p = Path(path)
    fix = "give the path of a Jinja chat template file readable on every node"
    if not p.exists():
        raise ModelDirError(f"{flag} {path}: no such file; {fix}.")
    if not p.is_file():
        raise ModelDirError(f"{flag} {path} is {'a directory' if p.is_dir() else 'not a regular file'}; {fix}.")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{flag} {path}: cannot be read as UTF-8 text ({_first_line(e)}); {fix}.") from None
    if not text.strip():
        raise ModelDirError(f"{flag} {path} is empty; {fix}.")
    try:  # the environment apply_chat_template renders with (its extensions, e.g. {% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: the template is compiled at its first use instead
        return text
    try:
        _compile_jinja_template(text)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and friends: all mean "does not compile"
        line = f" line {e.lineno}" if isinstance(getattr(e, "lineno", None), int) else ""
        raise ModelDirError(f"{flag} {path}: the Jinja template does not compile ({_first_line(e)}{line}); fix the "
                            "template or drop the flag to use the tokenizer's own.") from None
    return text


def load_tokenizer(path: str | Path, flag: str | None = "--hf-checkpoint", *, check: bool = True,
                   chat_template_path: str | Path | None = None) -> Any:
    """``AutoTokenizer.from_pretrained`` of a checked directory (``check=False``: checked already), its chat template
    replaced by the file ``chat_template_path`` (``--chat-template-path``) when given; a failure is one line naming
    the flag."""
    from transformers import AutoTokenizer

    if check:
        check_model_dir(path, flag, tokenizer=True)
    template = read_chat_template(chat_template_path) if chat_template_path else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types here; all mean "this tokenizer does not load"
        raise ModelDirError(f"{_where(flag, path)}: its tokenizer does not load ({_first_line(e)}); copy the tokenizer "
                            "files of the base model into it.") from None
    if template is not None:
        tokenizer.chat_template = template
        logger.info("chat template: %s %s (in place of the tokenizer's own)", CHAT_TEMPLATE_FLAG, chat_template_path)
    return tokenizer
