"""The router's OpenAI-compatible HTTP front (Starlette, served by uvicorn).

Why Starlette and a hand-written parser rather than FastAPI models: every bad body must be a 400
naming the field through the same `InvalidRequestError` the gRPC front raises (never a 422, never a
500), so request bodies go through `chariot.router.openai_api` and nothing else; Starlette only
routes and streams. Generation goes through the shared `DataPlane`, errors through `error_status()`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent events —
one `data: {json}` event per chunk the replica streams, the last one with `finish_reason`, an optional
usage chunk, then `data: [DONE]` — or one JSON response), `GET /v1/models`, `GET /health` (200 when
at least one replica is ready or, with a hold queue, while requests would be held for one; else 503:
readiness), `GET /health/live` (200 while the process
serves, whatever its replicas: liveness), `GET /metrics` (Prometheus exposition), `GET /load` (the
offered load over the last window and each replica's capacity, JSON: what the autoscaler reads).

API keys (`chariot.router.auth`): when the router has a key file, every path but `/health`,
`/health/live` and `/metrics` (probes and scraping stay open) needs `Authorization: Bearer <key>`;
`RequireApiKey` answers 401 before the request reaches a handler, and the key's tenant replaces
whatever the caller named (`X-Tenant` and `user` then become an end-user label on the trace).

Headers: `X-Tenant` (overrides the body's `user` as the rate-limit tenant), `X-Request-Id`
(client-chosen request id, echoed back), `traceparent` (continues the caller's trace), `X-Session-Id`
(a session-affinity hint for routing; without it the body's `user` is the hint). Responses
carry `X-Request-Id` and `X-Chariot-Replica` (the replica that served the request).

`n` > 1 choices fan out here, not in the data plane: choice i is an independent request `{id}-{i}`
(with a `seed`, sampled with `seed + i`), so admission, rate limits, load balancing, retries and
cancellation treat each choice like any other request, and choice i is exactly what an `n` = 1
request with that seed returns. All n run concurrently; streamed chunks interleave as they arrive,
each with its `index`. A choice that fails before anything was sent fails the whole request with
its own status (the others are cancelled); once streaming, it ends the stream with an error event.
`X-Chariot-Replica` then lists the replicas known when the headers went out (comma-separated).

A client that disconnects — while its request is queued, while a non-streaming response is being
generated, or mid-stream — cancels the upstream worker call at once (the worker aborts the request
and frees its KV blocks): every wait on the data plane races a watch on the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from chariot.contracts.errors import AuthenticationError, InvalidRequestError, UnknownModelError, error_status
from chariot.contracts.outputs import RequestOutput
from chariot.contracts.proto_codec import MAX_REQUEST_ID_CHARS
from chariot.contracts.requests import FinishReason, new_request_id
from chariot.contracts.tokenizer import Tokenizer
from chariot.router.auth import ANY_MODEL, Principal
from chariot.router.dataplane import DataPlane, GenerateInput
from chariot.router.openai_api import (
    MAX_BODY_BYTES,
    OpenAIRequest,
    check_request_id,
    check_tenant,
    choice,
    echo_text,
    envelope,
    error_payload,
    logprobs_payload,
    parse_chat,
    parse_completion,
    usage,
)
from chariot.router.upstream import ReplicaUnavailable

T = TypeVar("T")
ChoiceChunk = tuple[int, RequestOutput]  # (choice index, one of its chunks) when `n` > 1
MAX_SEED = (1 << 63) - 1  # SamplingParams' seed range: choice i's `seed + i` must stay inside it
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; never seen by the client
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"
MAX_SESSION_CHARS = 256  # an X-Session-Id is a routing hint: longer ones are cut, never refused
OPEN_PATHS = frozenset({"/health", "/health/live", "/metrics", "/load"})  # no API key: probes, scraping, autoscaler
PRINCIPAL_SCOPE_KEY = "chariot.principal"  # where `RequireApiKey` leaves the request's `Principal`

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


def error_response(exc: BaseException, request_id: str = "") -> JSONResponse:
    """The OpenAI-style error response for `exc`; a 500 logs its traceback with the request id (the
    client only learns the exception's type) and echoes the id in `X-Request-Id`."""
    status, body, headers = error_payload(exc)
    log_if_internal(exc, request_id)
    if request_id:
        headers = {**headers, "X-Request-Id": request_id}
    return JSONResponse(body, status_code=status, headers=headers)


def log_if_internal(exc: BaseException, request_id: str) -> None:
    """Log the traceback of an error that becomes a 500 / INTERNAL, with the request id: the client
    only learns the exception's type."""
    if error_status(exc)[0] == "INTERNAL":
        log.error("request %s: internal error", request_id or "-", exc_info=exc)


def response_headers(chunk: RequestOutput) -> dict[str, str]:
    """The request id (echoing `X-Request-Id`) and the replica that served it (for debugging)."""
    return {"X-Request-Id": chunk.request_id, "X-Chariot-Replica": chunk.replica}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must already have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled (and `ClientGone` raised) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose producer is cancelled as soon as the client disconnects.

    (Starlette only watches for the disconnect on older ASGI spec versions; this always does, so an
    abandoned stream never waits for its next token to notice.)
    """

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait((stream, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, watch):
                t.cancel()
            results = await asyncio.gather(stream, watch, return_exceptions=True)
            # Cancelled while sending, the producer sits at a `yield`: close it now (cancelling upstream).
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            raise results[0]


async def read_body(request: Request) -> bytes:
    """The request body, refusing (400 naming `body`) more than `MAX_BODY_BYTES`."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise InvalidRequestError("body", f"exceeds {MAX_BODY_BYTES} bytes")
        parts.append(part)
    return b"".join(parts)


async def _next_chunk(stream: AsyncGenerator[T, None]) -> T:
    return await stream.__anext__()


async def _collect(stream: AsyncGenerator[RequestOutput, None]) -> list[RequestOutput]:
    return [chunk async for chunk in stream]


class OpenAIFront:
    """The HTTP handlers, bound to one `DataPlane`."""

    def __init__(self, dataplane: DataPlane) -> None:
        self._dp = dataplane
        self._created = int(time.time())

    # generation ----------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, lambda body: parse_completion(body))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, lambda body: parse_chat(body, self._dp.tokenizer))

    async def _generate(self, request: Request, parse: Callable[[bytes], OpenAIRequest]) -> Response:
        try:
            parsed = parse(await read_body(request))
            echo = echo_text(parsed, self._dp.tokenizer)
            request_id = check_request_id(request.headers.get("x-request-id", "")) or new_request_id()
            named = check_tenant(request.headers.get("x-tenant", "")) or parsed.user
        except InvalidRequestError as exc:
            self._dp.reject(exc)
            return error_response(exc)
        except ClientDisconnect:  # gone while sending its body
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        trace = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))}
        session = request.headers.get("x-session-id", "")[:MAX_SESSION_CHARS] or parsed.user
        principal = principal_of(request)
        tenant, end_user = (principal.tenant, named) if principal is not None else (named, "")
        req = GenerateInput(parsed.prompt, parsed.params, request_id, tenant, parsed.model, trace or None, session,
                            principal=principal, end_user=end_user)
        if parsed.n > 1:
            return await self._generate_choices(request, parsed, req, echo)
        stream = self._dp.generate(req)
        if parsed.stream:
            return await self._stream(request, parsed, stream, request_id, echo)
        return await self._complete(request, parsed, stream, request_id, echo)

    async def _complete(self, request: Request, parsed: OpenAIRequest, stream: AsyncGenerator[RequestOutput, None],
                        request_id: str, echo: str) -> Response:
        try:
            chunks = await until_disconnect(request, _collect(stream))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            return error_response(exc, request_id)
        last = chunks[-1]
        if last.finish_reason == FinishReason.ERROR:
            return error_response(ReplicaUnavailable(f"replica {last.replica} failed the request: {last.error}"),
                                  request_id)
        body = envelope(parsed, last.request_id, int(time.time()), self._dp.served_model, chunk=False)
        body["choices"] = [_whole_choice(parsed, chunks, echo, tokenizer=self._dp.tokenizer)]
        body["usage"] = usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        return JSONResponse(body, headers=response_headers(last))

    async def _stream(self, request: Request, parsed: OpenAIRequest, stream: AsyncGenerator[RequestOutput, None],
                      request_id: str, echo: str) -> Response:
        """Wait for the first chunk (so admission errors get their own status), then stream SSE."""
        try:
            first = await until_disconnect(request, _next_chunk(stream))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # (never StopAsyncIteration: the data plane ends with a finished chunk or raises)
            return error_response(exc, request_id)
        events = self._events(parsed, replace(first, new_text=echo + first.new_text) if echo else first, stream)
        return EventStreamResponse(events, response_headers(first))

    async def _events(
        self, parsed: OpenAIRequest, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None]
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        head = envelope(parsed, first.request_id, created, self._dp.served_model, chunk=True)
        last, tokenizer, offsets = first, self._dp.tokenizer, {0: 0}
        async with contextlib.aclosing(stream):
            try:
                if (event := _chunk_event(parsed, head, first, offsets, first=True, tokenizer=tokenizer)) is not None:
                    yield event
                async for chunk in stream:
                    last = chunk
                    if (event := _chunk_event(parsed, head, chunk, offsets, tokenizer=tokenizer)) is not None:
                        yield event
            except Exception as exc:
                log_if_internal(exc, first.request_id)
                yield sse(error_payload(exc)[1])
                yield DONE_EVENT
                return
        if last.finish_reason == FinishReason.ERROR:
            yield sse(error_payload(ReplicaUnavailable(f"replica {last.replica} failed: {last.error}"))[1])
        elif parsed.include_usage:
            yield sse({**head, "choices": [], "usage": usage(last.num_prompt_tokens, last.num_output_tokens,
                                                             last.num_cached_tokens)})
        yield DONE_EVENT

    # n > 1 choices: one sub-request per choice (see the module docstring) -------------------------

    async def _generate_choices(self, request: Request, parsed: OpenAIRequest, req: GenerateInput,
                                echo: str) -> Response:
        try:
            tokenized = replace(req, prompt=await self._dp.tokenize(req.prompt))  # n choices, one tokenisation
            inputs = choice_inputs(tokenized, parsed.n)
        except InvalidRequestError as exc:
            self._dp.reject(exc)
            return error_response(exc)
        chunks = fan_out(self._dp, inputs)
        if parsed.stream:
            return await self._stream_choices(request, parsed, chunks, req.request_id, echo)
        return await self._complete_choices(request, parsed, chunks, req.request_id, echo)

    async def _complete_choices(self, request: Request, parsed: OpenAIRequest,
                                chunks: AsyncGenerator[ChoiceChunk, None], request_id: str, echo: str) -> Response:
        try:
            per_choice = await until_disconnect(request, _collect_choices(chunks, parsed.n))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            return error_response(exc, request_id)
        lasts = [c[-1] for c in per_choice]
        body = envelope(parsed, request_id, int(time.time()), self._dp.served_model, chunk=False)
        body["choices"] = [_whole_choice(parsed, c, echo, i, self._dp.tokenizer) for i, c in enumerate(per_choice)]
        body["usage"] = total_usage(lasts)
        return JSONResponse(body, headers=choices_headers(request_id, lasts))

    async def _stream_choices(self, request: Request, parsed: OpenAIRequest,
                              chunks: AsyncGenerator[ChoiceChunk, None], request_id: str, echo: str) -> Response:
        """Like `_stream`: the status is decided by the first chunk of any choice (or the first failure)."""
        try:
            first = await until_disconnect(request, _next_chunk(chunks))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # the fan-out has already cancelled every other choice
            return error_response(exc, request_id)
        events = self._choice_events(parsed, first, chunks, request_id, echo)
        return EventStreamResponse(events, choices_headers(request_id, [first[1]]))

    async def _choice_events(self, parsed: OpenAIRequest, first: ChoiceChunk,
                             chunks: AsyncGenerator[ChoiceChunk, None], request_id: str,
                             echo: str) -> AsyncIterator[bytes]:
        """Each choice's chunks as they come (its first one with the echo and, on chat, the role);
        a failing choice ends the stream with an error event and closes the others."""
        head = envelope(parsed, request_id, int(time.time()), self._dp.served_model, chunk=True)
        lasts: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}  # each choice's logprobs text_offset so far
        async with contextlib.aclosing(chunks):
            try:
                item: ChoiceChunk | None = first
                while item is not None:
                    index, chunk = item
                    fresh = index not in lasts
                    lasts[index] = chunk
                    if fresh and echo:
                        chunk = replace(chunk, new_text=echo + chunk.new_text)
                    event = _chunk_event(parsed, head, chunk, offsets, first=fresh, index=index,
                                         tokenizer=self._dp.tokenizer)
                    if event is not None:
                        yield event
                    if chunk.finish_reason == FinishReason.ERROR:
                        raise replica_failed(chunk)
                    item = await anext(chunks, None)
            except Exception as exc:
                log_if_internal(exc, request_id)
                yield sse(error_payload(exc)[1])
                yield DONE_EVENT
                return
        if parsed.include_usage:
            yield sse({**head, "choices": [], "usage": total_usage(list(lasts.values()))})
        yield DONE_EVENT

    # introspection -------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data = [
            {"id": m.id, "object": "model", "created": self._created, "owned_by": "chariot",
             "max_model_len": m.max_model_len, "ready_replicas": m.ready_replicas}
            for m in self._dp.models() if may_use(request, m.id)
        ]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: the served model, or 404 naming `model`."""
        wanted = request.path_params["model_id"]
        for m in self._dp.models():
            if m.id == wanted:
                return JSONResponse({"id": m.id, "object": "model", "created": self._created, "owned_by": "chariot",
                                     "max_model_len": m.max_model_len, "ready_replicas": m.ready_replicas})
        return error_response(UnknownModelError(wanted, self._dp.served_model))

    async def live(self, request: Request) -> Response:
        """Liveness: the process serves HTTP. No ready replica is not a reason to restart the router
        (clients then get the designed 503, not connection refused)."""
        return JSONResponse({"status": "alive"})

    async def health(self, request: Request) -> Response:
        h = self._dp.health()
        body = {
            "status": "ok" if h.ready_replicas else "holding" if h.serving else "unavailable",
            "ready_replicas": h.ready_replicas,
            "replicas": h.replicas,
            "in_flight": h.in_flight,
            "state": {"backend": h.state.backend, "degraded": h.state.degraded, "reason": h.state.reason},
        }
        return JSONResponse(body, status_code=200 if h.serving else 503)

    async def load(self, request: Request) -> Response:
        """This router's offered load (`chariot.router.offered_load`): what the autoscaler reads."""
        return JSONResponse(self._dp.offered_load().to_dict())

    async def metrics(self, request: Request) -> Response:
        body, content_type = self._dp.telemetry.prometheus_response(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})


