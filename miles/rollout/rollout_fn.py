"""``--rollout-function-path``: a user function that produces a whole training rollout (Miles's contract).

    def generate_rollout(args, rollout_id, data_source, evaluation=False)   # sync or async
        -> list[list[Sample]] | list[Sample] | an object with .samples (and .metrics)

``args`` is a read-only :class:`~miles.rollout.plugins.PluginArgs` over every config section, plus
``args.client`` (the engines, when the run has them) and ``args.tokenizer``. ``data_source`` speaks
Miles's data-buffer API: ``get_samples(n)`` draws ``n`` prompts as groups of
``--n-samples-per-prompt`` fresh samples (``prompt`` is the row's ``--input-key`` value as it is, a
string or a list of chat messages; ``tokens`` its prompt ids when it was tokenized), and
``add_samples(groups)`` gives unused groups' prompts back. Each returned sample needs ``tokens``,
``response_length`` and, for RL, ``reward``; ``loss_mask`` defaults to all ones; a sample left
PENDING counts as COMPLETED (Miles does not read the status). The call is bounded by
``--distributed-timeout-minutes``.

Miles's own paths resolve with Miles's meaning: ``miles.rollout.sft_rollout.generate_rollout`` (SFT on
``messages``), the default rollout (``miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn``
or the legacy ``miles.rollout.sglang_rollout.generate_rollout``: this project's RolloutManager) and
``miles.rollout.fully_async_rollout.FullyAsyncRolloutFn`` (``--fully-async``, run by the async loop). The custom function
serves training rollouts and, unless ``--eval-function-path`` names another function, also evaluates, called with
``evaluation=True`` (Miles's default of ``--eval-function-path``, see
:mod:`miles.rollout.eval_fn`); miles's SFT rollout does not (evaluation keeps the built-in manager).
"""

from __future__ import annotations

import copy
import inspect
import time
from pathlib import Path
from typing import Any

from miles.config.base import ConfigError
from miles.config.data import DataConfig, custom_rollout_path
from miles.rollout.data import DataError, DataSource, PromptDataset, PromptItem, read_rows
from miles.rollout.data_source import DataSource as MilesDataSourceABC
from miles.rollout.plugins import PluginArgs, call_bounded, client_address, load_function, reward_value
from miles.rollout.rewards import pass_at_k, reward_category_metrics
from miles.types import Sample, SampleStatus
from miles.utils.errors import MilesError
from miles.utils.http_utils import init_http_client
from miles.utils.logging import get_logger

logger = get_logger(__name__)

FLAG = "--rollout-function-path"
FORMS = "def generate_rollout(args, rollout_id, data_source, evaluation=False)"


class RolloutFunctionError(MilesError):
    """The --rollout-function-path function failed or returned samples the trainer cannot use."""


class RawPromptDataset:
    """Rows for a rollout function, prompts kept as they are (no chat template is applied here).

    Duck-types :class:`~miles.rollout.data.PromptDataset` for :class:`~miles.rollout.data.DataSource`.
    A string prompt is tokenized (its ids become the samples' ``tokens``); a list of messages is not.
    """

    def __init__(self, path: str | Path, tokenizer: Any, data: DataConfig, seed: int = 0) -> None:
        self.path, self.seed = str(path), seed
        too_big: list[tuple[str, int]] = []
        rows = read_rows(path, data.rollout_max_prompt_bytes, too_big)
        self.num_rows = len(rows) + len(too_big)
        self.num_dropped_too_big, self.num_dropped_too_long = len(too_big), 0
        self.items: list[PromptItem] = []
        self.where: list[str] = []  # file:line of each item
        for where, row in rows:
            if row.get(data.input_key) is None:
                raise DataError(f"{where}: missing key '{data.input_key}' (set by --input-key); keys present: "
                                f"{sorted(row)}. Pass --input-key with one of them, or fix the data.")
            prompt = row[data.input_key]
            if not isinstance(prompt, str | list):
                raise DataError(f"{where}: the prompt under '{data.input_key}' must be a string or a list of chat "
                                f"messages, got {type(prompt).__name__}.")
            if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt):
                raise DataError(f"{where}: '{data.input_key}' is a list, but not of chat messages with a 'role'.")
            label = row.get(data.label_key) if data.label_key else None
            metadata = row.get(data.metadata_key) or {}
            if not isinstance(metadata, dict):
                raise DataError(f"{where}: '{data.metadata_key}' (--metadata-key) must be an object, got "
                                f"{type(metadata).__name__}.")
            ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if isinstance(prompt, str) else []
            tools = row.get(data.tool_key) if data.tool_key else None
            self.items.append(PromptItem(index=len(self.items), prompt=prompt, prompt_ids=ids, label=label,
                                         metadata=metadata, tools=tools or None))
            self.where.append(where)
        if not self.items:
            raise DataError(f"{self.path}: no usable rows.")
        logger.info("loaded %d rows from %s for %s", len(self.items), self.path, data.rollout_function_path)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def build_prompt_dataset(data: DataConfig, tokenizer: Any, seed: int = 0) -> Any:
    """``--prompt-data`` as the run needs it: raw rows for a custom rollout function without
    ``--apply-chat-template`` (Miles's SFT launchers pass ``messages`` that way), else PromptDataset."""
    if custom_rollout_path(data) is not None and not data.apply_chat_template:
        return RawPromptDataset(data.prompt_data, tokenizer, data, seed)  # type: ignore[arg-type]
    return PromptDataset(data.prompt_data, tokenizer, data, seed=seed)  # type: ignore[arg-type]


