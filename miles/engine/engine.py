"""The engine facade the HTTP routes call: generation, health, control and weight updates.

Owns the ``ModelRunner`` (model + KV cache), the ``Scheduler`` thread and the weight-update groups, and
turns finished/streamed requests into SGLang-shaped response dicts.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from miles.engine import protocol as P
from miles.engine.model_runner import ModelRunner, RunnerOptions
from miles.engine.routed_experts import encode as encode_routed_experts
from miles.engine.scheduler import Req, Scheduler, gc_paused
from miles.engine.weights import (
    WeightGroups,
    WeightUpdateError,
    deserialize_named_tensors,
    load_from_disk,
    release_handles,
)
from miles.utils.logging import get_logger

logger = get_logger("miles.engine")

HEALTH_CHECK_TIMEOUT = 20.0
FLUSH_POLL_S = 0.02
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass
class EngineArgs:
    hf_checkpoint: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    max_running_requests: int = 64
    max_context_len: int | None = None
    max_prefill_tokens: int = 16384
    weight_version: str = "default"
    random_seed: int | None = None
    cuda_graph: bool = True
    native: bool = True
    weight_update_timeout: float = 600.0
    max_samples_per_request: int | None = 4096
    max_queued_requests: int | None = 65536
    max_total_tokens: int | None = None        # KV tokens in all: caps max_running_requests (as sglang)
    cuda_graph_bs: list[int] | None = None     # decode batch sizes captured as CUDA graphs (as sglang)
    cuda_graph_max_bs: int | None = None
    kv_cache: str = "auto"                     # paged | slots | auto (paged on GPU, slots on CPU)
    page_size: int = 16                        # tokens per KV page (paged cache)
    overlap_schedule: bool | None = None       # the overlap scheduler; None: on CUDA (sglang --disable-overlap-schedule)
    deterministic: bool = False                # batch-invariant outputs (sglang --enable-deterministic-inference)
    clamp_shared_expert: bool = True           # off: --no-activation-func-clamp-shared-expert (the trainer's flag)
    mix_step_tokens: int | None = None         # riders' prompt tokens a decode step carries on CUDA (None: 1,024)
    pick_cpu_threads: bool = False             # CPU: the faster of OMP_NUM_THREADS and one thread (--pick-cpu-threads)
    enable_lora: bool = False                  # serve LoRA adapters (sglang --enable-lora; miles.engine.lora)
    max_lora_rank: int | None = None           # sglang --max-lora-rank
    max_loaded_loras: int | None = None        # sglang --max-loaded-loras
    lora_target_modules: list[str] | None = None   # sglang --lora-target-modules
    lora_paths: list[str] | None = None        # sglang --lora-paths: NAME=PATH (or PATH, named by itself) at the start
    experts_shared_outer_loras: bool = False   # sglang --experts-shared-outer-loras (miles.engine.lora_experts)


class Engine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.runner = ModelRunner(args.hf_checkpoint, RunnerOptions(
            device=args.device, dtype=args.dtype, max_running_requests=args.max_running_requests,
            max_context_len=args.max_context_len, cuda_graph=args.cuda_graph, native=args.native,
            max_total_tokens=args.max_total_tokens, cuda_graph_bs=args.cuda_graph_bs, cuda_graph_max_bs=args.cuda_graph_max_bs,
            kv_cache=args.kv_cache, page_size=args.page_size, deterministic=args.deterministic,
            clamp_shared_expert=args.clamp_shared_expert, mix_step_tokens=args.mix_step_tokens,
            enable_lora=args.enable_lora or bool(args.lora_paths), max_lora_rank=args.max_lora_rank,
            max_loaded_loras=args.max_loaded_loras, lora_target_modules=args.lora_target_modules,
            experts_shared_outer_loras=args.experts_shared_outer_loras))
        for entry in args.lora_paths or ():     # sglang --lora-paths: adapters loaded before the first request
            from miles.engine.lora import lora_path_entry, read_adapter_dir

            name, path, pinned = lora_path_entry(entry)
            config, tensors = read_adapter_dir(path)
            self.runner.lora.load(name, config, tensors, path=path, pinned=pinned)
        self.tokenizer = self._load_tokenizer(args.hf_checkpoint)
        self.vision = None   # a VLM's image side (image_data on /generate); None: the model takes no images
        if self.runner.is_vlm:
            from miles.engine.vlm import VisionInputs

            self.vision = VisionInputs(args.hf_checkpoint, self.runner.config)
        self.scheduler = Scheduler(self.runner, self.tokenizer, max_prefill_tokens=args.max_prefill_tokens,
                                   weight_version=args.weight_version, random_seed=args.random_seed,
                                   max_queued_requests=args.max_queued_requests, overlap=args.overlap_schedule,
                                   pick_cpu_threads=args.pick_cpu_threads and not args.deterministic)
        self.groups = WeightGroups(self.runner.device)
        self.model_path = args.hf_checkpoint
        self.weight_update_session: str | None = None
        self.started = False
        self.memory_released: set[str] = set()
        self._update_lock = asyncio.Lock()
        self._bucket_turn: dict[str, tuple[str, int]] = {}  # group -> (sync id, index of the bucket it takes next)
        self._turn_changed = asyncio.Condition()

    @staticmethod
    def _load_tokenizer(path: str):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - a model dir without a tokenizer serves token ids only
            logger.warning("no tokenizer in %s (%s): 'text' prompts and stop strings are unavailable", path, e)
            return None

    def start(self) -> None:
        self.scheduler.start()
        self.started = True

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ------------------------------------------------------------------ generation
    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise P.BadRequest("'text' needs a tokenizer, and this model directory has none; send input_ids")
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def prepare(self, body: P.GenerateReqInput) -> tuple[list[P.GenSpec], bool]:
        with gc_paused():  # n=100000 builds 100000 specs on the event loop
            image_error = None if self.vision is not None else (
                f"this {self.runner.config.model_type!r} model takes no images (not a vision-language model); drop "
                f"image_data or serve a vision-language model such as Qwen3-VL")
            specs, is_batch = P.normalize_generate(body, self._tokenize, self.runner.vocab_size,
                                                   lambda: os.urandom(16).hex(),
                                                   max_samples=self.args.max_samples_per_request, image_error=image_error)
        if body.lora_path is not None:
            lora = self.runner.lora
            if lora is None:
                raise P.BadRequest("GenerateReqInput.lora_path: this engine serves no LoRA adapters; start it with "
                                   "--enable-lora (--sglang-enable-lora)")
            from miles.engine.lora import LoraLoadError

            try:
                for sp in specs:
                    sp.lora_index = lora.index(sp.lora_path)
            except LoraLoadError as e:
                raise P.BadRequest(f"GenerateReqInput.{e}") from None
        return specs, is_batch

    # ------------------------------------------------------------------ LoRA adapters (miles.engine.lora)
    def _lora(self, what: str):
        if self.runner.lora is None:
            raise P.BadRequest(f"{what}: this engine serves no LoRA adapters; start it with --enable-lora "
                               "(--sglang-enable-lora)")
        return self.runner.lora

    async def _lora_call(self, fn) -> dict[str, Any]:
        """Run ``fn`` on the scheduler thread (between forwards); SGLang's LoRAUpdateOutput as a dict."""
        from miles.engine.lora import LoraLoadError

        lora = self.runner.lora

        def go():
            fn()
            self.runner.weights_epoch += 1     # cached prompt logits of an adapter are stale now
        try:
            async with self._update_lock:
                await self.scheduler.acall(go)
        except (LoraLoadError, WeightUpdateError) as e:
            return {"success": False, "error_message": str(e), "loaded_adapters": lora.loaded()}
        return {"success": True, "error_message": None, "loaded_adapters": lora.loaded()}

    async def load_lora_adapter(self, b: P.LoadLoRAAdapterReqInput) -> dict[str, Any]:
        from miles.engine.lora import LoraLoadError, read_adapter_dir

        lora = self._lora("load_lora_adapter")
        try:
            config, tensors = await asyncio.to_thread(read_adapter_dir, b.lora_path)
        except LoraLoadError as e:
            return {"success": False, "error_message": str(e), "loaded_adapters": lora.loaded()}
        return await self._lora_call(lambda: lora.load(b.lora_name, config, tensors, path=b.lora_path,
                                                       pinned=b.pinned))

    async def load_lora_adapter_from_tensors(self, b: P.LoadLoRAAdapterFromTensorsReqInput) -> dict[str, Any]:
        lora = self._lora("load_lora_adapter_from_tensors")
        if (b.serialized_tensors is None) == (b.serialized_named_tensors is None):
            raise P.BadRequest("LoadLoRAAdapterFromTensorsReqInput: give exactly one of 'serialized_tensors' or "
                               "'serialized_named_tensors'")
        if b.added_tokens_config is not None:
            raise P.BadRequest("LoadLoRAAdapterFromTensorsReqInput.added_tokens_config is not supported by the "
                               "embedded engine; leave it unset")
        entries = [b.serialized_tensors] if b.serialized_tensors is not None else list(b.serialized_named_tensors)
        if not entries:
            raise P.BadRequest("LoadLoRAAdapterFromTensorsReqInput.serialized_named_tensors is empty")
        try:
            named = await asyncio.to_thread(deserialize_named_tensors, entries[0], b.load_format)
        except WeightUpdateError as e:
            return {"success": False, "error_message": str(e), "loaded_adapters": lora.loaded()}
        finally:   # one process serves every TP rank (see update_from_tensor)
            await asyncio.to_thread(release_handles, entries[1:], b.load_format)
        tensors = {n: t.detach().clone() for n, t in named}
        del named
        if b.expected_checksums is not None:
            bad = _checksum_mismatches(tensors, b.expected_checksums)
            if bad:
                return {"success": False, "error_message": f"expected_checksums: {len(bad)} tensors differ, e.g. "
                        f"{bad[0]!r}", "loaded_adapters": lora.loaded()}
        return await self._lora_call(lambda: lora.load(b.lora_name, b.config_dict, tensors, path="__tensor__",
                                                       pinned=b.pinned, upsert=b.upsert))

    async def load_lora_adapter_from_distributed(self, b: P.LoadLoRAAdapterFromDistributedReqInput) -> dict[str, Any]:
        lora = self._lora("load_lora_adapter_from_distributed")
        if b.added_tokens_config is not None:
            raise P.BadRequest("LoadLoRAAdapterFromDistributedReqInput.added_tokens_config is not supported by the "
                               "embedded engine; leave it unset")
        if not (len(b.names) == len(b.dtypes) == len(b.shapes)) or not b.names:
            raise P.BadRequest(f"LoadLoRAAdapterFromDistributedReqInput: names, dtypes and shapes must be non-empty "
                               f"and of one length, got {len(b.names)}, {len(b.dtypes)}, {len(b.shapes)}")
        try:
            async with self._update_lock:     # the broadcast, in names order, as update_weights_from_distributed's
                named = await asyncio.to_thread(self.groups.receive, b.group_name, b.names, b.dtypes, b.shapes,
                                                None, None)
        except WeightUpdateError as e:
            return {"success": False, "error_message": str(e), "loaded_adapters": lora.loaded()}
        tensors = dict(named)
        return await self._lora_call(lambda: lora.load(b.lora_name, b.config_dict, tensors, path="__distributed__",
                                                       pinned=b.pinned, upsert=b.upsert))

    async def unload_lora_adapter(self, b: P.UnloadLoRAAdapterReqInput) -> dict[str, Any]:
        lora = self._lora("unload_lora_adapter")
        return await self._lora_call(lambda: lora.unload(b.lora_name))

    async def attach_images(self, specs: list[P.GenSpec], is_batch: bool) -> None:
        """A VLM: decode and process each prompt's ``image_data`` (in a worker thread, off the event loop) into
        ``spec.mm``, checking the image tokens against the images; the n samples of a prompt share one result."""
        if self.vision is None:
            return
        vision = self.vision
        done: dict[int, object] = {}
        for s in specs:
            key = id(s.input_ids)   # the n samples of a prompt share its token list (and image list)
            if key in done:
                s.mm = done[key]
                continue
            where = f"GenerateReqInput.image_data (prompt of rid {s.rid})" if is_batch else "GenerateReqInput.image_data"
            if s.image_data is None:
                vision.check_text_only(s.input_ids, where.replace("image_data", "input_ids"))
                done[key] = None
            else:
                done[key] = s.mm = await asyncio.to_thread(vision.prepare, s.image_data, s.input_ids, where)

    def submit(self, specs: list[P.GenSpec], stream: bool, health: bool = False) -> list[Req]:
        """Queue the requests; raises ``P.BadRequest`` or ``QueueFull`` (the engine is at --max-queued-requests)."""
        return self.scheduler.submit(specs, asyncio.get_running_loop(), stream, health=health)

    def abort_reqs(self, reqs: list[Req], message: str = "client disconnected") -> None:
        """Abort these requests (a no-op for finished ones); O(len(reqs)) on the scheduler thread."""
        live = [r for r in reqs if r.finish is None]
        if live:
            self.scheduler.call(lambda: self.scheduler.abort_reqs(live, message))

    async def wait_final(self, reqs: list[Req]) -> list[dict[str, Any]]:
        out = []
        for r in reqs:
            while True:
                n, final = await r.events.get()
                if final:
                    out.append(self.response(r, n))
                    break
        return out

    async def stream(self, reqs: list[Req], is_batch: bool) -> AsyncIterator[dict[str, Any]]:
        pending: dict[asyncio.Task, Req] = {asyncio.ensure_future(r.events.get()): r for r in reqs}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    r = pending.pop(task)
                    n, final = task.result()
                    d = self.response(r, n, final=final)
                    if is_batch:
                        d["index"] = r.spec.index
                    yield d
                    if not final:
                        pending[asyncio.ensure_future(r.events.get())] = r
        finally:
            for task in pending:
                task.cancel()

    def _token_text(self, tid: int) -> str | None:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else None

    def response(self, r: Req, n: int, final: bool = True) -> dict[str, Any]:
        s = r.spec
        ids = r.output_ids[:n]
        text = ""
        if self.tokenizer is not None:
            text_ids = ids
            if final and r.finish and r.finish.get("type") == "stop" and isinstance(r.finish.get("matched"), int) \
                    and not s.no_stop_trim and ids:
                text_ids = ids[:-1]
            text = self.tokenizer.decode(text_ids, skip_special_tokens=s.skip_special_tokens,
                                         spaces_between_special_tokens=s.spaces_between_special_tokens)
            if final and r.stop_trim and not s.no_stop_trim:
                stop = r.finish["matched"]
                cut = text.rfind(stop)
                if cut >= 0:
                    text = text[:cut]
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish if final else None,
            "prompt_tokens": len(s.input_ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": r.weight_version if final and r.finish else self.weight_version,
            "e2e_latency": time.time() - r.created,
        }
        if s.return_logprob:
            tt = s.return_text_in_logprobs
            meta["output_token_logprobs"] = [[lp, t, self._token_text(t) if tt else None]
                                             for lp, t in zip(r.output_logprobs[:n], ids)]
            inp = r.input_logprobs or []
            in_ids = s.input_ids[s.logprob_start_len:] if s.logprob_start_len >= 0 else []
            meta["input_token_logprobs"] = [[lp, t, self._token_text(t) if tt else None] for lp, t in zip(inp, in_ids)]
            if s.top_logprobs_num:
                meta["output_top_logprobs"] = [[[v, i, self._token_text(i) if tt else None] for v, i in row]
                                               for row in r.output_top[:n]]
                meta["input_top_logprobs"] = [[[v, i, None] for v, i in row] for row in (r.input_top or [])]
            if s.token_ids_logprob:
                meta["output_token_ids_logprobs"] = [[[v, i, None] for v, i in zip(row, s.token_ids_logprob)]
                                                     for row in r.output_token_ids_lp[:n]]
                meta["input_token_ids_logprobs"] = [[[v, i, None] for v, i in zip(row, s.token_ids_logprob)]
                                                    for row in (r.input_token_ids_lp or [])]
        if s.return_routed_experts and final and r.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(
                r.routed_experts[s.routed_experts_start_len: len(s.input_ids) + n - 1])
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    # ------------------------------------------------------------------ health and info
    def ready_to_generate(self) -> bool:
        return self.started and not self.scheduler.paused and self.runner.ready

    async def health_generate(self) -> bool:
        sch = self.scheduler
        if sch.running and time.time() - sch.last_step_time < HEALTH_CHECK_TIMEOUT:
            return True
        spec = P.GenSpec(rid=f"HEALTH_CHECK_{time.time()}", input_ids=[0], max_new_tokens=1, min_new_tokens=0,
                         temperature=1.0, top_p=1.0, top_k=1, min_p=0.0, stop_token_ids=[], stop_strs=[], ignore_eos=True,
                         skip_special_tokens=True, spaces_between_special_tokens=True, no_stop_trim=False, stream_interval=1,
                         logit_bias=None, sampling_seed=0, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
                         token_ids_logprob=None, return_text_in_logprobs=False, index=0)
        reqs = self.submit([spec], stream=False, health=True)
        try:
            res = await asyncio.wait_for(self.wait_final(reqs), HEALTH_CHECK_TIMEOUT)
            return res[0]["meta_info"]["finish_reason"]["type"] != "abort"
        except TimeoutError:
            self.abort_reqs(reqs)
            logger.error("health check: no token within %.0fs", HEALTH_CHECK_TIMEOUT)
            return False

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": self.vision is not None, "has_audio_understanding": False, "model_type": self.runner.config.model_type,
                "architectures": getattr(self.runner.config, "architectures", None)}

    def server_info(self) -> dict[str, Any]:
        a = self.args
        load = self.scheduler.load()
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path, "served_model_name": self.model_path,
            "host": a.host, "port": a.port, "dtype": str(self.runner.dtype).removeprefix("torch."), "device": str(self.runner.device),
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0,
            "max_running_requests": self.runner.max_slots, "context_length": self.runner.max_ctx,
            "max_total_num_tokens": self.runner.kv_tokens(), "max_req_input_len": self.runner.max_ctx - 1,
            "max_prefill_tokens": a.max_prefill_tokens, "random_seed": a.random_seed, "weight_version": self.weight_version,
            "disaggregation_mode": "null", "api_key_set": a.api_key is not None, "skip_tokenizer_init": self.tokenizer is None,
            "native_forward": self.runner.native, "cuda_graph": bool(getattr(self.runner.impl, "use_graphs", False)),
            "cuda_graph_bs": self.runner.graph_batch_sizes, "cuda_graph_max_bs": max(self.runner.graph_batch_sizes, default=0),
            "max_queued_requests": a.max_queued_requests, "disable_overlap_schedule": not self.scheduler.overlap,
            "enable_deterministic_inference": self.runner.deterministic,
            "memory_released": sorted(self.memory_released), "internal_states": [load], "version": "miles-embedded-engine",
            "engine": "miles-embedded",
        }

    # ------------------------------------------------------------------ control
    async def flush_cache(self, timeout_s: float | None = None) -> bool:
        """Zero the KV cache once no request holds it; with ``timeout_s`` wait that long for that (SGLang's
        ``FlushCacheReqInput.timeout_s``). False when requests still hold the cache."""
        deadline = time.monotonic() + max(0.0, timeout_s or 0.0)
        while True:
            if await self.scheduler.acall(self.scheduler.flush_cache):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(FLUSH_POLL_S)

    async def abort(self, rid: str | None, abort_all: bool) -> int:
        return await self.scheduler.acall(lambda: self.scheduler.abort(rid, abort_all))

    async def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise P.BadRequest(f"PauseGenerationReqInput.mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        await self.scheduler.acall(lambda: self.scheduler.pause(mode))

    async def continue_generation(self, torch_empty_cache: bool = True) -> None:
        def go():
            if torch_empty_cache and self.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            self.scheduler.resume()
        await self.scheduler.acall(go)

    def _tags(self, tags: list[str] | None) -> set[str]:
        tags = list(MEMORY_TAGS) if tags is None else tags
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise P.BadRequest(f"tags {bad} are unknown; use any of {list(MEMORY_TAGS)} (or null for all)")
        return set(tags)

    async def release_memory(self, tags: list[str] | None) -> None:
        t = self._tags(tags)
        await self.scheduler.acall(lambda: self.scheduler.release_memory(t))
        self.memory_released |= t

    async def resume_memory(self, tags: list[str] | None) -> None:
        t = self._tags(tags)
        await self.scheduler.acall(lambda: self.runner.resume(t))
        self.memory_released -= t

    async def update_weight_version(self, v: str, abort_all: bool) -> None:
        def go():
            if abort_all:
                self.scheduler.abort(None, True, "Aborted by /update_weight_version")
            self.scheduler.weight_version = v
        await self.scheduler.acall(go)

    # ------------------------------------------------------------------ weights
    async def init_group(self, b: P.InitWeightsUpdateGroupReqInput) -> None:
        await asyncio.to_thread(self.groups.init_group, b.master_address, b.master_port, b.rank_offset, b.world_size,
                                b.group_name, b.backend, self.args.weight_update_timeout)

    async def destroy_group(self, name: str) -> None:
        await asyncio.to_thread(self.groups.destroy_group, name)

    async def begin_update(self, selector: Any) -> None:
        self.weight_update_session = str(selector)

    async def end_update(self) -> None:
        if self.weight_update_session is None:
            raise WeightUpdateError("/end_weight_update without /begin_weight_update")
        self.weight_update_session = None

    async def _apply(self, named: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], *, flush: bool, abort_all: bool,
                     version: str | None, rollback: bool = False) -> int:
        tensors = dict(named)

        def go():
            if abort_all:
                self.scheduler.abort(None, True, "Aborted for a weight update")
            backup = self.runner.snapshot(tensors) if rollback else None
            try:
                n = self.runner.load_tensors(tensors)
            except Exception:
                if backup:
                    self.runner.load_tensors(backup)
                raise
            if flush and not self.scheduler.cache_in_use():
                self.runner.clear_cache()
            if version is not None:
                self.scheduler.weight_version = version
            return n
        return await self.scheduler.acall(go)

    async def update_from_distributed(self, b: P.UpdateWeightsFromDistributedReqInput,
                                      order: tuple[str, int] | None = None) -> int:
        """Receive one bucket and load it. ``order`` (sync id, bucket index): buckets of one sync are taken in
        index order, whatever order their requests arrived in (the trainer sends them in that order)."""
        dtypes = b.dtypes if b.dtypes is not None else b.dtype_names
        if dtypes is None:
            raise P.BadRequest("UpdateWeightsFromDistributedReqInput needs 'dtypes' (or 'dtype_names')")
        if order is not None:
            await self._wait_turn(b.group_name, order)
        try:
            async with self._update_lock:
                named = await asyncio.to_thread(self.groups.receive, b.group_name, b.names, dtypes, b.shapes,
                                                b.load_format, b.p2p_ranges)
                return await self._apply(named, flush=b.flush_cache, abort_all=b.abort_all_requests,
                                         version=b.weight_version)
        finally:
            if order is not None:
                async with self._turn_changed:
                    self._bucket_turn[b.group_name] = (order[0], order[1] + 1)
                    self._turn_changed.notify_all()

    async def _wait_turn(self, group: str, order: tuple[str, int]) -> None:
        """Bucket 0 starts its sync; bucket i > 0 waits until bucket i - 1 of the same sync is done (bounded by
        --weight-update-timeout: a bucket whose predecessor never comes fails, naming it)."""
        sync_id, index = order
        async with self._turn_changed:
            if index == 0:
                self._bucket_turn[group] = (sync_id, 0)
                return
            try:
                await asyncio.wait_for(self._turn_changed.wait_for(lambda: self._bucket_turn.get(group) == order),
                                       self.args.weight_update_timeout)
            except TimeoutError:
                raise WeightUpdateError(f"bucket {index} of weight sync {sync_id!r} arrived, but bucket {index - 1} was "
                                        f"not done within --weight-update-timeout={self.args.weight_update_timeout:g}s"
                                        ) from None

    async def update_from_tensor(self, b: P.UpdateWeightsFromTensorReqInput) -> int:
        if not b.serialized_named_tensors:
            raise P.BadRequest("serialized_named_tensors is empty; send one entry per TP rank (one for this engine)")
        async with self._update_lock:
            try:
                named = await asyncio.to_thread(deserialize_named_tensors, b.serialized_named_tensors[0], b.load_format)
                n = await self._apply(named, flush=b.flush_cache, abort_all=b.abort_all_requests, version=b.weight_version)
                del named
                return n
            finally:
                # one process serves every TP rank: entry 0 is loaded; the others are opened and dropped, since each
                # pickled handle holds one reference that the sender counted for its one receiver
                await asyncio.to_thread(release_handles, b.serialized_named_tensors[1:], b.load_format)

    async def update_from_disk(self, b: P.UpdateWeightFromDiskReqInput) -> int:
        async with self._update_lock:
            live = self.runner.named_tensors()
            state = await asyncio.to_thread(load_from_disk, b.model_path, live, self.runner.is_mtp_name)
            n = await self._apply(state, flush=b.flush_cache, abort_all=b.abort_all_requests, version=b.weight_version,
                                  rollback=True)
            self.model_path = b.model_path
            return n

    async def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        t = self.runner.named_tensors().get(name)
        if t is None:
            raise P.BadRequest(f"no parameter named {name!r}; names are HF parameter names such as "
                               f"{next(iter(self.runner.named_tensors()))!r}")

        def go():
            return t.detach()[:truncate_size].float().cpu().tolist()
        return await self.scheduler.acall(go)


def _checksum_mismatches(tensors: dict[str, torch.Tensor], expected: dict[str, str]) -> list[str]:
    """The names whose sha256 of their bytes (as Miles's client computes it) is not ``expected``'s (or missing)."""
    import hashlib

    bad = []
    for name, want in expected.items():
        t = tensors.get(name)
        got = None if t is None else hashlib.sha256(
            t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
        if got != want:
            bad.append(name)
    return bad