def _chunk_event(parsed: OpenAIRequest, head: dict[str, Any], chunk: RequestOutput, offsets: dict[int, int], *,
                 first: bool = False, index: int = 0, tokenizer: Tokenizer | None = None) -> bytes | None:
    """One SSE chunk event (of choice `index`; `offsets[index]`, the logprobs `text_offset` the choice
    has reached, moves on past this chunk's tokens). A chunk that ends the request with an error
    carries no OpenAI finish reason: its text (if any) goes out unfinished and the stream ends with
    an error event."""
    failed = chunk.finish_reason == FinishReason.ERROR
    if failed and not chunk.new_text and not chunk.new_token_ids:
        return None
    reason = None if failed else chunk.finish_reason
    offset = offsets.get(index, 0)
    logprobs = logprobs_payload(parsed, chunk.new_logprobs, tokenizer, offset)
    if logprobs is not None and "tokens" in logprobs:  # completions: text_offset runs across chunks
        offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
    part = choice(parsed, chunk.new_text, reason, chunk.new_token_ids, delta=True, first=first, index=index,
                  logprobs=logprobs)
    return sse({**head, "choices": [part]})


def _whole_choice(parsed: OpenAIRequest, chunks: list[RequestOutput], echo: str, index: int = 0,
                  tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """A non-streamed choice: all of one generation's chunks joined."""
    text = echo + "".join(c.new_text for c in chunks)
    token_ids = [t for c in chunks for t in c.new_token_ids]
    logprobs = logprobs_payload(parsed, [lp for c in chunks for lp in c.new_logprobs], tokenizer, len(echo))
    return choice(parsed, text, chunks[-1].finish_reason, token_ids, index=index, logprobs=logprobs)


def choice_inputs(req: GenerateInput, n: int) -> list[GenerateInput]:
    """The n sub-requests of an `n` > 1 request: ids `{id}-{i}` and, with a seed, seeds `seed + i`
    (the choices differ, yet the response is reproducible, and choice i is what an `n` = 1 request
    with seed `seed + i` returns). A 400 names `request_id` or `seed` if a suffix leaves its range."""
    suffix = len(f"-{n - 1}")
    if len(req.request_id) + suffix > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            "request_id", f"must be at most {MAX_REQUEST_ID_CHARS - suffix} characters with n={n} (each choice's "
                          f"id gets a -<index> suffix), got {len(req.request_id)}")  # fmt: skip
    seed = req.params.seed
    if seed is not None and seed > MAX_SEED - (n - 1):
        raise InvalidRequestError(
            "seed", f"must be at most {MAX_SEED - (n - 1)} with n={n} (choice i samples with seed + i), got {seed}"
        )
    return [
        replace(req, request_id=f"{req.request_id}-{i}",
                params=req.params if seed is None else replace(req.params, seed=seed + i))
        for i in range(n)
    ]  # fmt: skip


