"""Prompt data: read JSONL or Parquet, render and tokenize prompts once, serve them in a resumable order.

    dataset = PromptDataset(cfg.data.prompt_data, tokenizer, cfg.data, seed=cfg.rollout.rollout_seed)
    source = DataSource(dataset, shuffle=cfg.data.rollout_shuffle, seed=cfg.rollout.rollout_seed)
    batch = source.next_batch(cfg.data.rollout_batch_size)      # list[PromptItem], crosses epochs
    state = source.state_dict()                                 # JSON-able; saved with checkpoints

Rows are objects with the prompt under ``--input-key`` (a string, or a list of chat messages), an
optional label under ``--label-key``, metadata under ``--metadata-key`` and tool specs under
``--tool-key``. ``--apply-chat-template`` renders the prompt with the tokenizer's own chat template
(a string prompt becomes one user message); it is never implied: a list-shaped prompt without the
flag is an error. Prompt token ids are computed here, once, and travel unchanged to the engine. The rendered
text is kept too (``PromptItem.text``): it is ``sample.prompt`` of the samples a generate function gets, as in Miles. With
``--multimodal-keys`` the ``<image>`` placeholders are rendered as image items and each image's token is expanded
to its count (``miles.rollout.multimodal``), so the ids are what the engine and the trainer take with the images.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from miles.config.base import ConfigError
from miles.config.data import DataConfig, EvalConfig, parse_eval_prompt_data  # noqa: F401  (re-exported)
from miles.config.eval_datasets import EvalDatasetSpec
from miles.utils.errors import DataError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class PromptItem:
    """One prompt, ready to generate from. ``index`` is its row position in the dataset. ``prompt`` is the row's
    prompt; ``text`` its chat-templated text under ``--apply-chat-template`` (None without the flag): what Miles's
    data loader makes ``sample.prompt``, and the text ``prompt_ids`` are the tokens of (images' tokens expanded)."""

    index: int
    prompt: str | list[dict[str, Any]]
    prompt_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    text: str | None = None

    @property
    def sample_prompt(self) -> Any:
        """``Sample.prompt`` of a generated sample, as Miles's: the chat-templated text under
        ``--apply-chat-template``, else the row's prompt."""
        return self.text if self.text is not None else self.prompt


DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024
_TOKENIZE_CHUNK = 256  # prompts per tokenizer call: bounds the tokenizer's peak memory


def _skip_rest_of_line(f: BinaryIO, chunk: int = 1 << 20) -> int:
    """Read past the end of the current line without holding it; returns the bytes skipped."""
    skipped = 0
    while True:
        part = f.readline(chunk)
        skipped += len(part)
        if not part or part.endswith(b"\n"):
            return skipped


def _iter_jsonl(p: Path, max_bytes: int | None, dropped: list[tuple[str, int]],
                flag: str = "--prompt-data") -> Iterator[tuple[str, dict[str, Any]]]:
    """Stream (location, row) pairs; a line longer than ``max_bytes`` is skipped unread (its location kept).
    ``flag`` is the flag that named the file (in the message of a line that is not UTF-8)."""
    with open(p, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(max_bytes + 1) if max_bytes is not None else f.readline()
            if not raw:
                return
            lineno += 1
            if max_bytes is not None and len(raw) > max_bytes:
                size = len(raw) + (0 if raw.endswith(b"\n") else _skip_rest_of_line(f))
                dropped.append((f"{p}:{lineno}", size))
                continue
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of "
                                f"the line); save {flag} as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None
            if not line.strip():
                continue
            try:  # without its line ending, so that a truncated last line reports the column where it ends
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                where = "column" if e.msg.endswith(" at") else "at column"  # "Unterminated string starting at column 7"
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg} {where} {e.colno}); each line must be "
                                f"one JSON object.") from e
            except RecursionError:
                raise DataError(f"{p}:{lineno}: JSON nested too deeply to parse; flatten this record.") from None
            if not isinstance(row, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object per line, got {type(row).__name__}.")
            yield f"{p}:{lineno}", row


def read_rows(path: str | Path, max_record_bytes: int | None = None,
              dropped: list[tuple[str, int]] | None = None, flag: str = "--prompt-data") -> list[tuple[str, dict[str, Any]]]:
    """(location, row) pairs from a JSONL or Parquet file; location is ``file:line`` or ``file:row N``; ``flag``
    names the flag that gave the file in messages about its content.

    A JSONL line longer than ``max_record_bytes`` is never parsed (nor held in memory whole): its
    (location, size in bytes) goes to ``dropped``.
    """
    p = Path(path)
    dropped = dropped if dropped is not None else []
    if not p.is_file():
        raise DataError(f"prompt data file {str(p)!r} does not exist (check --prompt-data / --eval-prompt-data).")
    name = p.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow raises several types for bad files
            raise DataError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e}).") from e
        return [(f"{p}:row {i}", r) for i, r in enumerate(rows)]
    if not name.endswith(JSONL_SUFFIXES):
        raise DataError(f"prompt data {str(p)!r}: unknown format; use a .jsonl (one JSON object per line) "
                        f"or .parquet file.")
    return list(_iter_jsonl(p, max_record_bytes, dropped, flag))


