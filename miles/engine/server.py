"""HTTP routes of the embedded engine (aiohttp), SGLang's native API.

Bodies are parsed by ``miles.engine.protocol`` (unknown fields -> 400 naming the field). With
``--api-key`` every route except ``/health*`` and ``/metrics`` (as SGLang exempts them) needs
``Authorization: Bearer <key>``; a wrong or missing key is a 401. ``/update_weights_from_tensor``
unpickles torch tensor handles, so without an API key it is only served to loopback clients.
``/update_weights_from_{distributed,tensor}?miles_whole_sync=<pause mode>`` is a whole weight sync in one
request (pause, load, flush, continue; ``_whole_sync``); SGLang has no such query parameter.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from miles.engine import protocol as P
from miles.engine.engine import Engine
from miles.engine.scheduler import QueueFull
from miles.engine.weights import WeightUpdateError
from miles.utils.logging import get_logger

logger = get_logger("miles.engine.server")

_LOOPBACK = ("127.", "::1", "::ffff:127.")
WHOLE_SYNC_PARAM = "miles_whole_sync"  # the same name as miles.fleet.control.WHOLE_SYNC_PARAM
SYNC_ID_PARAM, BUCKET_PARAM = "miles_sync", "miles_bucket"  # as miles.fleet.control.bucket_order_params
SHUTDOWN_GRACE_S = 1.0  # in-flight handlers get this long on shutdown; the process exits soon after regardless
_ENGINE = web.AppKey("engine", Engine)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    phrase = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 503: "Service Unavailable"}
    return _json({"object": "error", "message": message, "type": phrase.get(status, "Error"), "param": None, "code": status},
                 status)


def _result(ok: bool, message: str, **extra: Any) -> web.Response:
    return _json({"success": ok, "message": message, **extra}, 200 if ok else 400)


def _make_auth(api_key: str | None):
    @web.middleware
    async def auth(request: web.Request, handler):
        if api_key is None or request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics")):
            return await handler(request)
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            return _json({"error": "Unauthorized"}, 401)
        return await handler(request)
    return auth


@web.middleware
async def _errors(request: web.Request, handler):
    logger.debug("%s %s from %s", request.method, request.path, request.remote)
    try:
        return await handler(request)
    except P.BadRequest as e:
        logger.warning("400 %s: %s", request.path, e)
        return _error(str(e), 400)
    except QueueFull as e:
        logger.warning("503 %s: %s", request.path, e)
        return _error(str(e), 503)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the server keeps serving
        logger.exception("%s failed", request.path)
        return _error(f"{type(e).__name__}: {e}", 500)


async def _body(request: web.Request, cls, empty_ok: bool = False):
    return P.decode(await request.read(), cls, empty_ok=empty_ok)


def _engine(request: web.Request) -> Engine:
    return request.app[_ENGINE]


# ----------------------------------------------------------------------------- generation
async def generate(request: web.Request) -> web.StreamResponse:
    eng = _engine(request)
    raw = await request.read()
    logger.debug("generate body: %s", raw[:300])
    body = P.decode(raw, P.GenerateReqInput)
    specs, is_batch = eng.prepare(body)
    await eng.attach_images(specs, is_batch)
    reqs = eng.submit(specs, stream=body.stream)
    try:
        if not body.stream:
            out = await eng.wait_final(reqs)
            return _json(out if is_batch else out[0])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        async for chunk in eng.stream(reqs, is_batch):
            await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    finally:
        eng.abort_reqs(reqs)  # no-op for finished requests; frees slots when the client went away


# ----------------------------------------------------------------------------- health and info
async def health(request: web.Request) -> web.Response:
    eng = _engine(request)
    if not eng.started:
        return web.Response(status=503, text="starting")
    if not eng.ready_to_generate():
        if request.path == "/health_generate":
            return web.Response(status=503, text="generation is paused or memory is released")
        return web.Response(status=200, text="ok (paused or memory released)")
    if await eng.health_generate():
        return web.Response(status=200)
    if not eng.ready_to_generate() and request.path == "/health":  # paused while the probe waited
        return web.Response(status=200, text="ok (paused or memory released)")
    return web.Response(status=503)


async def model_info(request: web.Request) -> web.Response:
    return _json(_engine(request).model_info())


async def server_info(request: web.Request) -> web.Response:
    return _json(_engine(request).server_info())


async def get_load(request: web.Request) -> web.Response:
    return _json([_engine(request).scheduler.load()])


async def weight_version(request: web.Request) -> web.Response:
    return _json({"weight_version": _engine(request).weight_version})


async def models(request: web.Request) -> web.Response:
    eng = _engine(request)
    return _json({"object": "list", "data": [{"id": eng.model_path, "object": "model", "owned_by": "miles",
                                              "root": eng.model_path, "max_model_len": eng.runner.max_ctx}]})


# ----------------------------------------------------------------------------- control
async def flush_cache(request: web.Request) -> web.Response:
    b = await _body(request, P.FlushCacheReqInput, empty_ok=True)
    timeout_s = b.timeout_s
    if "timeout_s" in request.query:
        try:
            timeout_s = float(request.query["timeout_s"])
        except ValueError:
            raise P.BadRequest(f"flush_cache: timeout_s={request.query['timeout_s']!r} is not a number") from None
    if timeout_s is not None and not 0 <= timeout_s <= 3600:
        raise P.BadRequest(f"FlushCacheReqInput.timeout_s must be in [0, 3600] seconds, got {timeout_s}")
    ok = await _engine(request).flush_cache(timeout_s)
    return web.Response(status=200 if ok else 400, text="Cache flushed.\n" if ok else
                        "Cache not flushed: there are running or waiting requests.\n")


async def abort_request(request: web.Request) -> web.Response:
    b = await _body(request, P.AbortReq)
    if not b.abort_all and not b.rid:
        raise P.BadRequest("AbortReq: give 'rid' or 'abort_all': true")
    await _engine(request).abort(b.rid or None, b.abort_all)
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    b = await _body(request, P.PauseGenerationReqInput, empty_ok=True)
    await _engine(request).pause(b.mode)
    return _json({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    b = await _body(request, P.ContinueGenerationReqInput, empty_ok=True)
    await _engine(request).continue_generation(b.torch_empty_cache)
    return _json({"message": "Generation continued successfully.", "status": "ok"})


async def release_memory(request: web.Request) -> web.Response:
    b = await _body(request, P.MemoryOccupationReqInput, empty_ok=True)
    await _engine(request).release_memory(b.tags)
    return _json({"success": True, "message": f"released {b.tags or 'all'}"})


async def resume_memory(request: web.Request) -> web.Response:
    b = await _body(request, P.MemoryOccupationReqInput, empty_ok=True)
    await _engine(request).resume_memory(b.tags)
    return _json({"success": True, "message": f"resumed {b.tags or 'all'}"})


# ----------------------------------------------------------------------------- weights
async def _weight_call(coro, what: str) -> web.Response:
    try:
        n = await coro
    except (WeightUpdateError, ValueError) as e:
        if isinstance(e, P.BadRequest):
            raise
        logger.warning("%s failed: %s", what, e)
        return _result(False, f"{what} failed: {e}")
    return _result(True, f"{what} succeeded" + (f" ({n} tensors)." if isinstance(n, int) else "."))


async def init_group(request: web.Request) -> web.Response:
    b = await _body(request, P.InitWeightsUpdateGroupReqInput)
    return await _weight_call(_engine(request).init_group(b), "init_weights_update_group")


async def destroy_group(request: web.Request) -> web.Response:
    b = await _body(request, P.DestroyWeightsUpdateGroupReqInput, empty_ok=True)
    return await _weight_call(_engine(request).destroy_group(b.group_name), "destroy_weights_update_group")


async def begin_update(request: web.Request) -> web.Response:
    b = await _body(request, P.BeginWeightUpdateReqInput, empty_ok=True)
    return await _weight_call(_engine(request).begin_update(b.selector), "begin_weight_update")


async def end_update(request: web.Request) -> web.Response:
    await _body(request, P.EndWeightUpdateReqInput, empty_ok=True)
    return await _weight_call(_engine(request).end_update(), "end_weight_update")


def _whole_sync_mode(request: web.Request) -> str | None:
    """``?miles_whole_sync=<pause mode>``: this update is a whole weight sync (see :func:`_whole_sync`)."""
    mode = request.query.get(WHOLE_SYNC_PARAM)
    if mode is not None and mode not in ("abort", "retract", "in_place"):
        raise P.BadRequest(f"{WHOLE_SYNC_PARAM} must be a pause mode ('abort', 'retract' or 'in_place'), got {mode!r}")
    return mode


async def _whole_sync(eng: Engine, mode: str | None, update, what: str) -> web.Response:
    """One request for what is otherwise pause -> begin -> update -> end -> flush -> continue: pause in ``mode``,
    run ``update()`` (its body carries the version), flush the cache (not for ``in_place``; an unflushable cache
    fails it as ``/flush_cache`` would) and continue. A failure leaves the engine paused, as a failed sync does."""
    if mode is None:
        return await _weight_call(update(), what)
    await eng.pause(mode)
    resp = await _weight_call(update(), what)
    if resp.status != 200:
        return resp
    if mode != "in_place" and not await eng.flush_cache():
        return _result(False, f"{what} loaded the weights, but flush_cache failed: there are running or waiting requests")
    await eng.continue_generation()
    return resp


def _bucket_order(request: web.Request) -> tuple[str, int] | None:
    """``?miles_sync=<id>&miles_bucket=<index>``: this bucket's place in its sync (both or neither)."""
    sync_id, index = request.query.get(SYNC_ID_PARAM), request.query.get(BUCKET_PARAM)
    if sync_id is None and index is None:
        return None
    if sync_id is None or index is None or not index.isdigit():
        raise P.BadRequest(f"{SYNC_ID_PARAM} and {BUCKET_PARAM} go together, {BUCKET_PARAM} a bucket index >= 0; "
                           f"got {SYNC_ID_PARAM}={sync_id!r}, {BUCKET_PARAM}={index!r}")
    return sync_id, int(index)


