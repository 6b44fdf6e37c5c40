"""The rollout manager (driver rank): prompts -> /generate fan-out -> rewards -> dynamic sampling.

    manager = RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, tokenizer, data_source,
                             eval_cfg=cfg.eval, progress=bar_update)
    result = await manager.generate_rollout(rollout_id)   # RolloutResult(samples=[[Sample] * n] * B, metrics)
    metrics = await manager.evaluate(eval_datasets, rollout_id)

Each rollout draws ``--rollout-batch-size`` prompts (``--over-sampling-batch-size`` at a time with a
``--dynamic-sampling-filter-path``), runs ``--n-samples-per-prompt`` samples per prompt concurrently
(the client bounds concurrency and retries failed requests on another engine), rewards each sample
(or each group with ``--group-rm``) and keeps groups the filter accepts.

Reproducibility: sample ``i`` of group ``g`` in rollout ``r`` gets ``sampling_seed`` =
hash(``--rollout-seed``, r, g) + i, and the kept groups are the first ``--rollout-batch-size`` passing
groups *in launch order* (not completion order), so two runs with the same seed and weights keep the
same groups. While the filter keeps too few, more are launched, with a progress line (kept / finished, the drop
reasons) each ``FILTER_REPORT_EVERY`` x ``--rollout-batch-size`` groups; after one pass over the data (Miles
goes on forever) the rollout ends with a RolloutError naming the filter and the kept count. Groups after the
last kept one are surplus: their requests are aborted by rid and their unused prompts are given back to the data
source.

Every sample slot is filled exactly once: generation errors (after the client's retries) and reward
errors mark that sample FAILED and are counted (``rollout/generate_failures``,
``rollout/reward_failures``); a rollout in which every kept sample failed raises RolloutError. A sample
the engine aborted (e.g. paused for a weight update) is generated again, up to 3 times.

With ``group_requests`` (the embedded engine, which seeds sample ``j`` of an ``n``-sample request
``sampling_seed + j``) a group's samples are ONE ``/generate`` with ``sampling_params.n`` (sglang-router
passes it through) instead of one request per sample: the same seeds, so the same samples; a sample
aborted by the engine is then generated again alone. Custom generate functions always go per sample.

A custom generate function may return several samples for its slot (Miles's multi-sample output, e.g. its
multi-agent example: one sample per agent call): each is checked as one sample, shares the slot's group, index and
rollout, is rewarded unless the function set its reward, and joins the slot's group once the group is generated
(so the group, its filter, its group reward and its reward normalisation see them all).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.config.base import ConfigError
from miles.config.data import DataConfig, EvalConfig, RewardConfig
from miles.config.eval_datasets import EvalDatasetSpec, resolve_eval_datasets
from miles.config.rollout import RolloutConfig
from miles.config.router import router_policy, uses_routing_key
from miles.rollout import generate as gen
from miles.rollout.base_types import input_form
from miles.rollout.data import DataSource, EvalDataset, PromptDataset, PromptItem
from miles.rollout.eval_fn import miles_eval_metrics
from miles.rollout.filters import MetricGatherer, call_filter, load_filter
from miles.rollout.opd_topk import student_top_k
from miles.rollout.plugins import (
    PluginArgs,
    call_bounded,
    choose_arity,
    client_address,
    is_async,
    load_function,
    reward_value,
)
from miles.rollout.reward_post_process import RewardPostProcess
from miles.rollout.rewards import Rewarder, pass_at_k, reward_category_metrics
from miles.types import Sample, SampleError, SampleStatus
from miles.utils.errors import MilesError
from miles.utils.http_utils import close_http_client, init_http_client
from miles.utils.logging import get_logger

logger = get_logger(__name__)
FILTER_REPORT_EVERY = 4   # while the filter keeps too few groups: one progress line each 4 x --rollout-batch-size launched

ProgressFn = Callable[[int, int], None]


class RolloutError(MilesError):
    """A rollout cannot produce training data (every sample failed, or the filter starves it)."""


@dataclass
class RolloutResult:
    samples: list[list[Sample]]
    metrics: dict[str, float]


def group_seed(seed: int, stream: str, rollout_id: int, group: int) -> int:
    """A 62-bit seed that depends only on its arguments (stable across runs and platforms); sample ``i`` of the
    group is seeded ``group_seed(...) + i`` (below 2**63), as the engine seeds the samples of one n-sample request."""
    digest = hashlib.blake2b(f"{seed}:{stream}:{rollout_id}:{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


@dataclass
class _Group:
    index: int
    item: PromptItem
    samples: list[Sample] = field(default_factory=list)
    task: asyncio.Task | None = None
    done: bool = False
    kept: bool = False
    aborted: bool = False
    rids: set[str] = field(default_factory=set)
    requests: int = 0
    generate_path: str | None = None  # an eval dataset's custom_generate_function_path (None: the manager's)
    more: dict[int, list[Sample]] = field(default_factory=dict)  # slot -> further samples its generate function gave


_CURRENT: contextvars.ContextVar[tuple[_Group, Sample] | None] = contextvars.ContextVar("miles_rollout_slot", default=None)


def _aborted_response(prompt_len: int, why: str) -> dict[str, Any]:
    return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": why},
            "prompt_tokens": prompt_len, "completion_tokens": 0, "output_token_logprobs": []}}


class TrackedClient:
    """Wraps the EngineClient for generate functions: request ids the manager can abort, retry counts.

    Requests made inside a sample's task get rid ``<run>-<stream>-r<rollout>-g<group>-s<index>-<k>`` and, when the
    sample has a ``routing_key`` and the call names none, that key; once the group is aborted, further requests are
    answered locally as aborted.
    """

    def __init__(self, inner: Any, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix
        self.retries = 0

    async def generate(self, input_ids: Any, sampling_params: dict[str, Any], return_logprob: bool = True,
                       rid: str | None = None, **kwargs: Any) -> dict[str, Any]:
        slot = _CURRENT.get()
        if slot is None:
            return await self.inner.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid, **kwargs)
        group, sample = slot
        if group.aborted:
            return _aborted_response(len(input_ids), "aborted by the rollout manager (surplus group)")
        group.requests += 1
        rid = rid or f"{self.prefix}-r{sample.rollout_id}-g{group.index}-s{sample.index}-{group.requests}"
        if sample.routing_key and "routing_key" not in kwargs:   # a plugin's own call: the sample's engine
            kwargs["routing_key"] = sample.routing_key
        group.rids.add(rid)
        try:
            resp = await self.inner.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid, **kwargs)
        finally:
            group.rids.discard(rid)
        if isinstance(resp, dict) and isinstance(resp.get("miles"), dict):
            self.retries += max(0, int(resp["miles"].get("attempts", 1)) - 1)
        return resp

    async def generate_group(self, g: _Group, rollout_id: int, input_ids: list[int], sampling_params: dict[str, Any],
                             n: int, **kwargs: Any) -> list[dict[str, Any]]:
        """Group ``g``'s ``n`` samples in one request (rid ``<run>-<stream>-r<rollout>-g<group>-n<k>``; the engine
        names sample ``j`` ``<rid>_<j>``, and an abort of the rid reaches them all)."""
        if g.aborted:
            return [_aborted_response(len(input_ids), "aborted by the rollout manager (surplus group)") for _ in range(n)]
        g.requests += 1
        rid = f"{self.prefix}-r{rollout_id}-g{g.index}-n{g.requests}"
        g.rids.add(rid)
        try:
            resps = await self.inner.generate_group(input_ids, sampling_params, n, rid=rid, **kwargs)
        finally:
            g.rids.discard(rid)
        if resps and isinstance(resps[0].get("miles"), dict):
            self.retries += max(0, int(resps[0]["miles"].get("attempts", 1)) - 1)
        return resps

    async def abort(self, rid: str) -> Any:
        return await self.inner.abort(rid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class _Counts:
    reward_failures: int = 0
    generate_failures: int = 0
    finished: int = 0
    launched: int = 0
    response_tokens: int = 0
    engine_abort_retries: int = 0
    reward_time: float = 0.0      # summed over reward calls (they overlap the generation of other samples)
    first_error: str | None = None
    progress: ProgressFn | None = None


class RolloutManager:
    """Generates one rollout (or an evaluation) from the driver rank; see the module docstring."""

    def __init__(self, rollout: RolloutConfig, data: DataConfig, reward: RewardConfig, client: Any, tokenizer: Any,
                 data_source: DataSource | None, *, eval_cfg: EvalConfig | None = None,
                 progress: ProgressFn | None = None, abort_grace: float = 10.0, engine_abort_retries: int = 3,
                 sections: tuple[Any, ...] = (), custom_config: dict[str, Any] | None = None,
                 group_requests: bool = False) -> None:
        if not data.rollout_batch_size:
            raise ConfigError("--rollout-batch-size is required: add --rollout-batch-size N (prompts per rollout).")
        if data.n_samples_per_prompt < 1:
            raise ConfigError(f"--n-samples-per-prompt must be >= 1, got {data.n_samples_per_prompt}.")
        self.rollout, self.data, self.reward, self.eval_cfg = rollout, data, reward, eval_cfg
        self.tokenizer, self.data_source, self.progress = tokenizer, data_source, progress
        self.abort_grace, self.engine_abort_retries = abort_grace, engine_abort_retries
        self.client = TrackedClient(client, uuid.uuid4().hex[:8])
        self.args = PluginArgs(rollout, data, reward, eval_cfg, *sections, client=self.client, tokenizer=tokenizer,
                               extra=custom_config, overrides=client_address(client))
        init_http_client(self.args)  # miles.utils.http_utils.post of plugins: --rollout-request-timeout per try
        self.rewarder = Rewarder(reward, self.args, rewards_from_generate=bool(data.custom_generate_function_path))
        if data.multimodal_keys:  # images: Sample.multimodal_train_inputs (Miles's plugins) from this processor
            from miles.utils.images import set_rollout_checkpoint

            set_rollout_checkpoint(getattr(self.args, "hf_checkpoint", None) or str(getattr(tokenizer, "name_or_path", "")))
        self.student_top_k = student_top_k(self.args)  # top-k OPD: the engines' top-k log-probs of each token
        self.routed_experts = bool(getattr(self.args, "use_rollout_routing_replay", False))  # R3: the MoE routing
        self.post_process = (RewardPostProcess(reward.custom_reward_post_process_path, self.args, reward.rm_timeout)
                             if reward.custom_reward_post_process_path else None)
        self._generate_fns: dict[str, Callable[..., Any]] = {}
        self.custom_generate = (self._generate_fn(data.custom_generate_function_path, "--custom-generate-function-path")
                                if data.custom_generate_function_path else None)
        self.filter = load_filter(data.dynamic_sampling_filter_path) if data.dynamic_sampling_filter_path else None
        self.group_requests = (bool(group_requests) and self.custom_generate is None
                               and callable(getattr(client, "generate_group", None)))
        # a routing-key policy (--sglang-router-policy manual): each sample gets a key of its own, as in Miles
        self.routing_keys = uses_routing_key(router_policy(rollout))
        self.batch = data.rollout_batch_size
        self.over = data.over_sampling_batch_size or self.batch
        if data.over_sampling_batch_size and self.filter is None:
            logger.warning("--over-sampling-batch-size %d has no effect without --dynamic-sampling-filter-path",
                           data.over_sampling_batch_size)

    def _generate_fn(self, path: str, flag: str) -> Callable[..., Any]:
        """The ``(args, sample, sampling_params)`` form of a custom generate function (loaded once per path)."""
        if path not in self._generate_fns:
            fn = load_function(path, flag)
            forms = ("async def generate(args, sample, sampling_params) -> Sample, or Miles's "
                     "async def generate(input: GenerateFnInput) -> GenerateFnOutput")
            arity = choose_arity(fn, (1, 3), flag, path, forms)
            if not is_async(fn):
                raise ConfigError(f"{flag} {path!r} must be a coroutine function ({forms}).")
            self._generate_fns[path] = fn if arity == 3 else input_form(fn)
        return self._generate_fns[path]

    # ------------------------------------------------------------------ one sample / one group
    def _new_group(self, index: int, item: PromptItem, rollout_id: int, n: int) -> _Group:
        g = _Group(index=index, item=item)
        g.samples = [self._fresh_sample(g, rollout_id, i, n) for i in range(n)]
        if self.routing_keys:   # Miles's generate_and_rm_group: a fresh key per sample under a routing-key policy
            for sample in g.samples:
                sample.routing_key = str(uuid.uuid4())
        return g

    @staticmethod
    def _fresh_sample(g: _Group, rollout_id: int, i: int, n: int) -> Sample:
        meta = copy.deepcopy(g.item.metadata)
        if g.item.tools is not None:
            meta.setdefault("tools", g.item.tools)
        return Sample(group_index=g.index, index=g.index * n + i, rollout_id=rollout_id, prompt=g.item.sample_prompt,
                      tokens=list(g.item.prompt_ids), label=g.item.label, metadata=meta)

    @staticmethod
    def _check_generated(sample: Sample) -> str | None:
        """What is wrong with a generate function's sample, or None. Its prompt (``tokens`` before the response) may be
        the data's prompt ids or one the function built itself (Miles's tau-bench agent templates its environment's
        first message)."""
        if not isinstance(sample, Sample):
            return f"returned {type(sample).__name__}, expected a Sample (or a non-empty list of Samples)"
        if not 0 <= sample.response_length < len(sample.tokens):
            return (f"tokens ({len(sample.tokens)}) must be the prompt ids followed by response_length "
                    f"({sample.response_length}) response ids, with at least one prompt id")
        if not isinstance(sample.status, SampleStatus):
            try:   # Miles's plugins may give the status as its value (tau-bench's res_to_sample: "completed")
                sample.status = SampleStatus(sample.status)
            except ValueError:
                return f"status {sample.status!r} is not one of {[s.value for s in SampleStatus]}"
        try:
            sample.validate()   # the per-token fields agree with response_length (Miles's Sample.validate)
            sample.store_multimodal_inputs()   # Miles's multimodal_inputs as the function left it: the trained images
        except SampleError as e:
            return str(e)
        if sample.status is SampleStatus.PENDING:
            return "left the sample's status PENDING"
        return None

    async def _generate_slot(self, g: _Group, slot: int, params: dict[str, Any], counts: _Counts) -> Sample:
        """Run the generate function on slot ``slot``; an exception marks the sample FAILED (counted)."""
        sample = g.samples[slot]
        token = _CURRENT.set((g, sample))
        path = g.generate_path or self.data.custom_generate_function_path
        custom = self._generate_fns[g.generate_path] if g.generate_path else self.custom_generate
        try:
            if custom is not None:  # bounded: one that never returns fails its sample, naming the flag
                out = await call_bounded(custom, (self.args, sample, params), self.data.custom_generate_function_timeout,
                                         f"--custom-generate-function-path {path}",
                                         flag="--custom-generate-function-timeout")
                outs = out if isinstance(out, list) and out else [out]   # Miles's multi-sample output: a list
                for one in outs:
                    problem = self._check_generated(one)
                    if problem is not None:
                        raise RuntimeError(f"--custom-generate-function-path {path}: {problem}")
                    one.group_index, one.index, one.rollout_id = sample.group_index, sample.index, sample.rollout_id
                g.samples[slot] = sample = outs[0]
                g.more[slot] = outs[1:]
            else:
                await gen.generate(self.client, sample, params, top_logprobs_num=self.student_top_k,
                                   routed_experts=self.routed_experts)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            sample.status = SampleStatus.FAILED
            sample.metadata["generate_error"] = f"{type(e).__name__}: {e}"
            counts.generate_failures += 1
            counts.first_error = counts.first_error or f"generation: {type(e).__name__}: {e}"
            logger.error("generation failed for sample %d (group %d, rollout %d): %s: %s", sample.index,
                         sample.group_index, sample.rollout_id, type(e).__name__, e)
        finally:
            _CURRENT.reset(token)
        return sample

    async def _generate_group(self, g: _Group, params: dict[str, Any], counts: _Counts) -> None:
        """Every sample of ``g`` from one n-sample request; a failed request marks them all FAILED (counted)."""
        n, first = len(g.samples), g.samples[0]
        extra = gen.request_extra(self.student_top_k, self.routed_experts, gen.sample_image_data(first))
        try:
            outs = await self.client.generate_group(g, first.rollout_id, list(first.tokens), params, n,
                                                    return_logprob=True, extra=extra)
            problems = []
            for sample, out in zip(g.samples, outs):
                try:
                    gen.append_output(sample, out)
                except Exception as e:
                    problems.append((sample, e))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            problems = [(sample, e) for sample in g.samples]
        for sample, e in problems:
            sample.status = SampleStatus.FAILED
            sample.metadata["generate_error"] = f"{type(e).__name__}: {e}"
            counts.generate_failures += 1
            counts.first_error = counts.first_error or f"generation: {type(e).__name__}: {e}"
        if problems:
            logger.error("generation failed for %d sample(s) of group %d (rollout %d): %s: %s", len(problems), g.index,
                         first.rollout_id, type(problems[0][1]).__name__, problems[0][1])

    async def _run_sample(self, g: _Group, slot: int, params: dict[str, Any], counts: _Counts, score: bool,
                          generated: bool = False) -> None:
        """Generate slot ``slot`` (``generated``: the group request already did, once), regenerating what the
        engine aborted, then reward it."""
        for attempt in range(self.engine_abort_retries + 1):
            if attempt:  # the engine aborted it (e.g. paused for a weight update): start the slot afresh (same key)
                key = g.samples[slot].routing_key
                g.samples[slot] = self._fresh_sample(g, g.samples[slot].rollout_id, slot, len(g.samples))
                g.samples[slot].routing_key = key
                g.more.pop(slot, None)
            if attempt == 0 and generated:
                sample = g.samples[slot]
            else:
                sample = await self._generate_slot(g, slot, params, counts)
            if sample.status is not SampleStatus.ABORTED or g.aborted or attempt == self.engine_abort_retries:
                break
            counts.engine_abort_retries += 1
            logger.info("sample %d (group %d) was aborted by the engine; generating it again (%d/%d)",
                        sample.index, g.index, attempt + 1, self.engine_abort_retries)
        for one in [sample, *g.more.get(slot, [])]:
            counts.response_tokens += one.response_length
            if score and not self.rewarder.group and one.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
                t0 = time.monotonic()
                ok = await self.rewarder.score_sample(one)
                counts.reward_time += time.monotonic() - t0
                if not ok:
                    counts.reward_failures += 1
                    counts.first_error = counts.first_error or f"reward: {one.metadata.get('reward_error')}"
        counts.finished += 1
        if counts.progress is not None:
            counts.progress(counts.finished, counts.launched)

    def _fit_context(self, params: dict[str, Any], prompt_len: int, stream: str) -> dict[str, Any]:
        """--rollout-max-context-len (--eval-max-context-len when evaluating): prompt + response tokens at most."""
        ev = self.eval_cfg.eval_max_context_len if self.eval_cfg is not None and stream.startswith("eval:") else None
        limit = ev if ev is not None else self.rollout.rollout_max_context_len
        if limit is None:
            return params
        room = max(0, limit - prompt_len)
        asked = params.get("max_new_tokens")
        return {**params, "max_new_tokens": room if asked is None else min(asked, room)}

    async def _run_group(self, g: _Group, stream: str, rollout_id: int, base: dict[str, Any], counts: _Counts) -> None:
        first = group_seed(self.rollout.rollout_seed, stream, rollout_id, g.index)
        base = self._fit_context(base, len(g.samples[0].tokens), stream)  # a group's samples share the prompt
        # one request for the group, unless its samples have routing keys (one request carries one key)
        together = (self.group_requests and len(g.samples) > 1 and g.generate_path is None
                    and not any(s.routing_key for s in g.samples))
        if together:
            await self._generate_group(g, {**base, "sampling_seed": first}, counts)
        await asyncio.gather(*(self._run_sample(g, i, {**base, "sampling_seed": first + i}, counts, True, together)
                               for i in range(len(g.samples))))
        if any(g.more.values()):   # each slot's further samples join the group after it
            g.samples = [one for i, s in enumerate(g.samples) for one in (s, *g.more.get(i, []))]
        g.more = {}
        if self.rewarder.group and not g.aborted:
            t0 = time.monotonic()
            failed = await self.rewarder.score_group(g.samples)
            counts.reward_time += time.monotonic() - t0
            counts.reward_failures += failed
            if failed:
                counts.first_error = counts.first_error or f"reward: {g.samples[0].metadata.get('reward_error')}"

    # ------------------------------------------------------------------ a training rollout
    async def generate_rollout(self, rollout_id: int) -> RolloutResult:
        if self.data_source is None:
            raise ValueError("RolloutManager.generate_rollout needs a data_source (built from --prompt-data)")
        t0 = time.monotonic()
        retries0 = self.client.retries
        n = self.data.n_samples_per_prompt
        base = gen.build_sampling_params(self.rollout)
        counts = _Counts(progress=self.progress)
        groups: list[_Group] = []
        by_task: dict[asyncio.Task, _Group] = {}
        drops = MetricGatherer()
        max_groups = self.batch + max(len(self.data_source.dataset), self.over)
        next_report = FILTER_REPORT_EVERY * self.batch

        def launch(k: int) -> None:
            for item in self.data_source.next_batch(k):
                g = self._new_group(len(groups), item, rollout_id, n)
                counts.launched += n
                g.task = asyncio.ensure_future(self._run_group(g, "train", rollout_id, base, counts))
                by_task[g.task] = g
                groups.append(g)

        selected: list[_Group] | None = None
        try:
            launch(self.over if self.filter is not None else self.batch)
            while (selected := self._select(groups)) is None:
                in_flight = sum(1 for g in groups if not g.done)
                passing = sum(1 for g in groups if g.done and g.kept)
                if passing + in_flight < self.batch:
                    if len(groups) >= max_groups:
                        raise RolloutError(
                            f"rollout {rollout_id}: the dynamic sampling filter {self.data.dynamic_sampling_filter_path} "
                            f"kept {passing} of {len(groups)} groups (drops: {dict(drops.counts)}) without reaching "
                            f"--rollout-batch-size {self.batch}. Rewards may be all equal (e.g. all 0): check the "
                            f"reward, or drop --dynamic-sampling-filter-path.")
                    if len(groups) >= next_report:   # a line each FILTER_REPORT_EVERY x --rollout-batch-size groups
                        next_report += FILTER_REPORT_EVERY * self.batch
                        logger.info("rollout %d: the dynamic sampling filter %s kept %d of %d finished groups so far "
                                    "(drops: %s; --rollout-batch-size %d); launching %d more (at most %d groups, "
                                    "one pass over the data)", rollout_id, self.data.dynamic_sampling_filter_path,
                                    passing, sum(1 for g in groups if g.done), dict(drops.counts), self.batch,
                                    self.over, max_groups)
                    launch(self.over)
                pending = [g.task for g in groups if not g.done]
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    g = by_task[task]
                    task.result()  # a bug (not a sample failure) propagates
                    g.done = True
                    verdict = call_filter(self.filter, self.args, g.samples)
                    g.kept = verdict.keep
                    if not verdict.keep:
                        drops.on_dynamic_filter_drop(verdict.reason)
        finally:
            surplus = groups[groups.index(selected[-1]) + 1:] if selected else [g for g in groups if not g.done]
            aborted = await self._abort(surplus)
        if self.filter is not None:
            self.data_source.give_back([g.item for g in surplus if not (g.done and not g.kept)])
        result = [g.samples for g in selected]
        post = await self.post_process.apply(result) if self.post_process is not None else {}
        metrics = self._metrics(result, counts, t0)
        if self.reward.log_passrate:     # --log-passrate: pass@k over the rollout's complete groups
            metrics.update({f"passrate/{k}": v for k, v in pass_at_k(
                [[reward_value(s, self.args) for s in g] for g in result], n).items()})
        metrics.update(post)
        metrics.update({
            "rollout/retries": self.client.retries - retries0,
            "rollout/groups_launched": len(groups),
            "rollout/groups_dropped": drops.total,
            "rollout/surplus_aborted_requests": aborted,
            "rollout/epoch": self.data_source.epoch,
        })
        metrics.update(drops.collect())
        if self.filter is not None:
            scored = [s.reward for g in groups if g.done for s in g.samples if isinstance(s.reward, int | float)]
            if scored:
                metrics["rollout/raw_reward_unfiltered"] = sum(scored) / len(scored)
        flat = [s for grp in result for s in grp]
        if flat and all(s.status is SampleStatus.FAILED for s in flat):
            raise RolloutError(f"rollout {rollout_id}: every one of {len(flat)} samples failed; first error: "
                               f"{counts.first_error}")
        return RolloutResult(samples=result, metrics=metrics)

    def _select(self, groups: list[_Group]) -> list[_Group] | None:
        """The first ``batch`` kept groups in launch order, once every group before them is done."""
        chosen: list[_Group] = []
        for g in groups:
            if not g.done:
                return None
            if g.kept:
                chosen.append(g)
                if len(chosen) == self.batch:
                    return chosen
        return None

    async def _abort(self, surplus: list[_Group]) -> int:
        """Abort the surplus groups' requests by rid; wait ``abort_grace`` s, then cancel what remains."""
        from miles.fleet.client import EngineError

        for g in surplus:
            g.aborted = True
        rids = [rid for g in surplus for rid in g.rids]

        async def _one(rid: str) -> None:
            try:
                await self.client.abort(rid)
            except EngineError as e:
                logger.debug("abort %s: %s", rid, e)

        if rids:
            await asyncio.gather(*(_one(r) for r in rids))
        tasks = [g.task for g in surplus if g.task is not None and not g.task.done()]
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=self.abort_grace)
            for t in still:
                t.cancel()
            if still:
                logger.warning("%d surplus groups did not stop within %.0fs of their abort; cancelled", len(still), self.abort_grace)
            await asyncio.gather(*tasks, return_exceptions=True)
        return len(rids)

    def _metrics(self, groups: list[list[Sample]], counts: _Counts, t0: float) -> dict[str, float]:
        flat = [s for g in groups for s in g]
        rewards = [s.reward for s in flat if isinstance(s.reward, int | float) and s.status is not SampleStatus.FAILED]
        lengths = [s.response_length for s in flat]
        elapsed = time.monotonic() - t0
        return {
            "rollout/raw_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
            "rollout/response_len": sum(lengths) / len(lengths) if lengths else 0.0,
            "rollout/response_len_max": max(lengths, default=0),
            "rollout/truncated_ratio": sum(s.status is SampleStatus.TRUNCATED for s in flat) / max(1, len(flat)),
            "rollout/aborted_ratio": sum(s.status is SampleStatus.ABORTED for s in flat) / max(1, len(flat)),
            "rollout/reward_failures": counts.reward_failures,
            "rollout/generate_failures": counts.generate_failures,
            "rollout/engine_abort_retries": counts.engine_abort_retries,
            "rollout/num_samples": len(flat),
            "perf/rollout_time": elapsed,
            "perf/rollout/reward_time": counts.reward_time,
            "perf/rollout_tokens_per_s": counts.response_tokens / elapsed if elapsed > 0 else 0.0,
            **reward_category_metrics(flat, self.reward.log_reward_category),
        }

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, eval_datasets: dict[str, EvalDataset | PromptDataset],
                       rollout_id: int = 0) -> dict[str, float]:
        """Every prompt of each dataset, its spec's ``n_samples_per_eval_prompt`` times with its sampling params,
        rm_type, metadata overrides and generate function (``EvalDataset``; a bare ``PromptDataset`` takes the
        ``--eval-*`` flags); metrics ``eval/<name>`` (Miles's mean reward, a failed sample counted 0),
        ``eval/<name>-{none_reward,truncated}_ratio`` and ``eval/<name>/...``."""
        return (await self.evaluate_data(eval_datasets, rollout_id))[1]

    async def evaluate_data(self, eval_datasets: dict[str, EvalDataset | PromptDataset],
                            rollout_id: int = 0) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
        """(Miles's eval data: name -> {"rewards", "truncated", "samples"}, the metrics :meth:`evaluate` logs)."""
        data: dict[str, dict[str, Any]] = {}
        metrics: dict[str, float] = {}
        for name, dataset in eval_datasets.items():
            samples, m = await self._evaluate_one(name, dataset, rollout_id)
            rewards = [reward_value(s, self.args) if s.status is not SampleStatus.FAILED else None for s in samples]
            rewards = [r if isinstance(r, int | float) and not isinstance(r, bool) else None for r in rewards]
            truncated = [s.status is SampleStatus.TRUNCATED for s in samples]
            data[name] = {"rewards": rewards, "truncated": truncated, "samples": samples}
            metrics.update(m)
            # and Miles's log_eval_rollout_data over the same data: eval/<name> counts a failed sample's reward
            # (None) as 0, eval/<name>-none_reward_ratio counts them, eval/<name>-truncated_ratio, response_len/...
            n = (dataset.spec if isinstance(dataset, EvalDataset) else self._flag_spec(name, dataset.path)
                 ).n_samples_per_eval_prompt
            metrics.update(miles_eval_metrics({name: data[name]}, passrate_group_size=n if self.reward.log_passrate
                                              else None))
        return data, metrics

    async def _evaluate_one(self, name: str, dataset: EvalDataset | PromptDataset,
                            rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        spec = dataset.spec if isinstance(dataset, EvalDataset) else self._flag_spec(name, dataset.path)
        n = spec.n_samples_per_eval_prompt
        base = spec.sampling_params(self.rollout.rollout_skip_special_tokens)
        path = spec.custom_generate_function_path
        if path and path != self.data.custom_generate_function_path:
            self._generate_fn(path, f"--eval-config dataset {name!r}: custom_generate_function_path")
        else:
            path = None
        t0 = time.monotonic()
        counts = _Counts()
        groups = [self._new_group(i, item, rollout_id, n) for i, item in enumerate(dataset.items)]
        for g in groups:
            g.generate_path = path
        counts.launched = len(groups) * n
        try:
            await asyncio.gather(*(self._run_group(g, f"eval:{name}", rollout_id, base, counts) for g in groups))
        finally:
            for g in groups:
                g.aborted = True
        m = self._metrics([g.samples for g in groups], counts, t0)
        metrics = {f"eval/{name}/{k.split('/', 1)[1]}": v for k, v in m.items() if k.startswith("rollout/")}
        metrics[f"eval/{name}"] = m["rollout/raw_reward"]  # Miles's key for the mean reward
        metrics[f"eval/{name}/time"] = m["perf/rollout_time"]
        return [s for g in groups for s in g.samples], metrics

    def _flag_spec(self, name: str, path: str) -> EvalDatasetSpec:
        """The spec of a dataset given without one: the ``--eval-*`` flags (the rollout's without an EvalConfig)."""
        r = self.rollout
        if self.eval_cfg is None:
            return EvalDatasetSpec(name=name, path=path, temperature=r.rollout_temperature, top_p=r.rollout_top_p,
                                   top_k=r.rollout_top_k, max_response_len=r.rollout_max_response_len,
                                   stop=r.rollout_stop, stop_token_ids=r.rollout_stop_token_ids,
                                   custom_generate_function_path=self.data.custom_generate_function_path)
        ev = dataclasses.replace(self.eval_cfg, eval_config=None, eval_prompt_data=[name, path])
        return resolve_eval_datasets(ev, self.data, r)[0]

    async def aclose(self) -> None:
        await self.rewarder.aclose()
        await close_http_client()   # the session plugins' miles.utils.http_utils.post opened on this loop
