"""``--eval-function-path``: a user function that produces the evaluation results (Miles's contract).

    def generate_rollout(args, rollout_id, data_source, evaluation=False)   # sync or async; called with evaluation=True
        -> {name: {"rewards": [...], "truncated": [...], "samples": [...]}}  | RolloutFnEvalOutput(data=..., metrics=...)

Unset, it is a custom ``--rollout-function-path`` (Miles's default: the rollout function evaluates too; not miles's
SFT rollout, which makes training data only). It runs instead of the built-in evaluation, at the same moments (before training unless
``--skip-eval-before-train``, every ``--eval-interval`` rollouts and after the last one), with the same datasets
(``--eval-config`` / ``--eval-prompt-data``, which Miles requires with ``--eval-interval``). ``args`` is the
:class:`~miles.rollout.plugins.PluginArgs` rollout functions get, with ``args.eval_config`` (the document's path, or
``base64:...``, which Miles's eval_delegate_rollout reads itself for its ``eval.delegate`` section),
``args.eval_datasets`` (the resolved specs) and ``args.sglang_router_ip`` / ``args.sglang_router_port`` (the router
of this run's engines, as Miles sets them). ``data_source`` is the training data source (Miles's data-buffer API).
``miles.rollout.sglang_rollout.generate_rollout(args, rollout_id, data_source, evaluation=True)``, called from a
plain (sync) eval function, runs the built-in evaluation and returns its data as a ``RolloutFnEvalOutput``, as in
Miles (its eval_delegate_rollout adds an external server's metrics to it).

The results are logged as Miles logs them (``log_eval_rollout_data``): per dataset ``eval/<name>`` (the mean
reward, a None reward counted as 0), ``eval/<name>-none_reward_ratio``, ``eval/<name>-truncated_ratio`` (with
``truncated``) and ``eval/<name>/response_len/{mean,median,max,min}``, ``eval/<name>/truncated_ratio`` (with
``samples``); the returned ``metrics`` are logged as they are. The call is bounded by
``--distributed-timeout-minutes``; a failure, a timeout or a result of another shape is one line naming the flag and
the function.
"""

from __future__ import annotations

import asyncio
import inspect
import statistics
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from miles.config.base import ConfigError
from miles.config.eval_datasets import DEFAULT_EVAL_PATHS, custom_eval_function, evaluating_function
from miles.rollout.plugins import PluginArgs, call_bounded, client_address, load_function, router_address
from miles.rollout.rewards import pass_at_k
from miles.rollout.rollout_fn import MilesDataBuffer, check_signature, construct_rollout_class, is_rollout_class
from miles.types import Sample, SampleStatus
from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

FLAG = "--eval-function-path"
FORMS = "def generate_rollout(args, rollout_id, data_source, evaluation=False)"
SHAPE = ("a dict of dataset name -> {'rewards': [number or None, ...], 'truncated': [bool, ...], 'samples': "
         "[Sample, ...]} ('truncated' and 'samples' optional), or RolloutFnEvalOutput(data=<that dict>, metrics={...})")
BuiltinEval = Callable[[int], Awaitable[tuple[dict[str, dict[str, Any]], dict[str, float]]]]


class EvalFunctionError(MilesError):
    """The --eval-function-path function failed, timed out or returned something else than eval results."""


def check_eval_function(fn: Any, path: str) -> None:
    """ConfigError unless Miles's legacy eval call ``fn(args, rollout_id, data_source, evaluation=True)`` binds, or
    ``fn`` is a class-based rollout function (a CheckpointEvalFn, Miles's snapshot-eval backend, is refused)."""
    if inspect.isclass(fn) and any(c.__name__ == "CheckpointEvalFn" for c in fn.__mro__):
        raise ConfigError(f"{FLAG} {path!r} is a CheckpointEvalFn (Miles's snapshot-eval backend, which evaluates "
                          f"exported checkpoints with train_async.py and --eval-hf-dir); miles does not run it: give "
                          f"a function ({FORMS}) or a class-based rollout function.")
    check_signature(fn, path, flag=FLAG)