def _loopback_only(what: str):
    """A route that unpickles tensor handles (``what``): 403 when asked from off this host of an engine without
    --api-key, else the route itself."""
    def wrap(handler):
        @functools.wraps(handler)
        async def guarded(request: web.Request) -> web.Response:
            if _engine(request).args.api_key is None and not (request.remote or "").startswith(_LOOPBACK):
                return _error(f"{what} unpickles tensor handles and is served only to loopback clients unless the "
                              "engine runs with --api-key", 403)
            return await handler(request)
        return guarded
    return wrap


async def update_from_distributed(request: web.Request) -> web.Response:
    b = await _body(request, P.UpdateWeightsFromDistributedReqInput)
    eng = _engine(request)
    order = _bucket_order(request)
    return await _whole_sync(eng, _whole_sync_mode(request), lambda: eng.update_from_distributed(b, order),
                             "update_weights_from_distributed")


@_loopback_only("update_weights_from_tensor")
async def update_from_tensor(request: web.Request) -> web.Response:
    eng = _engine(request)
    b = await _body(request, P.UpdateWeightsFromTensorReqInput)
    return await _whole_sync(eng, _whole_sync_mode(request), lambda: eng.update_from_tensor(b), "update_weights_from_tensor")


async def update_from_disk(request: web.Request) -> web.Response:
    b = await _body(request, P.UpdateWeightFromDiskReqInput)
    resp = await _weight_call(_engine(request).update_from_disk(b), "update_weights_from_disk")
    return resp


