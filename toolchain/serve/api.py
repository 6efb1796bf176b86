"""The HTTP API: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and /metrics.

The body arrives whole, within its size and time limits, from intake.py (which also checks the API key and gives
each request its id). It is parsed here, not by FastAPI, in a worker thread with the prompt's tokenization, so that
neither holds the event loop: bytes that are not UTF-8, text that is not JSON (or nested too deeply), a field of the
wrong type or range, an unknown model, a prompt longer than the context (checked in characters before it is
tokenized), ``max_tokens`` below 1 or past the context all get a 400 with OpenAI's error body (``{"error":
{"message", "type", "param", "code"}}``); more requests waiting than ``--max-queue`` a 429 with ``Retry-After``; a
request before the model is loaded a 503. Streams are server-sent events (``data: {chunk}`` ... ``data: [DONE]``); a
client that disconnects, streaming or not, has its request cancelled in the engine before its next step. No request
can take the server down: anything unexpected is a 500 for that request (or an error event in its stream) saying
"internal error" and the request id, which the server's log line with the traceback carries; the engine goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Annotated, Any, TypeVar, cast

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from toolchain.serve import schemas
from toolchain.serve.engine import Event, NotReady, QueueFull, Request as EngineRequest
from toolchain.serve.intake import Intake, internal_error
from toolchain.serve.metrics import CONTENT_TYPE, ReplicaSet, render
from toolchain.serve.schemas import FinishReason
from toolchain.serve.text import IncrementalText, StopText

# Requests parsed and tokenized at once, in worker threads: bounds the memory their Python objects take (a body's
# text, its token ids) whatever the number of clients; the engine's process has the cores.
PREPARE_THREADS = 2

log = logging.getLogger("dstc.serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = schemas.ErrorBody(error=schemas.ErrorDetail(message=self.message, type=self.type, param=self.param,
                                                           code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


class GenerationFailed(Exception):
    """A request the engine could not finish: ``status`` and a message for the client (details went to the log)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def create_app(service) -> Intake:
    """The app over a toolchain.serve.server.Service (its engine starts loading at startup): FastAPI's, with the
    routes below, inside the intake that bounds what reaches it (intake.py)."""
    app = FastAPI(title="dstc serve", version="1", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service
    app.state.preparing = anyio.CapacityLimiter(PREPARE_THREADS)
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(status_routes)
    app.include_router(generation_routes)
    settings = service.settings
    return Intake(app, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes,
                  body_timeout_s=settings.body_timeout_s, reject=service.metrics.reject,
                  access_log=log.info if settings.access_log else None)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine starts loading with the app and stops with it; its events reach the loop through ``dispatch``."""
    engine = app.state.service.engine
    loop = asyncio.get_running_loop()

    def dispatch(deliver) -> None:  # from the engine's thread: one wake-up of the loop per step
        with suppress(RuntimeError):  # the loop has closed (shutdown)
            loop.call_soon_threadsafe(deliver)

    engine.dispatch = dispatch
    engine.start()
    try:
        yield
    finally:
        engine.stop()


def _service(request: Request):
    """The toolchain.serve.server.Service the app serves (a route's dependency)."""
    return request.app.state.service


ServiceDep = Annotated[Any, Depends(_service)]


# -- errors: OpenAI's error body for each ----------------------------------------------------------------------


async def _api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    if e.status in (400, 404):
        _service(request).metrics.reject("invalid_request")
    return e.response()


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, StarletteHTTPException)
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return ApiError(e.status_code, str(e.detail), type=kind).response()


async def _validation_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, RequestValidationError)
    return ApiError(400, str(e.errors()[:1])).response()


async def _unexpected(request: Request, e: Exception) -> Response:  # Starlette raises it again: the intake logs it
    return ApiError(500, internal_error(request.state.request_id), type="server_error").response()


ERROR_HANDLERS = {ApiError: _api_error, StarletteHTTPException: _http_error,
                  RequestValidationError: _validation_error, Exception: _unexpected}