def _get(row: dict[str, Any], key: str, flag: str, where: str, seen_with_key: int = 0) -> Any:
    """``row[key]``; absent (or null) is a DataError that tells a one-row gap from a wrong key."""
    if key in row and row[key] is not None:
        return row[key]
    if key in row:
        raise DataError(f"{where}: key '{key}' (set by {flag}) is null in this row; give it a value or remove the row.")
    if seen_with_key:
        earlier = "the row before has it" if seen_with_key == 1 else f"the {seen_with_key} rows before have it"
        raise DataError(f"{where}: missing key '{key}' (set by {flag}) in this row, though {earlier}; "
                        f"keys present: {sorted(row)}. Add '{key}' to this row or remove the row.")
    raise DataError(f"{where}: missing key '{key}' (set by {flag}); keys present: {sorted(row)}. "
                    f"Pass {flag} with one of them, or fix the data.")


def _check_messages(prompt: list[Any], where: str, flag_key: str) -> None:
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: prompt under {flag_key} is a list, but item {i} is not a chat message "
                            f"with a 'role' (got {str(m)[:80]!r}).")


def _expand_images(images: Any, ids: list[int], metadata: dict[str, Any], where: str) -> list[int]:
    """A rendered prompt's ids with each image's placeholder token repeated to that image's token count (the image
    processor of --hf-checkpoint, as Miles's processor call expands them): what the engine and the trainer see."""
    from miles.rollout.multimodal import MEDIA_KEY

    refs = (metadata.get(MEDIA_KEY) or {}).get("images") or []
    if not refs:
        return ids
    counts = images.tokens_per_image(images.pixels(refs)["image_grid_thw"])
    return images.expand(ids, [0] * len(ids), counts, where)[0]


