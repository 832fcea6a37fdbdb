"""The OpenAI-compatible HTTP API over the engine (FastAPI).

``create_app(engine)`` serves ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream`` as server-sent events, ending ``data: [DONE]``),
``GET /health`` and ``GET /metrics``. The engine's loop runs in its own thread; a request
is submitted to it and its outputs come back to the event loop through an asyncio queue.
A client that goes away (a closed stream, a dropped connection) cancels its request, whose
blocks are freed at the engine's next step.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` naming the field for a bad body or a request that can never fit
(prompt + ``max_tokens`` past the model's context or the largest KV pool), 401 for a
missing or wrong API key, 404 ``model_not_found``, 429 when too many requests wait for KV
blocks already (``Retry-After``), 503 when the engine failed the request (a worker or the
allocator is down).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvservice.api.metrics import ApiMetrics
from kvservice.api.schemas import ChatCompletionRequest, CompletionRequest, Sampling
from kvservice.engine import Completion, Engine, EngineBusy, Request, RequestError
from kvservice.engine.text import Message


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


#: Request fields of the engine -> the API's names (for the errors' ``param``).
FIELDS = {"max_new_tokens": "max_tokens", "prompt": "prompt", "stop": "stop", "n": "n",
          "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}


@dataclass(slots=True)
class Settings:
    """What the API serves and how.

    Attributes:
        model_name: the model's id in ``/v1/models`` and the replies (default: the
            workers' preset name).
        api_key: when set, every ``/v1`` call must send ``Authorization: Bearer <key>``.
        default_max_tokens: a chat's ``max_tokens`` when the request gives none.
    """

    model_name: str = ""
    api_key: str = ""
    default_max_tokens: int = 512


def create_app(engine: Engine, settings: Settings | None = None,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The FastAPI application over a started engine (``engine.start()``)."""
    settings = settings or Settings()
    model = settings.model_name or (engine.model.name if engine.model else "model")
    registry = registry or CollectorRegistry()
    metrics = ApiMetrics(registry, engine)
    created = int(time.time())
    app = FastAPI(title="kvservice", description="OpenAI-compatible API over the kvservice engine",
                  docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [p for p in first.get("loc", ()) if p != "body"]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            message = f"unrecognized request argument supplied: {param}"
        elif first.get("type") == "json_invalid":
            message, param = "the body is not valid JSON", None
        elif first.get("type") == "model_attributes_type" or not loc:
            message = "the body must be a JSON object"
        return ApiError(400, f"{param}: {message}" if param and not message.startswith("unrecognized") else message,
                        param=param).response()

    @app.middleware("http")
    async def _auth(request: HttpRequest, call_next):
        if settings.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
                return ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model, created, engine)]}

    @app.get("/v1/models/{name}")
    async def model_card(name: str) -> dict:
        _check_model(name, model)
        return _model_card(model, created, engine)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        _check_model(body.model, model)
        if isinstance(body.prompt, str):
            prompt = _tokenizer(engine, "prompt").encode(body.prompt)
        else:
            prompt = list(body.prompt)
        return await _serve(engine, metrics, http, body, prompt, body.max_tokens, model, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HttpRequest):
        _check_model(body.model, model)
        tokenizer = _tokenizer(engine, "messages")
        try:
            prompt = tokenizer.chat_prompt([Message(m.role, m.text) for m in body.messages])
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens or settings.default_max_tokens
        return await _serve(engine, metrics, http, body, prompt, max_tokens, model, chat=True)

    return app


def _model_card(model: str, created: int, engine: Engine) -> dict:
    card = {"id": model, "object": "model", "created": created, "owned_by": "kvservice"}
    if engine.model is not None:
        card["max_model_len"] = engine.model.max_position_embeddings or None
    return card


def _check_model(name: str, model: str) -> None:
    if name != model:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {model!r}", param="model",
                       code="model_not_found")


def _tokenizer(engine: Engine, param: str):
    if engine.tokenizer is None:
        raise ApiError(400, "the model has no tokenizer: send the prompt as token ids to /v1/completions",
                       param=param)
    return engine.tokenizer


def _request(body: Sampling, prompt: list[int], max_tokens: int) -> Request:
    seed = body.seed if body.seed is not None else random.getrandbits(62)
    try:
        return Request(prompt, max_new_tokens=max_tokens, n=body.n, temperature=body.temperature, seed=seed,
                       request_id=uuid.uuid4().hex, top_p=body.top_p, top_k=max(body.top_k, 0),
                       stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos)
    except RequestError as exc:
        raise ApiError(400, str(exc), param=FIELDS.get(exc.field, exc.field or None)) from None