def eval_data_of(out: Any, what: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(data, metrics) of what an eval function returned; EvalFunctionError naming ``what`` for another shape."""
    metrics: Any = {}
    if hasattr(out, "data") and not isinstance(out, dict):
        metrics, out = getattr(out, "metrics", None) or {}, out.data
    if not isinstance(out, dict) or not isinstance(metrics, dict):
        got = type(out).__name__ if not isinstance(out, dict) else f"metrics of type {type(metrics).__name__}"
        raise EvalFunctionError(f"{what} returned {got}; expected {SHAPE}.")
    for name, entry in out.items():
        where = f"{what} returned data[{name!r}]"
        if not isinstance(name, str) or not isinstance(entry, dict) or not isinstance(entry.get("rewards"), list | tuple):
            raise EvalFunctionError(f"{where} = {type(entry).__name__} without a 'rewards' list; expected {SHAPE}.")
        rewards = entry["rewards"]
        bad = next((r for r in rewards if r is not None and (isinstance(r, bool) or not isinstance(r, int | float))), 0)
        if bad != 0:
            raise EvalFunctionError(f"{where}['rewards'] holds {bad!r}; each reward must be a number or None "
                                    "(a dict-valued reward needs --reward-key).")
        for key, kind in (("truncated", bool), ("samples", Sample)):
            if key in entry and entry[key] is not None:
                values = entry[key]
                if not isinstance(values, list | tuple) or not all(isinstance(v, kind) for v in values):
                    raise EvalFunctionError(f"{where}[{key!r}] must be a list of {kind.__name__}; expected {SHAPE}.")
                if len(values) != len(rewards):
                    raise EvalFunctionError(f"{where}[{key!r}] has {len(values)} entries for {len(rewards)} rewards.")
    return out, metrics


def miles_eval_metrics(data: dict[str, dict[str, Any]], extra: dict[str, Any] | None = None, *,
                       passrate_group_size: int | None = None) -> dict[str, float]:
    """Miles v0.1.0's ``log_eval_rollout_data`` over eval data; with ``passrate_group_size`` (``--log-passrate``:
    the samples per eval prompt) also ``eval/<name>-pass@k`` over consecutive groups of that many rewards."""
    log: dict[str, float] = {k: float(v) for k, v in (extra or {}).items()
                             if isinstance(v, int | float) and not isinstance(v, bool)}
    for name, entry in data.items():
        rewards = list(entry["rewards"])
        none = sum(r is None for r in rewards)
        log[f"eval/{name}-none_reward_ratio"] = none / len(rewards) if rewards else 0.0
        if none:
            logger.warning("eval/%s: %d/%d samples have reward=None (likely errored/aborted trials); treating as 0.0 "
                           "for metrics.", name, none, len(rewards))
        rewards = [0.0 if r is None else float(r) for r in rewards]
        log[f"eval/{name}"] = sum(rewards) / len(rewards) if rewards else 0.0
        samples = entry.get("samples")
        if samples:
            lengths = [s.response_length for s in samples]
            log.update({f"eval/{name}/response_len/mean": statistics.fmean(lengths),
                        f"eval/{name}/response_len/median": float(statistics.median(lengths)),
                        f"eval/{name}/response_len/max": float(max(lengths)),
                        f"eval/{name}/response_len/min": float(min(lengths)),
                        f"eval/{name}/truncated_ratio":
                            sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples)})
        if entry.get("truncated"):
            log[f"eval/{name}-truncated_ratio"] = sum(map(bool, entry["truncated"])) / len(entry["truncated"])
        if passrate_group_size:
            n = passrate_group_size
            groups = [rewards[i:i + n] for i in range(0, len(rewards), n)]
            log.update({f"eval/{name}-{k}": v for k, v in pass_at_k(groups, n, f"eval/{name}").items()})
    return log


class BuiltinEvalHandle:
    """What ``miles.rollout.sglang_rollout.generate_rollout(..., evaluation=True)`` runs: the built-in evaluation on
    the driver's event loop, from the eval function's thread. Pending runs are cancelled when the call ends."""

    def __init__(self, run: BuiltinEval, loop: asyncio.AbstractEventLoop, timeout: float, rollout_id: int = 0) -> None:
        self.run, self.loop, self.timeout, self.rollout_id = run, loop, timeout, rollout_id
        self.address: tuple[str, int] | None = None
        self.futures: set[Any] = set()
        self.closed = False
        self._lock = threading.Lock()

    def __call__(self, rollout_id: int) -> dict[str, dict[str, Any]]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise EvalFunctionError("miles.rollout.sglang_rollout.generate_rollout(..., evaluation=True) was called "
                                    "from an async eval function, on the loop it needs: make the eval function a plain "
                                    "def (Miles calls it in a worker thread), or await the evaluation otherwise.")
        with self._lock:
            if self.closed:
                raise EvalFunctionError("the built-in evaluation was called after its eval function call ended")
            fut = asyncio.run_coroutine_threadsafe(self.run(rollout_id), self.loop)
            self.futures.add(fut)
        try:
            data, _ = fut.result(self.timeout)
        except TimeoutError:
            raise EvalFunctionError(f"the built-in evaluation did not return within --distributed-timeout-minutes "
                                    f"({self.timeout:g}s)") from None
        finally:
            with self._lock:
                self.futures.discard(fut)
        return data

    async def arun(self) -> dict[str, dict[str, Any]]:
        """The built-in evaluation of this call's rollout, awaited from any event loop (Miles's
        ``inference_rollout_eval.run_eval_datasets``)."""
        if asyncio.get_running_loop() is self.loop:
            try:
                data, _ = await asyncio.wait_for(self.run(self.rollout_id), self.timeout)
            except TimeoutError:
                raise EvalFunctionError(f"the built-in evaluation did not return within --distributed-timeout-minutes "
                                        f"({self.timeout:g}s)") from None
            return data
        return await asyncio.to_thread(self, self.rollout_id)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            for fut in self.futures:
                fut.cancel()


BUILTIN_ATTR = "_miles_builtin_eval"


_current: list[BuiltinEvalHandle] = []   # the handle of the eval call in progress (one at a time in a run)


def builtin_eval_of(args: Any) -> BuiltinEvalHandle | None:
    """The handle an eval function's ``args`` carry (None outside an --eval-function-path call)."""
    try:
        return object.__getattribute__(args, BUILTIN_ATTR)
    except AttributeError:
        return None