class PromptDataset:
    """All prompts of one file, rendered and tokenized, with over-long prompts dropped (and counted)."""

    def __init__(self, path: str | Path, tokenizer: Any, data: DataConfig, seed: int = 0,
                 flag: str = "--prompt-data") -> None:
        self.path, self.flag = str(path), flag
        self.seed = seed
        self.num_rows = 0
        self.num_dropped_too_long = 0
        self.num_dropped_too_big = 0
        items = self._load(path, tokenizer, data)
        if not items:
            why = []
            if self.num_dropped_too_long:
                why.append(f"{self.num_dropped_too_long} longer than --rollout-max-prompt-len {data.rollout_max_prompt_len}")
            if self.num_dropped_too_big:
                why.append(f"{self.num_dropped_too_big} larger than --rollout-max-prompt-bytes {data.rollout_max_prompt_bytes}")
            raise DataError(f"{self.path}: no usable prompts{' (' + '; '.join(why) + ')' if why else ''}.")
        self.items = items

    def _drop_too_big(self, where: str, what: str, size: int, max_bytes: int) -> None:
        self.num_dropped_too_big += 1
        if self.num_dropped_too_big <= 5:  # the count of all of them is logged at the end
            logger.warning("%s: %s of %d bytes dropped %s: larger than --rollout-max-prompt-bytes %d", where, what,
                           size, "unparsed" if what == "record" else "before tokenizing", max_bytes)

    def _load(self, path: str | Path, tokenizer: Any, data: DataConfig) -> list[PromptItem]:
        max_bytes = data.rollout_max_prompt_bytes
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError(f"--rollout-max-prompt-bytes must be a positive number of bytes, got {max_bytes}.")
        images = None
        if data.multimodal_keys and Path(str(getattr(tokenizer, "name_or_path", ""))).is_dir():
            from miles.rollout.multimodal import image_inputs

            images = image_inputs(str(tokenizer.name_or_path))  # --hf-checkpoint is a VLM with an image processor
        too_big: list[tuple[str, int]] = []
        rows = read_rows(path, max_bytes, too_big, self.flag)
        for where, size in too_big:
            self._drop_too_big(where, "record", size, max_bytes)  # type: ignore[arg-type]
        self.num_rows = len(rows) + len(too_big)
        parsed: list[tuple[str, Any, Any, dict[str, Any], Any]] = []
        texts: list[str] = []
        num_labelled = 0
        for where, row in rows:
            prompt = _get(row, data.input_key, "--input-key", where, len(parsed))
            label = _get(row, data.label_key, "--label-key", where, num_labelled) if data.label_key else None
            num_labelled += data.label_key is not None
            metadata = row.get(data.metadata_key) or {}
            if isinstance(metadata, str):
                try:
                    metadata = json.loads(metadata)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: '{data.metadata_key}' (--metadata-key) is a string but not JSON: {e.msg}.") from e
            if not isinstance(metadata, dict):
                raise DataError(f"{where}: '{data.metadata_key}' (--metadata-key) must be an object, got "
                                f"{type(metadata).__name__}.")
            shown = prompt
            if data.multimodal_keys:  # --multimodal-keys: the row's images, checked now (miles.rollout.multimodal)
                from miles.rollout.multimodal import MEDIA_KEY, content_messages, row_media

                media = row_media(row, data.multimodal_keys, where, Path(path).parent)
                if isinstance(prompt, list | str):  # as many <image> placeholders as images, rendered as image items
                    shown = content_messages(prompt if isinstance(prompt, list) else
                                             [{"role": "user", "content": prompt}], media, where)
                metadata = {**metadata, MEDIA_KEY: media}
            tools = row.get(data.tool_key) if data.tool_key else None
            if isinstance(tools, str):
                try:
                    tools = json.loads(tools)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: '{data.tool_key}' (--tool-key) is a string but not JSON: {e.msg}.") from e
            text = self._render(shown, tools, tokenizer, data, where)
            if max_bytes is not None and len(text) * 4 > max_bytes and len(text.encode("utf-8")) > max_bytes:
                self._drop_too_big(where, "rendered prompt", len(text.encode("utf-8")), max_bytes)
                continue
            texts.append(text)
            parsed.append((where, prompt, label, metadata, tools))
        limit = data.rollout_max_prompt_len
        items: list[PromptItem] = []
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            chunk = texts[start:start + _TOKENIZE_CHUNK]
            # with images the limit applies to the expanded ids (as Miles's processor-based length filter)
            for (where, prompt, label, metadata, tools), text, ids in zip(
                    parsed[start:start + _TOKENIZE_CHUNK], chunk,
                    self._tokenize(tokenizer, chunk, None if images else limit)):
                if ids is not None and images is not None:
                    ids = _expand_images(images, ids, metadata, where)
                    ids = ids if limit is None or len(ids) <= limit else None
                if ids is None:
                    self.num_dropped_too_long += 1
                    continue
                items.append(PromptItem(index=len(items), prompt=prompt, prompt_ids=ids, label=label,
                                        metadata=metadata, tools=tools or None,
                                        text=text if data.apply_chat_template else None))
        if self.num_dropped_too_long:
            logger.warning("%s: dropped %d of %d prompts longer than --rollout-max-prompt-len %d tokens",
                           self.path, self.num_dropped_too_long, self.num_rows, limit)
        if self.num_dropped_too_big:
            logger.warning("%s: dropped %d of %d records larger than --rollout-max-prompt-bytes %d",
                           self.path, self.num_dropped_too_big, self.num_rows, max_bytes)
        logger.info("loaded %d prompts from %s", len(items), self.path)
        return items

    @staticmethod
    def _tokenize(tokenizer: Any, texts: list[str], limit: int | None) -> list[list[int] | None]:
        """Token ids per text; None for a text over ``limit`` tokens.

        A text longer than ``(limit + 2) * 32`` characters is first tokenized by that prefix only: when the
        prefix alone has more than ``limit + 1`` tokens (one allows for a merge across the cut), the text is
        too long and is never tokenized whole, so one huge prompt costs no more memory than its prefix.
        """
        out: list[list[int] | None] = [None] * len(texts)
        todo = list(range(len(texts)))
        if limit is not None:
            cut = (limit + 2) * 32
            long_ix = [i for i in todo if len(texts[i]) > cut]
            if long_ix:
                heads = tokenizer([texts[i][:cut] for i in long_ix], add_special_tokens=False)["input_ids"]
                over = {i for i, ids in zip(long_ix, heads) if len(ids) > limit + 1}
                todo = [i for i in todo if i not in over]
        if todo:
            for i, ids in zip(todo, tokenizer([texts[i] for i in todo], add_special_tokens=False)["input_ids"]):
                out[i] = list(ids) if limit is None or len(ids) <= limit else None
        return out

    @staticmethod
    def _render(prompt: Any, tools: Any, tokenizer: Any, data: DataConfig, where: str) -> str:
        if isinstance(prompt, list):
            _check_messages(prompt, where, f"'{data.input_key}'")
            if not data.apply_chat_template:
                raise DataError(f"{where}: the prompt under '{data.input_key}' is a list of chat messages, but "
                                f"--apply-chat-template is not set (it is never implied). Add --apply-chat-template "
                                f"to render it with the tokenizer's chat template.")
        elif (isinstance(prompt, int | float) and not isinstance(prompt, bool) and not data.apply_chat_template
              and data.custom_generate_function_path):
            return str(prompt)  # Miles's tau-bench data: the task index is the prompt, its generate function reads it
        elif not isinstance(prompt, str):
            number = isinstance(prompt, int | float) and not isinstance(prompt, bool)
            raise DataError(f"{where}: the prompt under '{data.input_key}' must be a string or a list of chat "
                            f"messages, got {type(prompt).__name__}"
                            + (" (a number is a prompt only for a --custom-generate-function-path, as in Miles's "
                               "tau-bench example)." if number else "."))
        if not data.apply_chat_template:
            return prompt
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("--apply-chat-template is set but the tokenizer has no chat template; drop the flag "
                              "or use a tokenizer that ships one.")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True,
                                  **data.apply_chat_template_kwargs}  # --apply-chat-template-kwargs
        if tools:
            kwargs["tools"] = tools
        text = tokenizer.apply_chat_template(messages, **kwargs)
        if not isinstance(text, str):
            raise DataError(f"{where}: the tokenizer's chat template did not render to text (got {type(text).__name__}).")
        return text

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def epoch_order(num_prompts: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Row order of one epoch: identity, or a permutation seeded by (seed, epoch), stable across runs."""
    order = list(range(num_prompts))
    if shuffle:
        random.Random(f"miles-data:{seed}:{epoch}").shuffle(order)
    return order


class DataSource:
    """Serves prompts epoch after epoch; its state (epoch, offset, seed, given-back prompts) resumes exactly.

    ``give_back(items)`` returns prompts that were drawn but not used (e.g. aborted surplus of dynamic
    sampling); they are served again first, and are part of the saved state.
    """

    def __init__(self, dataset: PromptDataset, shuffle: bool = False, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._buffer: list[int] = []
        self._order = epoch_order(len(dataset), 0, seed, shuffle)

    def next_batch(self, n: int) -> list[PromptItem]:
        if n < 0:
            raise ValueError(f"next_batch needs n >= 0, got {n}")
        out: list[PromptItem] = []
        while self._buffer and len(out) < n:
            out.append(self.dataset[self._buffer.pop(0)])
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = epoch_order(len(self.dataset), self.epoch, self.seed, self.shuffle)
                logger.info("prompt data: starting epoch %d", self.epoch)
            out.append(self.dataset[self._order[self.offset]])
            self.offset += 1
        return out

    def give_back(self, items: list[PromptItem]) -> None:
        self._buffer = [it.index for it in items] + self._buffer

    def num_rollout_from_epochs(self, num_epoch: int, rollout_batch_size: int) -> int:
        """``--num-rollout`` implied by ``--num-epoch``: whole batches per epoch times epochs."""
        per_epoch = len(self.dataset) // rollout_batch_size
        if per_epoch == 0:
            raise ConfigError(f"--rollout-batch-size {rollout_batch_size} is larger than the prompt data "
                              f"({len(self.dataset)} prompts in {self.dataset.path}); lower it or pass --num-rollout.")
        return per_epoch * num_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.dataset), "buffer": list(self._buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "offset", "seed"} - set(state)
        if missing:
            raise ValueError(f"data source state is missing {sorted(missing)} (keys present: {sorted(state)})")
        if state.get("num_prompts", len(self.dataset)) != len(self.dataset):
            raise ValueError(f"the saved data order covers {state['num_prompts']} prompts but {self.dataset.path} now "
                             f"has {len(self.dataset)}: resume with the same --prompt-data and "
                             f"--rollout-max-prompt-len, or start without --load.")
        if state["seed"] != self.seed or state.get("shuffle", self.shuffle) != self.shuffle:
            raise ValueError(f"the saved data order used --rollout-seed {state['seed']} and shuffle="
                             f"{state.get('shuffle')}, now --rollout-seed {self.seed} and shuffle={self.shuffle}: "
                             f"resume with the original --rollout-seed / --rollout-shuffle.")
        if not 0 <= state["offset"] <= len(self.dataset):
            raise ValueError(f"data source state offset {state['offset']} is outside 0..{len(self.dataset)}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._buffer = [int(i) for i in state.get("buffer", [])]
        self._order = epoch_order(len(self.dataset), self.epoch, self.seed, self.shuffle)


@dataclass
class EvalDataset:
    """One evaluation dataset: its resolved spec (``--eval-config`` / ``--eval-prompt-data``) and its prompts, each
    prompt's metadata carrying the spec's ``rm_type`` and ``metadata_overrides``."""

    spec: EvalDatasetSpec
    dataset: PromptDataset
    items: list[PromptItem] = field(init=False)

    def __post_init__(self) -> None:
        self.items = [dataclasses.replace(it, metadata=self.spec.inject_metadata(it.metadata))
                      for it in self.dataset.items]

    def __len__(self) -> int:
        return len(self.items)


def load_eval_datasets(specs: list[EvalDatasetSpec], eval_cfg: EvalConfig, data: DataConfig, tokenizer: Any,
                       seed: int = 0) -> dict[str, EvalDataset]:
    """Each spec's prompts, read with its keys and --eval-max-prompt-len (default: --rollout-max-prompt-len)."""
    out: dict[str, EvalDataset] = {}
    for spec in specs:
        keys = {"input_key": spec.input_key, "label_key": spec.label_key, "metadata_key": spec.metadata_key,
                "tool_key": spec.tool_key}
        if eval_cfg.eval_max_prompt_len is not None:
            keys["rollout_max_prompt_len"] = eval_cfg.eval_max_prompt_len
        flag = (f"--eval-config's dataset {spec.name!r}" if eval_cfg.eval_config is not None
                else f"--eval-prompt-data {spec.name}")
        out[spec.name] = EvalDataset(spec, PromptDataset(spec.path, tokenizer, dataclasses.replace(data, **keys), seed,
                                                         flag=flag))
    return out