async def _serve(engine: Engine, metrics: "ApiMetrics", http: HttpRequest, body: Sampling, prompt: list[int],
                 max_tokens: int, model: str, *, chat: bool):
    """Submits the request; answers with the whole completion, or streams it."""
    req = _request(body, prompt, max_tokens)
    endpoint = "chat" if chat else "completions"
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    timing = metrics.start(endpoint)
    try:
        handle = engine.submit(req, on_event=lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
    except RequestError as exc:
        metrics.refused(endpoint, 400)
        raise ApiError(400, str(exc), param=FIELDS.get(exc.field, exc.field or None)) from None
    except EngineBusy as exc:
        metrics.refused(endpoint, 429)
        raise ApiError(429, f"the KV pools are full: {exc}; retry later", type_="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
    ident = ("chatcmpl-" if chat else "cmpl-") + req.request_id
    created = int(time.time())
    if body.stream:
        chunks = _stream(handle, events, timing, ident, created, model, req.n, chat,
                         bool(body.stream_options and body.stream_options.include_usage))
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    completion = await _wait(handle, events, timing, http)
    if completion.error:
        timing.done(completion, 503)
        raise ApiError(503, f"the request failed: {completion.error}", type_="server_error",
                       code="service_unavailable")
    timing.done(completion, 200)
    choices = [({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                 "finish_reason": _reason(reason)} if chat else
                {"index": i, "text": text, "logprobs": None, "finish_reason": _reason(reason)})
               for i, (text, reason) in enumerate(zip(_texts(engine, completion), completion.finish_reasons))]
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": _usage(completion)}


def _reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons (``stop``, ``length``); a request ended by the server:
    ``abort``, as vLLM says."""
    return "abort" if reason in ("cancelled", "error") else reason


def _texts(engine: Engine, c: Completion) -> list[str]:
    """The samples' texts (the tokens as text when the model has no tokenizer: "" each)."""
    return c.texts if engine.tokenizer is not None else ["" for _ in c.outputs]


def _usage(c: Completion) -> dict:
    generated = sum(len(o) for o in c.outputs)
    return {"prompt_tokens": c.num_prompt_tokens, "completion_tokens": generated,
            "total_tokens": c.num_prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": c.num_cached_tokens}}


async def _wait(handle, events: asyncio.Queue, timing, http: HttpRequest) -> Completion:
    """The completion; the request is cancelled if the client goes away meanwhile."""
    getter: asyncio.Future | None = None
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({getter}, timeout=1.0)
            if not done:
                if await http.is_disconnected():
                    handle.cancel()
                continue
            event, getter = getter.result(), None
            if isinstance(event, Completion):
                return event
            timing.output(event)
    except asyncio.CancelledError:
        handle.cancel()
        raise
    finally:
        if getter is not None:
            getter.cancel()


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(handle, events: asyncio.Queue, timing, ident: str, created: int, model: str, n: int,
                  chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion; a client that stops reading
    cancels the request."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict]) -> str:
        return _sse({"id": ident, "object": kind, "created": created, "model": model, "choices": choices,
                     **usage_field})

    finished = False
    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n)])
        while True:
            event = await events.get()
            if isinstance(event, Completion):
                finished = True
                timing.done(event, 200 if not event.error else 503)
                if event.error:
                    yield _sse({"error": {"message": f"the request failed: {event.error}", "type": "server_error",
                                          "param": None, "code": "service_unavailable"}})
                elif include_usage:
                    yield _sse({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                                "usage": _usage(event)})
                yield "data: [DONE]\n\n"
                return
            timing.output(event)
            if not event.text and not event.finish_reason:
                continue
            if event.finish_reason == "error":
                continue
            if chat:
                delta = {"content": event.text} if event.text else {}
                yield chunk([{"index": event.index, "delta": delta, "logprobs": None,
                              "finish_reason": _reason(event.finish_reason)}])
            else:
                yield chunk([{"index": event.index, "text": event.text, "logprobs": None,
                              "finish_reason": _reason(event.finish_reason)}])
    finally:
        if not finished:
            handle.cancel()
            timing.cancelled()


__all__ = ["ApiError", "Settings", "create_app"]