async def _pump(dp: DataPlane, index: int, req: GenerateInput, queue: asyncio.Queue[tuple[int, Any]]) -> None:
    """Relay one choice's chunks into the shared queue, then None (its end) or the exception that
    ended it. Cancelling this task closes the generation, so its worker aborts it at once."""
    try:
        async with contextlib.aclosing(dp.generate(req)) as stream:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
    except Exception as exc:
        queue.put_nowait((index, exc))
    else:
        queue.put_nowait((index, None))


async def fan_out(dp: DataPlane, inputs: list[GenerateInput]) -> AsyncGenerator[ChoiceChunk, None]:
    """(index, chunk) of all `inputs`' generations, run concurrently, as the chunks arrive.

    The first failure is raised. However this generator ends — drained, failed, closed or cancelled
    (a client that went away) — every generation still running is cancelled and awaited, so no
    worker keeps decoding (or holding KV blocks for) a choice nobody will read."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(dp, i, req, queue)) for i, req in enumerate(inputs)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect_choices(chunks: AsyncGenerator[ChoiceChunk, None], n: int) -> list[list[RequestOutput]]:
    """Every choice's chunks, by index; a choice its replica failed fails them all at once."""
    out: list[list[RequestOutput]] = [[] for _ in range(n)]
    async with contextlib.aclosing(chunks):
        async for index, chunk in chunks:
            if chunk.finish_reason == FinishReason.ERROR:
                raise replica_failed(chunk)
            out[index].append(chunk)
    if not all(out):  # the data plane ends each generation with a finished chunk or raises
        raise ReplicaUnavailable("a replica ended a choice's stream without output")
    return out