async def update_weight_version(request: web.Request) -> web.Response:
    b = await _body(request, P.UpdateWeightVersionReqInput)
    await _engine(request).update_weight_version(b.new_version, b.abort_all_requests)
    return _json({"success": True, "message": f"Weight version updated to {b.new_version}", "new_version": b.new_version})


async def get_weights_by_name(request: web.Request) -> web.Response:
    raw = await request.read()
    if raw.strip():
        b = P.decode(raw, P.GetWeightsByNameReqInput)
    elif "name" in request.query:
        b = P.GetWeightsByNameReqInput(name=request.query["name"], truncate_size=int(request.query.get("truncate_size", 100)))
    else:
        raise P.BadRequest("GetWeightsByNameReqInput: 'name' is required")
    return _json(await _engine(request).get_weights_by_name(b.name, b.truncate_size))


# ----------------------------------------------------------------------------- LoRA adapters
def _lora_result(out: dict[str, Any]) -> web.Response:
    """SGLang's LoRAUpdateOutput: 200 on success, 400 with its error_message otherwise."""
    return _json(out, 200 if out["success"] else 400)


async def load_lora_adapter(request: web.Request) -> web.Response:
    b = await _body(request, P.LoadLoRAAdapterReqInput)
    return _lora_result(await _engine(request).load_lora_adapter(b))


