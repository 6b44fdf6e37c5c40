"""Rewards: built-in verifiers (``--rm-type``), a remote reward server, or a user function.

    rewarder = Rewarder(cfg.reward, plugin_args)    # resolves and checks everything at start-up
    failures = await rewarder.score_group(samples)  # sets sample.reward; failures -> status FAILED

Built-ins (``--rm-type``), with Miles v0.1.0's names and meanings (``rm_hub/``): ``math`` (last
``\\boxed{}`` vs the label, string or sympy equality), ``deepscaler`` / ``gemma_math`` (the same after
the thinking), ``dapo`` (``Answer:`` integer, ``{score: +-1, acc, pred}``), ``f1`` (token F1), ``gpqa``
(multiple-choice letter), ``ifbench`` (IFBench's checkers), ``random``, ``deterministic_random``,
``remote_rm`` (POST ``{prompt, response, label}`` to ``--rm-url``, ``--rm-timeout`` per try,
``--rm-max-retries`` retries on connection errors, timeouts, 429 and 5xx) and ``boxed_<type>`` (grade the
last box's content with ``<type>``); plus ``exact_match``, ``quickstart`` and ``math_lenient`` (boxed, else
last number). A label given as a list means "any of these": a one-element list is its element.
``register_reward(name, fn)`` adds a name; a sample's ``metadata["rm_type"]`` overrides the flag.

``--custom-rm-path module.function``: ``async def f(args, sample) -> float`` (Miles's signature; ``args``
is a read-only :class:`~miles.rollout.plugins.PluginArgs` view of the flags) or ``async def f(sample)``;
with ``--group-rm``, ``f(args, samples)`` / ``f(samples)`` returning one reward per sample. Plain
(non-async) functions run on a daemon thread.

Every reward call (built-in or custom, per sample or per group) is bounded by ``--rm-timeout``: one that
does not return in time fails its sample(s), naming the function and the flag. ``remote_rm`` applies
``--rm-timeout`` to each HTTP try instead.

A reward may be a number (bool counts as 0/1) or a dict, from which ``--reward-key`` picks the value
(``"reward"`` is used when the flag is unset, ``"score"`` for ``dapo``); the whole dict is kept in
``sample.metadata["rewards"]``. A reward function that raises, times out, or returns a non-number, NaN
or infinity fails that sample visibly: status FAILED, ``reward`` None, the reason in
``metadata["reward_error"]``, logged with the sample's index and counted by the caller
(``rollout/reward_failures``); it is never silently zeroed.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles.config.base import ConfigError
from miles.config.data import RewardConfig
from miles.rollout.plugins import PluginArgs, call_bounded, choose_arity, load_function
from miles.rollout.rm_hub import dapo, deepscaler, f1, gpqa, ifbench, math_grader, simple
from miles.rollout.rm_hub.math_answer import extract_boxed, math_reward
from miles.rollout.rm_hub.quickstart import quickstart_reward
from miles.types import Sample, SampleStatus
from miles.utils.http_utils import post_json_retrying
from miles.utils.logging import get_logger

logger = get_logger(__name__)

RewardFn = Callable[[Any, Sample], Awaitable[Any] | Any]
_REGISTRY: dict[str, RewardFn] = {}
SCORABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
BOXED_PREFIX = "boxed_"


class RewardValueError(ValueError):
    """A reward function's result is not a usable number."""