def replica_failed(chunk: RequestOutput) -> ReplicaUnavailable:
    """The error for a chunk whose replica failed its request (FinishReason.ERROR)."""
    return ReplicaUnavailable(f"replica {chunk.replica} failed the request: {chunk.error}")


def total_usage(lasts: list[RequestOutput]) -> dict[str, Any]:
    """`usage` of an `n` > 1 response: the prompt once, the completion tokens of every choice, and as
    cached the prompt tokens every choice found cached (the least: the choices run concurrently, and
    one may reuse blocks another just computed for the same prompt)."""
    return usage(max(c.num_prompt_tokens for c in lasts), sum(c.num_output_tokens for c in lasts),
                 min(c.num_cached_tokens for c in lasts))


def choices_headers(request_id: str, chunks: list[RequestOutput]) -> dict[str, str]:
    """`response_headers` for `n` > 1: the request's own id and every replica seen, in choice order."""
    return {"X-Request-Id": request_id, "X-Chariot-Replica": ",".join(dict.fromkeys(c.replica for c in chunks))}


async def _http_error(request: Request, exc: Exception) -> Response:
    """404/405 and friends as OpenAI-style JSON errors; anything else is a 500 whose traceback is logged."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status >= 500:
        log.error("request %s: %s %s failed", request.headers.get("x-request-id", "-"), request.method,
                  request.url.path, exc_info=exc)
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": f"{request.method} {request.url.path}: {detail}", "type": kind, "param": None,
                      "code": str(status)}}  # fmt: skip
    headers = getattr(exc, "headers", None)
    return JSONResponse(body, status_code=status, headers=headers)


def principal_of(request: Request) -> Principal | None:
    """The API key's `Principal` that `RequireApiKey` found for this request (None: no keys configured)."""
    principal = request.scope.get(PRINCIPAL_SCOPE_KEY)
    return principal if isinstance(principal, Principal) else None