@_loopback_only("load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(request: web.Request) -> web.Response:
    eng = _engine(request)
    b = await _body(request, P.LoadLoRAAdapterFromTensorsReqInput)
    return _lora_result(await eng.load_lora_adapter_from_tensors(b))


async def load_lora_adapter_from_distributed(request: web.Request) -> web.Response:
    b = await _body(request, P.LoadLoRAAdapterFromDistributedReqInput)
    return _lora_result(await _engine(request).load_lora_adapter_from_distributed(b))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    b = await _body(request, P.UnloadLoRAAdapterReqInput)
    return _lora_result(await _engine(request).unload_lora_adapter(b))


def build_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[_make_auth(engine.args.api_key), _errors], client_max_size=1 << 30)
    app[_ENGINE] = engine
    r = app.router
    for m in ("POST", "PUT"):
        r.add_route(m, "/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health)
    r.add_get("/get_model_info", model_info)
    r.add_get("/model_info", model_info)
    r.add_get("/get_server_info", server_info)
    r.add_get("/server_info", server_info)
    r.add_get("/get_load", get_load)
    r.add_get("/get_weight_version", weight_version)
    r.add_get("/v1/models", models)
    for m in ("GET", "POST"):
        r.add_route(m, "/flush_cache", flush_cache)
        r.add_route(m, "/release_memory_occupation", release_memory)
        r.add_route(m, "/resume_memory_occupation", resume_memory)
        r.add_route(m, "/get_weights_by_name", get_weights_by_name)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/init_weights_update_group", init_group)
    r.add_post("/destroy_weights_update_group", destroy_group)
    r.add_post("/begin_weight_update", begin_update)
    r.add_post("/end_weight_update", end_update)
    r.add_post("/update_weights_from_distributed", update_from_distributed)
    r.add_post("/update_weights_from_tensor", update_from_tensor)
    r.add_post("/update_weights_from_disk", update_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/load_lora_adapter", load_lora_adapter)
    r.add_post("/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors)
    r.add_post("/load_lora_adapter_from_distributed", load_lora_adapter_from_distributed)
    r.add_post("/unload_lora_adapter", unload_lora_adapter)
    return app


class _ConnectionLog(logging.LoggerAdapter):
    """aiohttp's per-connection log. A request aiohttp cannot parse is answered 400 by aiohttp itself; here it is one
    debug line instead of an ERROR with a traceback: sglang-router probes every worker it adds over gRPC too (its
    connection-mode detection), and that HTTP/2 preface (``PRI * HTTP/2.0``) left two tracebacks in every engine log,
    which the run then quoted as the engine's last error when the engine died."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            kwargs.pop("exc_info")
            level, msg = logging.DEBUG, f"{msg}: not an HTTP/1 request (answered 400): %s"
            args = (*args, " ".join(str(exc).split())[:120])
        super().log(level, msg, *args, **kwargs)


async def serve(engine: Engine, host: str, port: int) -> None:
    """Run until cancelled (SIGTERM/SIGINT handled by the caller)."""
    app = build_app(engine)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_GRACE_S, logger=_ConnectionLog(get_logger("miles.engine.http")))
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    engine.start()
    logger.info("serving on http://%s:%d", host if ":" not in host else f"[{host}]", port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        engine.stop()