def current_builtin_eval() -> BuiltinEvalHandle | None:
    """The built-in evaluation of the eval call in progress (a class-based function's ``args`` are its
    constructor's, which carry no handle); None outside one."""
    return _current[-1] if _current else None


class EvalFunction:
    """Calls the eval function once per evaluation; ``evaluate`` is what the loops call. ``flag`` is the flag that
    named it (``--rollout-function-path`` when Miles's default of ``--eval-function-path`` applies)."""

    def __init__(self, path: str, args: PluginArgs, data_source: Any, n_samples_per_prompt: int, timeout: float,
                 builtin: BuiltinEval | None = None, flag: str = FLAG) -> None:
        self.path, self.args, self.data_source = path, args, data_source
        self.n, self.timeout, self.builtin = n_samples_per_prompt, timeout, builtin
        self.what = f"{flag} {path}" if flag == FLAG else f"{flag} {path} (evaluating: --eval-function-path is unset)"
        self.fn = load_function(path, flag)
        if flag == FLAG:
            check_eval_function(self.fn, path)
        self.instance: Any = None
        if is_rollout_class(self.fn):  # Miles's class-based rollout function: built once, called per evaluation
            check_signature(self.fn, path, flag=flag)
            buffer = MilesDataBuffer(data_source, self.n, 0) if data_source is not None else None
            self.instance = construct_rollout_class(self.fn, path, args, buffer, flag=flag)

    def _call(self, args: PluginArgs, rollout_id: int, buffer: Any) -> Any:
        if self.instance is not None:
            from miles.rollout.base_types import RolloutFnEvalInput

            return self.instance(RolloutFnEvalInput(rollout_id=rollout_id))
        return self.fn(args, rollout_id, buffer, evaluation=True)

    def _args_of_call(self, handle: BuiltinEvalHandle | None) -> PluginArgs:
        """The flags view with this call's built-in eval handle: one object per call, so a timed-out call that
        goes on in its thread reaches its own (closed) handle, never a later call's."""
        args = object.__new__(PluginArgs)
        args.__dict__.update(self.args.__dict__)
        args.__dict__[BUILTIN_ATTR] = handle
        return args

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        handle = None
        if self.builtin is not None:
            handle = BuiltinEvalHandle(self.builtin, asyncio.get_running_loop(), self.timeout, rollout_id)
            address = (getattr(self.args, "sglang_router_ip", None), getattr(self.args, "sglang_router_port", None))
            handle.address = address if None not in address else None   # where it evaluates (run_eval_datasets)
            _current.append(handle)
        args = self._args_of_call(handle)
        buffer = MilesDataBuffer(self.data_source, self.n, rollout_id) if self.data_source is not None else None
        try:
            out = await call_bounded(self._call, (args, rollout_id, buffer), self.timeout, self.what,
                                     flag="--distributed-timeout-minutes (in seconds)")
        except TimeoutError as e:
            raise EvalFunctionError(str(e)) from None
        except EvalFunctionError as e:
            raise EvalFunctionError(f"{self.what}: {e}") from None
        except Exception as e:  # the user's function failed: one line naming it (its traceback is in the log)
            logger.debug("%s failed", self.what, exc_info=True)
            first = (str(e).splitlines() or [""])[0]
            raise EvalFunctionError(f"{self.what} failed: {type(e).__name__}: {first}") from None
        finally:
            if handle is not None:
                handle.close()
                _current.remove(handle)
        data, metrics = eval_data_of(out, self.what)
        n = getattr(self.args, "n_samples_per_eval_prompt", None) if getattr(self.args, "log_passrate", False) else None
        return miles_eval_metrics(data, metrics, passrate_group_size=n)