def register_reward(name: str, fn: RewardFn | None = None, *, overwrite: bool = False):
    """Make ``--rm-type name`` call ``fn(args, sample)`` (sync or async). Usable as a decorator."""

    def _add(f: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not f and not overwrite:
            raise ValueError(f"reward '{name}' is already registered (to {_REGISTRY[name]!r}); pass overwrite=True")
        _REGISTRY[name] = f
        return f

    return _add(fn) if fn is not None else _add


@dataclass(frozen=True)
class Verifier:
    """A reward-hub verifier: ``fn(response, label, sample)``; ``label`` is one candidate (None if unused)."""

    fn: Callable[[str, Any, Sample], Any]
    needs_label: bool = True
    reward_key: str | None = None  # the dict key to train on when --reward-key is unset
    inline: bool = False  # a string compare, linear in the response: called on the event loop (no thread, no timeout)
    # the score of a sample without a label when --label-key is unset (None: such a sample fails). Miles's ``math``
    # grades a missing label 0 (radixark/miles@v0.1.0:miles/rollout/rm_hub/math_utils.py grade_answer_verl), and its
    # own OPD scripts pass --rm-type math without --label-key
    unlabelled: float | None = None


def _one(label: Any) -> Any:
    """A one-element list label is its element (gpqa may also take its answer from metadata alone)."""
    return label[0] if isinstance(label, list | tuple) and len(label) == 1 else label


HUB: dict[str, Verifier] = {
    "math": Verifier(lambda r, lab, s: 1 if math_grader.grade_boxed(r, str(lab)) else 0, unlabelled=0.0),
    "math_lenient": Verifier(lambda r, lab, s: math_reward(r, lab)),
    "deepscaler": Verifier(lambda r, lab, s: deepscaler.deepscaler_reward(r, lab)),
    "gemma_math": Verifier(lambda r, lab, s: deepscaler.gemma_math_reward(r, lab)),
    "dapo": Verifier(lambda r, lab, s: dapo.dapo_reward(r, lab), reward_key="score"),
    "f1": Verifier(lambda r, lab, s: f1.f1_reward(r, str(lab))),
    "gpqa": Verifier(lambda r, lab, s: gpqa.gpqa_reward(r, _one(s.label), s.metadata), needs_label=False),
    "ifbench": Verifier(lambda r, lab, s: ifbench.ifbench_reward(r, s.metadata), needs_label=False),
    "exact_match": Verifier(lambda r, lab, s: 1.0 if r.strip() == str(lab).strip() else 0.0, inline=True),
    "quickstart": Verifier(lambda r, lab, s: quickstart_reward(r, lab), inline=True),
    "random": Verifier(lambda r, lab, s: simple.random_reward(), needs_label=False),
    "deterministic_random": Verifier(lambda r, lab, s: simple.deterministic_random_reward(s.tokens, r),
                                     needs_label=False),
}


def registered_rewards() -> list[str]:
    return sorted({*_REGISTRY, *HUB, "remote_rm"})


def label_candidates(sample: Sample, rm: str, args: Any = None) -> list[Any]:
    """The label's accepted answers: a list/tuple label is "any of these", anything else is one answer."""
    label = sample.label
    if label is None:
        key = getattr(args, "label_key", None)
        if key:
            raise ValueError(f"--rm-type {rm} needs a label, and sample {sample.index} has none although "
                             f"--label-key {key} is set (every data row has one, so it was cleared after loading, "
                             f"e.g. by --custom-generate-function-path).")
        raise ValueError(f"--rm-type {rm} needs a label, and no --label-key is set: pass --label-key naming the "
                         f"answer field of --prompt-data.")
    if isinstance(label, list | tuple):
        if not label:
            raise ValueError(f"--rm-type {rm}: sample {sample.index}'s label is an empty list; give at least one answer.")
        return list(label)
    return [label]


_WARNED_UNLABELLED: set[str] = set()


def _unlabelled_score(name: str, verifier: Verifier, sample: Sample, args: Any) -> float | None:
    """The score of a sample without a label for a verifier that grades that (warned once per reward), else None."""
    if sample.label is not None or verifier.unlabelled is None or getattr(args, "label_key", None):
        return None
    if name not in _WARNED_UNLABELLED:
        _WARNED_UNLABELLED.add(name)
        logger.warning(f"--rm-type {name}: the samples have no label (no --label-key is set), so every reward is "
                       f"{verifier.unlabelled:g}, as in Miles; pass --label-key naming the answer field of --prompt-data "
                       f"to grade responses.")
    return verifier.unlabelled


def _score_of(value: Any, key: str | None) -> float:
    return float(value.get(key or "reward", -math.inf)) if isinstance(value, dict) else float(value)


def _hub_call(name: str, verifier: Verifier, boxed: bool) -> Callable[[Any, Sample], Any]:
    """``f(args, sample)`` running ``verifier``: best over the label's candidates, the box taken first if asked."""

    def run(args: Any, sample: Sample) -> Any:
        response = sample.response or ""
        if boxed:
            response = extract_boxed(response) or ""
        if not verifier.needs_label:
            return verifier.fn(response, None, sample)
        if (unlabelled := _unlabelled_score(name, verifier, sample, args)) is not None:
            return unlabelled
        results = [verifier.fn(response, lab, sample) for lab in label_candidates(sample, name, args)]
        key = getattr(args, "reward_key", None) or verifier.reward_key
        return max(results, key=lambda v: _score_of(v, key))

    run.__qualname__ = f"rm_hub.{name}"
    run.miles_inline = verifier.inline  # type: ignore[attr-defined]
    return run
def reward_category_metrics(samples: list[Sample], key: str | None) -> dict[str, float]:
    """``--log-reward-category KEY``: ``{"error_cat/<value>": share of samples}`` over the value each sample's reward
    dict holds under KEY (the dict a reward returned: ``sample.reward`` or ``metadata["rewards"]``); samples without
    one count as ``none``. Miles's metric names; {} without the flag or samples."""
    if not key or not samples:
        return {}
    counts: dict[str, int] = {}
    for s in samples:
        raw = s.reward if isinstance(s.reward, dict) else s.metadata.get("rewards")
        value = raw.get(key) if isinstance(raw, dict) else None
        name = "none" if value is None else str(value)
        counts[name] = counts.get(name, 0) + 1
    return {f"error_cat/{name}": n / len(samples) for name, n in counts.items()}


def pass_at_k(reward_groups: list[list[Any]], group_size: int, what: str = "rollout") -> dict[str, float]:
    """``--log-passrate`` (Miles's ``compute_pass_rate``): for k = 1, 2, 4, ... up to ``group_size``, the unbiased
    pass@k estimate ``1 - C(n - c, k) / C(n, k)`` of each group of ``group_size`` rewards (``c``: the rewards equal
    to 1), averaged over the groups: ``{"pass@k": value}``. Groups of another size are left out (a warning names
    how many: Miles's rollout-side rule); {} for a group size of 1 or no complete group."""
    if group_size <= 1:
        return {}
    full = [g for g in reward_groups if len(g) == group_size]
    if len(full) < len(reward_groups):
        logger.warning("%s pass@k: excluding %d/%d incomplete groups (fewer than %d samples).", what,
                       len(reward_groups) - len(full), len(reward_groups), group_size)
    if not full:
        return {}
    out, k = {}, 1
    while k <= group_size:
        est = [_pass_at(group_size, sum(1 for r in g if r == 1), k) for g in full]
        out[f"pass@{k}"] = sum(est) / len(est)
        k *= 2
    return out


def _pass_at(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) as a product (no large binomials)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def builtin_call(name: str) -> tuple[RewardFn, str | None] | None:
    """(``f(args, sample)``, its default reward key) of a registered or reward-hub name (``boxed_<type>`` included;
    not ``remote_rm``), or None for an unknown name."""
    base = name[len(BOXED_PREFIX):] if name.startswith(BOXED_PREFIX) else name
    if name in _REGISTRY:
        return _REGISTRY[name], None
    if base in HUB:
        if base == "ifbench":
            ifbench.load_ifbench()
        return _hub_call(base, HUB[base], boxed=base != name), HUB[base].reward_key
    return None


class RemoteReward:
    """POSTs ``{prompt, response, label}`` to ``--rm-url``; bounded per try, retried with backoff."""

    def __init__(self, url: str, timeout: float, max_retries: int) -> None:
        self.url, self.timeout, self.max_retries = url, timeout, max_retries
        self._session: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._loop = loop
        return self._session

    async def score(self, sample: Sample) -> Any:
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        return await post_json_retrying(self._get_session(), self.url, payload, timeout=self.timeout,
                                        max_retries=self.max_retries, name=f"--rm-url {self.url}")

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def to_reward(value: Any, reward_key: str | None) -> tuple[float, dict[str, Any] | None]:
    """(reward, the dict it came from or None); raises RewardValueError for unusable values."""
    raw_dict = None
    if isinstance(value, dict):
        raw_dict = value
        key = reward_key or "reward"
        if key not in value:
            hint = "--reward-key" if reward_key else "no --reward-key is set, so 'reward' was looked up; pass --reward-key"
            raise RewardValueError(f"the reward is a dict without key '{key}' ({hint}); keys present: {sorted(value)}")
        value = value[key]
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # numpy scalars, one-element arrays and tensors
        except (ValueError, RuntimeError):
            pass
    if not isinstance(value, numbers.Real):
        raise RewardValueError(f"the reward function returned {type(value).__name__} {str(value)[:80]!r}, expected a number")
    out = float(value)
    if not math.isfinite(out):
        raise RewardValueError(f"the reward function returned {out}, expected a finite number")
    return out, raw_dict


class Rewarder:
    """The reward chosen by the flags, resolved and checked at construction."""

    def __init__(self, reward: RewardConfig, args: PluginArgs | None = None, *,
                 rewards_from_generate: bool = False) -> None:
        """``rewards_from_generate``: a --custom-generate-function-path runs, which may set ``sample.reward``
        itself (Miles's tau-bench example); then naming no reward is allowed and only the samples it left
        unscored fail."""
        self.cfg = reward
        self.from_generate_only = False
        self.args = args if args is not None else PluginArgs(reward)
        self.remote = RemoteReward(reward.rm_url, reward.rm_timeout, reward.rm_max_retries) if reward.rm_url else None
        self.group = bool(reward.group_rm)
        self._first_failure_logged = False
        self.custom: Callable[..., Any] | None = None
        self._custom_arity = 2
        self._spec_functions: dict[str, tuple[Callable[..., Any], int]] = {}
        if not reward.rm_timeout > 0:
            raise ConfigError(f"--rm-timeout must be a positive number of seconds, got {reward.rm_timeout}.")
        if reward.custom_rm_path:
            self.custom = load_function(reward.custom_rm_path, "--custom-rm-path")
            what = "samples" if self.group else "sample"
            forms = (f"async def f(args, {what}) or async def f({what})"
                     + (" returning one reward per sample (--group-rm)" if self.group else " returning a float"))
            self._custom_arity = choose_arity(self.custom, (1, 2), "--custom-rm-path", reward.custom_rm_path, forms)
        elif self.group:
            raise ConfigError("--group-rm needs --custom-rm-path module.function taking a whole group.")
        elif reward.rm_type is None and rewards_from_generate:
            self.from_generate_only = True
        elif reward.rm_type is None:
            raise ConfigError(f"no reward chosen: pass --rm-type ({', '.join(registered_rewards())}) or "
                              f"--custom-rm-path module.function (or a --custom-generate-function-path that sets "
                              f"sample.reward).")
        else:
            self._builtin(reward.rm_type, "--rm-type")

    def _spec_function(self, path: str) -> tuple[Callable[..., Any], int]:
        """(the reward function a sample's ``reward_spec.custom_rm_path`` names, its arity), loaded once."""
        cache = self._spec_functions
        if path not in cache:
            fn = load_function(path, "sample.reward_spec.custom_rm_path")
            cache[path] = fn, choose_arity(fn, (1, 2), "sample.reward_spec.custom_rm_path", path,
                                           "async def f(args, sample) or async def f(sample) returning a float")
        return cache[path]

    def _builtin(self, name: str, flag: str) -> tuple[RewardFn, str | None]:
        """(``f(args, sample)``, its default reward key) for a built-in name; ConfigError for unknown names."""
        if name == "remote_rm":
            if self.remote is None:
                raise ConfigError("--rm-type remote_rm needs --rm-url URL.")
            return self.remote.score, None
        found = builtin_call(name)
        if found is not None:
            return found
        hint = (f" ({BOXED_PREFIX} takes a verifier type: {BOXED_PREFIX}math, {BOXED_PREFIX}f1, ...)"
                if name.startswith(BOXED_PREFIX) else "")
        raise ConfigError(f"{flag} {name!r} is not a known reward; known: {', '.join(registered_rewards())}, "
                          f"or {BOXED_PREFIX}<type>{hint} (or use --custom-rm-path module.function).")

    async def _call_one(self, sample: Sample) -> tuple[Any, str | None]:
        timeout = self.cfg.rm_timeout
        spec = sample.reward_spec  # Miles's per-sample spec: its set fields win over the flags (rm_hub's order)
        if spec is not None and spec.custom_rm_path:
            fn, arity = self._spec_function(spec.custom_rm_path)
            what = f"sample.reward_spec.custom_rm_path {spec.custom_rm_path}"
            return await call_bounded(fn, (self.args, sample) if arity == 2 else (sample,), timeout, what), None
        if self.custom is not None:
            call_args = (self.args, sample) if self._custom_arity == 2 else (sample,)
            what = f"--custom-rm-path {self.cfg.custom_rm_path}"
            return await call_bounded(self.custom, call_args, timeout, what), None
        name = (spec.rm_type if spec is not None else None) or sample.metadata.get("rm_type") or self.cfg.rm_type
        fn, key = self._builtin(name, "sample.reward_spec.rm_type" if spec is not None and spec.rm_type else
                                "metadata 'rm_type'" if sample.metadata.get("rm_type") else "--rm-type")
        if name == "remote_rm":
            return await self.remote.score(sample), None  # type: ignore[union-attr]  # bounded per try
        if getattr(fn, "miles_inline", False):  # a thread per sample cost more than the check (~0.1 ms each)
            return fn(self.args, sample), key
        return await call_bounded(fn, (self.args, sample), timeout, f"--rm-type {name}"), key

    def _fail(self, sample: Sample, reason: str, exc: BaseException | None = None) -> None:
        sample.status = SampleStatus.FAILED
        sample.reward = None
        sample.metadata["reward_error"] = reason
        msg = "reward failed for sample %d (group %d, rollout %d): %s"
        if exc is not None and not isinstance(exc, TimeoutError) and not self._first_failure_logged:
            self._first_failure_logged = True
            logger.error(msg, sample.index, sample.group_index, sample.rollout_id, reason, exc_info=exc)
        else:
            logger.error(msg, sample.index, sample.group_index, sample.rollout_id, reason)

    def _assign(self, sample: Sample, value: Any, default_key: str | None = None) -> bool:
        if self.cfg.custom_reward_post_process_path:  # Miles: the raw value waits for the post-process
            if value is None:
                self._fail(sample, "the reward function returned None")
                return False
            sample.reward = value
            return True
        try:
            sample.reward, raw = to_reward(value, self.cfg.reward_key or default_key)
        except RewardValueError as e:
            self._fail(sample, str(e))
            return False
        if raw is not None:
            sample.metadata["rewards"] = raw
        return True

    async def score_sample(self, sample: Sample) -> bool:
        """Reward one finished sample; False (and status FAILED) when the reward failed. A reward the generate
        function set is kept (as in Miles, only samples whose reward is None are scored)."""
        if sample.reward is not None:
            return True
        if self.from_generate_only:
            self._fail(sample, "the --custom-generate-function-path function left sample.reward unset and no "
                               "--rm-type / --custom-rm-path is given")
            return False
        try:
            value, key = await self._call_one(sample)
        except asyncio.CancelledError:
            raise
        except TimeoutError as e:
            self._fail(sample, str(e), e)
            return False
        except Exception as e:
            self._fail(sample, f"{type(e).__name__}: {e}", e)
            return False
        return self._assign(sample, value, key)

    async def score_group(self, samples: list[Sample]) -> int:
        """Reward the scorable samples of one group (per sample, or at once with --group-rm); returns failures."""
        todo = [s for s in samples if s.status in SCORABLE]
        if not todo:
            return 0
        if not self.group:
            ok = await asyncio.gather(*(self.score_sample(s) for s in todo))
            return sum(1 for x in ok if not x)
        try:
            call_args = (self.args, todo) if self._custom_arity == 2 else (todo,)
            what = f"--custom-rm-path {self.cfg.custom_rm_path} (--group-rm)"
            values = await call_bounded(self.custom, call_args, self.cfg.rm_timeout, what)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            raise
        except TimeoutError as e:
            for s in todo:
                self._fail(s, str(e), e)
            return len(todo)
        except Exception as e:
            for s in todo:
                self._fail(s, f"group reward raised {type(e).__name__}: {e}", e)
            return len(todo)
        if not isinstance(values, list | tuple) or len(values) != len(todo):
            got = f"{type(values).__name__} of length {len(values)}" if isinstance(values, list | tuple) else type(values).__name__
            for s in todo:
                self._fail(s, f"--group-rm function returned {got}, expected a list of {len(todo)} rewards")
            return len(todo)
        return sum(1 for s, v in zip(todo, values) if not self._assign(s, v))

    async def aclose(self) -> None:
        if self.remote is not None:
            await self.remote.aclose()