class MilesDataBuffer(MilesDataSourceABC):
    """Miles's data-buffer API (``get_samples`` / ``add_samples``, :class:`miles.rollout.data_source.DataSource`)
    over a :class:`DataSource`."""

    def __init__(self, source: DataSource, n_samples_per_prompt: int, rollout_id: int = 0) -> None:
        self.source, self.n, self.rollout_id = source, n_samples_per_prompt, rollout_id
        self._drawn: dict[int, PromptItem] = {}
        self._next_group = 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for item in self.source.next_batch(num_samples):
            g, self._next_group = self._next_group, self._next_group + 1
            self._drawn[g] = item
            meta = dict(item.metadata)
            if item.tools is not None:
                meta.setdefault("tools", item.tools)
            groups.append([Sample(group_index=g, index=g * self.n + i, rollout_id=self.rollout_id,
                                  prompt=copy.deepcopy(item.prompt), tokens=list(item.prompt_ids), label=item.label,
                                  metadata=copy.deepcopy(meta)) for i in range(self.n)])
        return groups

    def where(self, sample: Sample) -> str:
        """Where ``sample``'s prompt came from (``file:line`` when known), for error messages."""
        item = self._drawn.get(sample.group_index)
        dataset = self.source.dataset
        if item is None:
            return f"{dataset.path}"
        lines = getattr(dataset, "where", None)
        return lines[item.index] if lines else f"{dataset.path}: row {item.index}"

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Give the prompts of unused groups back: they are served again first."""
        items = [self._drawn.pop(g[0].group_index) for g in groups if g and g[0].group_index in self._drawn]
        self.source.give_back(items)

    def get_buffer_length(self) -> int:
        """Prompts given back and not yet served again."""
        return len(getattr(self.source, "_buffer", []))


def _groups_of(out: Any) -> tuple[list[list[Sample]], dict[str, float]]:
    metrics = {}
    if hasattr(out, "samples"):
        metrics = dict(getattr(out, "metrics", None) or {})
        out = out.samples
    if not isinstance(out, list | tuple):
        raise RolloutFunctionError(f"{FLAG} returned {type(out).__name__}; expected a list of sample groups")
    groups = [list(g) if isinstance(g, list | tuple) else [g] for g in out]
    for g in groups:
        for s in g:
            if not isinstance(s, Sample):
                raise RolloutFunctionError(f"{FLAG} returned a {type(s).__name__} among its samples; expected Sample")
    return groups, metrics


def _check(s: Sample, where: str) -> None:
    n, r = len(s.tokens), s.response_length
    if not 0 < r < n:
        raise RolloutFunctionError(f"{where}: response_length {r} with {n} tokens; each sample needs prompt tokens "
                                   "followed by at least one response token")
    if s.loss_mask is not None and len(s.loss_mask) != r:
        raise RolloutFunctionError(f"{where}: loss_mask has {len(s.loss_mask)} entries, response_length is {r}")


CLASS_FORMS = ("class F: def __init__(self, input: RolloutFnConstructorInput); "
               "def __call__(self, input: RolloutFnTrainInput | RolloutFnEvalInput)")


def is_rollout_class(fn: Any) -> bool:
    """A class-based rollout function (Miles's ``RolloutFnProtocol``): constructed once, then called per rollout."""
    return inspect.isclass(fn)


def check_class_signature(cls: type, path: str, flag: str = FLAG) -> None:
    """ConfigError unless ``cls(input)`` and ``instance(input)`` bind (Miles's class-based rollout contract)."""
    from miles.rollout.inference_rollout.inference_rollout_common import InferenceRolloutFn, subclass_refusal

    if issubclass(cls, InferenceRolloutFn) and cls is not InferenceRolloutFn:
        raise ConfigError(f"{flag} {path!r}: {subclass_refusal(cls)}")
    call = next((vars(c)["__call__"] for c in cls.__mro__ if "__call__" in vars(c)), None)
    if call is None:
        raise ConfigError(f"{flag} {path!r} is a class without __call__; expected {CLASS_FORMS}.")
    for what, member in (("__init__", cls.__init__), ("__call__", call)):
        try:
            sig = inspect.signature(member)
        except (TypeError, ValueError):
            continue
        try:
            sig.bind(None, None)  # (self, input)
        except TypeError:
            raise ConfigError(f"{flag} {path!r}: {what}{sig} does not take one input; expected {CLASS_FORMS}.") from None


def construct_rollout_class(cls: type, path: str, args: Any, data_source: Any, flag: str = FLAG) -> Any:
    """``cls(RolloutFnConstructorInput(args, data_source))``; a failure is one RolloutFunctionError line."""
    from miles.rollout.base_types import RolloutFnConstructorInput

    try:
        return cls(RolloutFnConstructorInput(args=args, data_source=data_source))
    except (MilesError, ConfigError):
        raise
    except Exception as e:  # the user's constructor failed: one line naming it (its traceback is in the log)
        logger.debug("%s %s constructor failed", flag, path, exc_info=True)
        first = (str(e).splitlines() or [""])[0]
        raise RolloutFunctionError(f"{flag} {path}: constructing the class raised {type(e).__name__}: {first}") from None


def check_signature(fn: Any, path: str, flag: str = FLAG) -> None:
    """ConfigError unless ``fn(args, rollout_id, data_source, evaluation=False)`` binds (Miles's call), or ``fn``
    is a class following Miles's class-based contract."""
    if is_rollout_class(fn):
        check_class_signature(fn, path, flag)
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return
    try:
        sig.bind(None, 0, None, evaluation=False)
    except TypeError:
        raise ConfigError(f"{flag} {path!r} has signature {sig}; expected {FORMS}.") from None


class RolloutFunctionSource:
    """Calls the rollout function once per training rollout; ``next_rollout`` is what the loops call."""

    def __init__(self, path: str, args: PluginArgs, data_source: DataSource, n_samples_per_prompt: int,
                 timeout: float) -> None:
        self.path, self.args, self.data_source = path, args, data_source
        self.n, self.timeout = n_samples_per_prompt, timeout
        self.fn = load_function(path, FLAG)
        self._check_signature()
        self.instance: Any = None
        self._buffer: MilesDataBuffer | None = None
        if is_rollout_class(self.fn):  # built once; its data source is one buffer kept across rollouts
            self._buffer = MilesDataBuffer(self.data_source, self.n, 0)
            self.instance = construct_rollout_class(self.fn, path, args, self._buffer)

    def _check_signature(self) -> None:
        check_signature(self.fn, self.path)

    def _call(self, rollout_id: int, buffer: MilesDataBuffer) -> Any:
        if self.instance is not None:
            from miles.rollout.base_types import RolloutFnTrainInput

            return self.instance(RolloutFnTrainInput(rollout_id=rollout_id))
        return self.fn(self.args, rollout_id, buffer, evaluation=False)

    async def next_rollout(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float]]:
        t0 = time.monotonic()
        if self._buffer is not None:
            self._buffer.rollout_id = rollout_id
        buffer = self._buffer or MilesDataBuffer(self.data_source, self.n, rollout_id)
        what = f"{FLAG} {self.path}"
        try:
            out = await call_bounded(self._call, (rollout_id, buffer), self.timeout, what,
                                     flag="--distributed-timeout-minutes (in seconds)")
        except TimeoutError as e:
            raise RolloutFunctionError(str(e)) from None
        except (MilesError, ValueError) as e:
            raise RolloutFunctionError(f"{what}: {e}") from e
        groups, metrics = _groups_of(out)
        for g_i, g in enumerate(groups):
            for s_i, s in enumerate(g):
                _check(s, f"{what}: group {g_i} sample {s_i}")
                if s.status is SampleStatus.PENDING:
                    s.status = SampleStatus.COMPLETED
                s.rollout_id = rollout_id
        flat = [s for g in groups for s in g]
        rewards = [float(s.reward) for s in flat if isinstance(s.reward, int | float)]
        metrics = {**{k: float(v) for k, v in metrics.items() if isinstance(v, int | float)},
                   "rollout/raw_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
                   "rollout/response_len": sum(s.response_length for s in flat) / max(1, len(flat)),
                   "rollout/num_samples": float(len(flat)),
                   "rollout/epoch": float(self.data_source.epoch),
                   "perf/rollout_time": time.monotonic() - t0,
                   **reward_category_metrics(flat, getattr(self.args, "log_reward_category", None))}
        if getattr(self.args, "log_passrate", False):     # --log-passrate: over the rollout's complete groups
            metrics.update({f"passrate/{k}": v for k, v in pass_at_k(
                [[reward_value(s, self.args) for s in g] for g in groups], self.n).items()})
        return groups, metrics


def build_rollout_function(cfg: Any, data_source: DataSource | None, tokenizer: Any,
                           client: Any = None) -> RolloutFunctionSource | None:
    """The custom rollout source of ``--rollout-function-path``, or None when the built-in one serves."""
    path = custom_rollout_path(cfg.data)
    if path is None:
        return None
    if data_source is None:
        raise ConfigError(f"{FLAG} {path} draws prompts from --prompt-data: pass --prompt-data FILE.")
    sections = (cfg.data, cfg.rollout, cfg.reward, cfg.eval, cfg.algo, cfg.train, cfg.cluster, cfg.weights,
                cfg.checkpoint, cfg.output)
    args = PluginArgs(*sections, client=client, tokenizer=tokenizer, extra=getattr(cfg, "custom_config", None),
                      overrides=client_address(client))
    init_http_client(args)
    return RolloutFunctionSource(path, args, data_source, cfg.data.n_samples_per_prompt,
                                 timeout=cfg.cluster.distributed_timeout_minutes * 60.0)
