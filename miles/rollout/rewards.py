"""Rewards: built-in verifiers (``--rm-type``), a remote reward server, or a user function.

    rewarder = Rewarder(cfg.reward, plugin_args)    # resolves and checks everything at start-up
    failures = await rewarder.score_group(samples)  # sets sample.reward; failures -> status FAILED

Built-ins (``--rm-type``): ``exact_match`` (stripped response == label), ``math`` (boxed / last-number
answer, normalised, see ``rm_hub/math_answer.py``), ``quickstart`` (``rm_hub/quickstart.py``) and
``remote_rm`` (POST ``{prompt, response, label}`` to ``--rm-url``, ``--rm-timeout`` per try,
``--rm-max-retries`` retries on connection errors, timeouts, 429 and 5xx). ``register_reward(name, fn)``
adds a name (e.g. from an example's module); a sample's ``metadata["rm_type"]`` overrides the flag.

``--custom-rm-path module.function``: ``async def f(args, sample) -> float`` (Miles's signature; ``args``
is a read-only :class:`~miles.rollout.plugins.PluginArgs` view of the flags) or ``async def f(sample)``;
with ``--group-rm``, ``f(args, samples)`` / ``f(samples)`` returning one reward per sample.
Plain (non-async) functions are accepted and run inline on the event loop.

A reward may be a number (bool counts as 0/1) or a dict, from which ``--reward-key`` picks the value
(``"reward"`` is used when the flag is unset); the whole dict is kept in ``sample.metadata["rewards"]``.
A reward function that raises, or returns a non-number, NaN or infinity, fails that sample visibly:
status FAILED, ``reward`` None, the reason in ``metadata["reward_error"]``, logged with the sample's
index and counted by the caller (``rollout/reward_failures``); it is never silently zeroed.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from miles.config.base import ConfigError
from miles.config.data import RewardConfig
from miles.rollout.plugins import PluginArgs, choose_arity, load_function, maybe_await
from miles.rollout.rm_hub.math_answer import math_reward
from miles.rollout.rm_hub.quickstart import quickstart_reward
from miles.types import Sample, SampleStatus
from miles.utils.logging import get_logger

logger = get_logger(__name__)

RewardFn = Callable[[Any, Sample], Awaitable[Any] | Any]
_REGISTRY: dict[str, RewardFn] = {}
SCORABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


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


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def _need_label(sample: Sample, rm: str) -> Any:
    if sample.label is None:
        raise ValueError(f"--rm-type {rm} needs a label, and this sample has none: pass --label-key naming the field.")
    return sample.label


@register_reward("exact_match")
def exact_match(args: Any, sample: Sample) -> float:
    return 1.0 if sample.response.strip() == str(_need_label(sample, "exact_match")).strip() else 0.0


@register_reward("math")
def math_rm(args: Any, sample: Sample) -> float:
    return math_reward(sample.response, sample.label)


@register_reward("quickstart")
def quickstart_rm(args: Any, sample: Sample) -> float:
    return quickstart_reward(sample.response, sample.label)


@register_reward("remote_rm")
async def remote_rm(args: Any, sample: Sample) -> Any:
    raise RuntimeError("remote_rm is served by Rewarder (it holds the HTTP session); call Rewarder.score_sample")


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
        import aiohttp

        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.25 * 2 ** (attempt - 1), 4.0))
            try:
                async with self._get_session().post(self.url, json=payload) as resp:
                    if resp.status == 429 or resp.status >= 500:
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        continue
                    if resp.status >= 400:
                        raise RuntimeError(f"--rm-url {self.url} answered HTTP {resp.status}: {(await resp.text())[:200]}")
                    return await resp.json(content_type=None)
            except (TimeoutError, aiohttp.ClientError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise RuntimeError(f"--rm-url {self.url} failed {self.max_retries + 1} times (--rm-timeout {self.timeout}s, "
                           f"--rm-max-retries {self.max_retries}); last error: {last}")

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

    def __init__(self, reward: RewardConfig, args: PluginArgs | None = None) -> None:
        self.cfg = reward
        self.args = args if args is not None else PluginArgs(reward)
        self.remote = RemoteReward(reward.rm_url, reward.rm_timeout, reward.rm_max_retries) if reward.rm_url else None
        self.group = bool(reward.group_rm)
        self._first_failure_logged = False
        self.custom: Callable[..., Any] | None = None
        self._custom_arity = 2
        if reward.custom_rm_path:
            self.custom = load_function(reward.custom_rm_path, "--custom-rm-path")
            what = "samples" if self.group else "sample"
            forms = (f"async def f(args, {what}) or async def f({what})"
                     + (" returning one reward per sample (--group-rm)" if self.group else " returning a float"))
            self._custom_arity = choose_arity(self.custom, (1, 2), "--custom-rm-path", reward.custom_rm_path, forms)
        elif self.group:
            raise ConfigError("--group-rm needs --custom-rm-path module.function taking a whole group.")
        elif reward.rm_type is None:
            raise ConfigError(f"no reward chosen: pass --rm-type ({', '.join(registered_rewards())}) or "
                              f"--custom-rm-path module.function.")
        else:
            self._builtin(reward.rm_type, "--rm-type")

    def _builtin(self, name: str, flag: str) -> RewardFn:
        if name not in _REGISTRY:
            raise ConfigError(f"{flag} {name!r} is not a known reward; known: {', '.join(registered_rewards())} "
                              f"(or use --custom-rm-path module.function).")
        if name == "remote_rm" and self.remote is None:
            raise ConfigError("--rm-type remote_rm needs --rm-url URL.")
        return _REGISTRY[name]

    async def _call_one(self, sample: Sample) -> Any:
        if self.custom is not None:
            call_args = (self.args, sample) if self._custom_arity == 2 else (sample,)
            return await maybe_await(self.custom(*call_args))
        name = sample.metadata.get("rm_type") or self.cfg.rm_type
        fn = self._builtin(name, "metadata 'rm_type'" if sample.metadata.get("rm_type") else "--rm-type")
        if name == "remote_rm":
            return await self.remote.score(sample)  # type: ignore[union-attr]
        return await maybe_await(fn(self.args, sample))

    def _fail(self, sample: Sample, reason: str, exc: BaseException | None = None) -> None:
        sample.status = SampleStatus.FAILED
        sample.reward = None
        sample.metadata["reward_error"] = reason
        msg = "reward failed for sample %d (group %d, rollout %d): %s"
        if exc is not None and not self._first_failure_logged:
            self._first_failure_logged = True
            logger.error(msg, sample.index, sample.group_index, sample.rollout_id, reason, exc_info=exc)
        else:
            logger.error(msg, sample.index, sample.group_index, sample.rollout_id, reason)

    def _assign(self, sample: Sample, value: Any) -> bool:
        try:
            sample.reward, raw = to_reward(value, self.cfg.reward_key)
        except RewardValueError as e:
            self._fail(sample, str(e))
            return False
        if raw is not None:
            sample.metadata["rewards"] = raw
        return True

    async def score_sample(self, sample: Sample) -> bool:
        """Reward one finished sample; False (and status FAILED) when the reward failed."""
        try:
            value = await self._call_one(sample)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(sample, f"{type(e).__name__}: {e}", e)
            return False
        return self._assign(sample, value)

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
            values = await maybe_await(self.custom(*call_args))  # type: ignore[misc]
        except asyncio.CancelledError:
            raise
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