# -- /health, /metrics, /v1/models -----------------------------------------------------------------------------

status_routes = APIRouter()


@status_routes.get("/health")
async def health(service: ServiceDep) -> JSONResponse:
    engine = service.engine
    state = engine.state
    body = {"state": state, "model": service.model_name, "backend": service.artifact.backend,
            "engine": getattr(engine, "engine_name", None)}
    if service.settings.speculate is not None:
        body["speculation"] = {"method": service.settings.speculate,
                               "draft_tokens": service.settings.draft_tokens, **service.metrics.speculation()}
    if isinstance(engine, ReplicaSet):
        # each replica as Ray Serve's router last saw it; ready while one of them is
        replicas = engine.replica_stats()
        ready = sum(r["state"] == "ready" for r in replicas)
        if state == "ready" and not ready:
            state = body["state"] = "loading"
        body.update(replicas_ready=ready, replicas_target=engine.target, replicas=[
            {key: r.get(key) for key in ("replica", "state", "pid", "engine_pid", "cores", "load_seconds",
                                         "running", "queue_depth", "kv_cache_usage")} for r in replicas])
    if state == "ready":
        body.update(service.health.report())
        body.update(load_seconds=engine.load_seconds, running=engine.running, queue_depth=engine.queue_depth,
                    engine_pid=getattr(engine, "pid", None), engine_restarts=getattr(engine, "restarts", 0))
        return JSONResponse(body)
    if engine.load_error:
        body["error"] = engine.load_error
    return JSONResponse(body, status_code=503)


@status_routes.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(render(service.metrics), media_type=CONTENT_TYPE)


@status_routes.get("/v1/models")
async def models(service: ServiceDep) -> JSONResponse:
    cards = [schemas.ModelCard(id=name, created=service.created, max_model_len=service.context,
                               backend=service.artifact.backend) for name in service.model_names]
    return JSONResponse(schemas.ModelList(data=cards).model_dump())


# -- /v1/completions, /v1/chat/completions ---------------------------------------------------------------------

generation_routes = APIRouter()


@generation_routes.post("/v1/completions")
async def completions(request: Request, service: ServiceDep):
    params, prompt, max_tokens = await _prepared(request, partial(_prepare_completion, service))
    return await _respond(service, request, params, prompt, max_tokens, chat=False)


@generation_routes.post("/v1/chat/completions")
async def chat_completions(request: Request, service: ServiceDep):
    params, prompt, max_tokens = await _prepared(request, partial(_prepare_chat, service))
    return await _respond(service, request, params, prompt, max_tokens, chat=True)


async def _prepared(request: Request, prepare):
    """``prepare(body)`` in a worker thread: parsing and tokenizing never hold the event loop."""
    return await anyio.to_thread.run_sync(prepare, await request.body(), limiter=request.app.state.preparing)


def _prepare_completion(service, raw: bytes) -> tuple[schemas.CompletionRequest, list[int], int]:
    params = _parse(_json(raw), schemas.CompletionRequest)
    service.check_model(params.model)
    prompt = service.completion_prompt(params.prompt)
    return params, prompt, service.budget(len(prompt), params.max_tokens, default=16, param="prompt")


def _prepare_chat(service, raw: bytes) -> tuple[schemas.ChatCompletionRequest, list[int], int]:
    params = _parse(_json(raw), schemas.ChatCompletionRequest)
    service.check_model(params.model)
    prompt = service.chat_prompt([{"role": m.role, "content": m.text()} for m in params.messages])
    return params, prompt, service.budget(len(prompt), params.max_tokens, default=None, param="messages")