def eval_function_of(cfg: Any) -> tuple[str, str] | None:
    """(path, flag) of the function that evaluates, or None for the built-in evaluation: ``--eval-function-path``,
    else (Miles's default) a custom ``--rollout-function-path``; not miles's SFT rollout, which makes training data
    only (Miles's asserts ``not evaluation``), nor Miles's default / fully async names."""
    from miles.rollout.rollout_fn import FLAG as ROLLOUT_FLAG

    path = evaluating_function(cfg.eval, cfg.data)
    if path is None:
        return None
    return path, FLAG if custom_eval_function(cfg.eval) is not None else ROLLOUT_FLAG


def build_eval_function(cfg: Any, data_source: Any, tokenizer: Any, client: Any = None, router_url: str | None = None,
                        builtin: BuiltinEval | None = None, extra: dict[str, Any] | None = None) -> EvalFunction | None:
    """The runner of the eval function (:func:`eval_function_of`), or None when the built-in evaluation serves."""
    chosen = eval_function_of(cfg)
    if chosen is None:
        return None
    path, flag = chosen
    sections = (cfg.data, cfg.rollout, cfg.reward, cfg.eval, cfg.algo, cfg.train, cfg.cluster, cfg.weights,
                cfg.checkpoint, cfg.output)
    args = PluginArgs(*sections, client=client, tokenizer=tokenizer, extra=extra,
                      overrides=router_address(router_url) or client_address(client))
    return EvalFunction(path, args, data_source, cfg.data.n_samples_per_prompt,
                        timeout=cfg.cluster.distributed_timeout_minutes * 60.0, builtin=builtin, flag=flag)


__all__ = ["DEFAULT_EVAL_PATHS", "EvalFunction", "EvalFunctionError", "build_eval_function", "builtin_eval_of",
           "check_eval_function", "current_builtin_eval", "eval_data_of", "eval_function_of", "miles_eval_metrics"]