def may_use(request: Request, model: str) -> bool:
    """Whether the request's API key (if any) may use `model` (`/v1/models` lists only those)."""
    principal = principal_of(request)
    return principal is None or ANY_MODEL in principal.models or model in principal.models


class RequireApiKey:
    """ASGI middleware: with API keys configured, a request to any path but `OPEN_PATHS` needs a known
    `Authorization: Bearer <key>` (else 401, OpenAI-style); its `Principal` goes into the scope."""

    def __init__(self, app: Any, dataplane: DataPlane) -> None:
        self._app = app
        self._dp = dataplane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self._dp.keys
        if keys is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        try:
            scope[PRINCIPAL_SCOPE_KEY] = keys.authenticate(authorization_header(scope))
        except AuthenticationError as exc:
            self._dp.reject(exc)
            await error_response(exc)(scope, receive, send)
            return
        await self._app(scope, receive, send)


def authorization_header(scope: Scope) -> str | None:
    """The first `Authorization` header of an ASGI scope (decoded as Latin-1, as HTTP/1.1 allows)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            return bytes(value).decode("latin-1")
    return None


def build_http_app(dataplane: DataPlane) -> Any:
    """The ASGI application of the HTTP front (behind `RequireApiKey` when the router has API keys)."""
    front = OpenAIFront(dataplane)
    routes = [
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat_completions, methods=["POST"]),
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", front.model, methods=["GET"]),
        Route("/health", front.health, methods=["GET"]),
        Route("/health/live", front.live, methods=["GET"]),
        Route("/metrics", front.metrics, methods=["GET"]),
        Route("/load", front.load, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _http_error})
    return RequireApiKey(app, dataplane) if dataplane.keys is not None else app