async def _respond(service, request: Request, params, prompt: list[int], max_tokens: int, chat: bool):
    """A stream of events, or the whole answer once generated (499 when the client went away first)."""
    # 429 / 503 here, before any byte is sent
    generation = Generation(service, prompt, max_tokens, params, request.state.request_id)
    request.state.usage = generation.usage  # read by the access log line when the response has ended (intake.py)
    ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    if params.stream:
        options = params.stream_options or schemas.StreamOptions()
        events = _chat_events if chat else _completion_events
        return EventStream(events(generation, ident, created, service.model_name, options.include_usage,
                                  options.continuous_usage_stats),
                           on_close=generation.close)
    try:
        text, finish = await generation.collect(request)
    except GenerationFailed as e:
        raise ApiError(e.status, str(e), type="server_error") from None
    finally:
        generation.close()
    if finish is None:  # the client went away
        return Response(status_code=499)
    usage = generation.usage()
    body: schemas.ChatCompletion | schemas.Completion
    if chat:
        body = schemas.ChatCompletion(id=ident, created=created, model=service.model_name, usage=usage, choices=[
            schemas.ChatChoice(message=schemas.AssistantMessage(content=text), finish_reason=finish)])
    else:
        body = schemas.Completion(id=ident, created=created, model=service.model_name, usage=usage, choices=[
            schemas.CompletionChoice(text=text, finish_reason=finish)])
    return JSONResponse(body.model_dump())


# -- request bodies (in a worker thread) ------------------------------------------------------------------------


def _json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    try:
        body = json.loads(text)
        # JSON's \ud800-style escapes can spell lone surrogates, which are not text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deeply", code="invalid_json") from None
    except UnicodeEncodeError:
        raise ApiError(400, "the request contains a string that is not valid UTF-8 (a lone surrogate escape)",
                       code="invalid_utf8") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


Params = TypeVar("Params", schemas.CompletionRequest, schemas.ChatCompletionRequest)


def _parse(body: dict, model: type[Params]) -> Params:
    try:
        params = model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                       code="invalid_value") from None
    unsupported = params.unsupported()
    if unsupported:
        raise ApiError(400, unsupported[1], param=unsupported[0], code="unsupported_parameter")
    return params


# -- generation -------------------------------------------------------------------------------------------------


class Generation:
    """One request in the engine, seen from the event loop: its events arrive on an asyncio queue."""

    def __init__(self, service, prompt: list[int], max_tokens: int, params, request_id: str) -> None:
        self.service = service
        self.prompt = prompt
        self.request_id = request_id
        self.completion_tokens = 0
        self.done = False
        self._closed = False
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        # the engine's dispatch (set at startup) calls sinks on the event loop
        self.request = EngineRequest(prompt=prompt, max_tokens=max_tokens, sampling=service.sampling(params),
                                     stop_ids=frozenset(service.artifact.eos_token_ids), sink=self._queue.put_nowait,
                                     ignore_eos=params.ignore_eos)
        self._stops = StopText(params.stop or [])
        self._text = IncrementalText(service.tokenizer)
        try:
            self.id = service.engine.submit(self.request)
        except QueueFull as e:
            service.metrics.reject("queue_full")
            raise ApiError(429, f"the server is busy: {e}; retry after {e.retry_after_s} s", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(e.retry_after_s)}) from None
        except NotReady as e:
            service.metrics.reject("not_ready")
            raise ApiError(503, f"the model is not ready: {e}", type="server_error", code="not_ready",
                           headers={"Retry-After": "1"}) from None

    async def pieces(self, every_event: bool = False) -> AsyncIterator[tuple[str, FinishReason | None]]:
        """(text, finish reason or None) as tokens arrive (with ``every_event``, also text-less increments);
        GenerationFailed on an engine error (logged with the request id) or at shutdown."""
        while not self.done:
            event = await self._queue.get()
            self.completion_tokens += len(event.tokens)
            text = self._text.add(event.tokens) if event.tokens else ""
            if event.finish is not None:
                text += self._text.flush()
            out = self._stops.feed(text)
            if self._stops.stopped:
                self.close()  # the engine stops generating for it before its next step
                self.done = True
                yield out, "stop"
                return
            if event.finish is not None:
                self.done = True
                if event.finish == "error":
                    log.error("dstc serve: %s: the request failed in the engine: %s", self.request_id,
                              event.error or "no reason given")
                    raise GenerationFailed(500, internal_error(self.request_id))
                if event.finish == "cancelled":
                    raise GenerationFailed(503, "the server is shutting down")
                # the engine finishes a request with stop, length, cancelled or error, the last two raised above
                yield out + self._stops.flush(), cast(FinishReason, event.finish)
                return
            if out or every_event:
                yield out, None

    async def collect(self, request: Request) -> tuple[str, FinishReason | None]:
        """The whole text and finish reason; (partial text, None) when the client disconnects first. The disconnect
        is listened for while the engine generates: a check made only when no piece came for a while never ran
        while each step brought one, and an abandoned request kept its batch slot to its last token."""
        parts: list[str] = []

        async def generate() -> tuple[str, FinishReason | None]:
            finish: FinishReason | None = None
            async for text, reason in self.pieces():
                parts.append(text)
                finish = reason
            return "".join(parts), finish

        async def disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        generating = asyncio.ensure_future(generate())
        listening = asyncio.ensure_future(disconnect())
        try:
            await asyncio.wait({generating, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            if not generating.done():
                generating.cancel()
        if generating.done() and not generating.cancelled():
            return generating.result()
        return "".join(parts), None

    def usage(self) -> schemas.Usage:
        return schemas.Usage(prompt_tokens=len(self.prompt), completion_tokens=self.completion_tokens,
                             total_tokens=len(self.prompt) + self.completion_tokens)

    def close(self) -> None:
        """Cancel the request in the engine unless it finished (a client gone, a stop sequence met); once."""
        if self._closed:
            return
        self._closed = True
        if not self.request.finished:
            self.service.engine.cancel(self.id)
        if self.request.last_token_at is not None:
            self.service.metrics.request_done(self.request.last_token_at - self.request.arrived)


def _sse(body) -> str:
    data = body.model_dump(exclude_none=False) if isinstance(body, BaseModel) else body
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error_event(message: str) -> str:
    return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


async def _completion_events(generation: Generation, ident: str, created: int, model: str, include_usage: bool,
                             continuous: bool) -> AsyncIterator[str]:
    try:
        async for text, finish in generation.pieces(every_event=continuous):
            if text or finish or continuous:
                yield _sse(schemas.Completion(id=ident, created=created, model=model, choices=[
                    schemas.CompletionChoice(text=text, finish_reason=finish)],
                    usage=generation.usage() if continuous else None))
    except GenerationFailed as e:
        yield _error_event(str(e))
        return
    if include_usage:
        yield _sse(schemas.Completion(id=ident, created=created, model=model, choices=[], usage=generation.usage()))
    yield "data: [DONE]\n\n"


async def _chat_events(generation: Generation, ident: str, created: int, model: str, include_usage: bool,
                       continuous: bool) -> AsyncIterator[str]:
    def chunk(delta: schemas.Delta, finish=None, usage=None, choices=True):
        return _sse(schemas.ChatCompletionChunk(id=ident, created=created, model=model, usage=usage, choices=[
            schemas.ChunkChoice(delta=delta, finish_reason=finish)] if choices else []))

    yield chunk(schemas.Delta(role="assistant", content=""))
    try:
        async for text, finish in generation.pieces(every_event=continuous):
            usage = generation.usage() if continuous else None
            if text or (continuous and not finish):
                yield chunk(schemas.Delta(content=text), usage=usage)
            if finish:
                yield chunk(schemas.Delta(), finish, usage=usage)
    except GenerationFailed as e:
        yield _error_event(str(e))
        return
    if include_usage:
        yield chunk(schemas.Delta(), usage=generation.usage(), choices=False)
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that end as soon as the client disconnects, whatever the ASGI server's version: sending
    and listening for the disconnect run side by side, and ``on_close`` runs however the stream ends."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with suppress(OSError):  # the client has gone
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(listen)
        finally:
            self.on_close()
            with suppress(Exception):
                if isinstance(self.body_iterator, AsyncGenerator):  # the events generators above
                    await self.body_iterator.aclose()

