"""The ASGI app: OpenAI routes over a DecoderPool.

    POST /v1/chat/completions   messages with text, image_url and video_url parts; stream with SSE
    POST /v1/completions        a text prompt (or token ids), or a list of them
    GET  /v1/models             the served model and its LoRA adapters
    GET  /v1/models/{id}        one of them (404 in OpenAI's shape for any other id)
    GET  /health                200 when a decoder is SERVING, else 503
    GET  /metrics               Prometheus
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.pb import decoder_pb2
from gateway.admission import admit_chat, admit_completion, check_salt, read_json
from gateway.balancer import DecoderPool
from gateway.byte_budget import ByteBudget, GatewayBytes
from gateway.choices import Choices
from gateway.config import GatewayConfig
from gateway.decoder_retry import DecoderAttempts
from gateway.errors import APIError, bad_request, from_rpc_error, quoted
from gateway.images import ImageFetcher
from gateway.media_memo import MediaMemo
from gateway.metrics import GatewayMetrics
from gateway.model_info import ServedModel, max_model_len, model_root, takes_video
from gateway.responses import (
    FINISH_REASONS,
    CompletionLogprobs,
    ResponseHeader,
    RunningUsage,
    TokenTexts,
    chat_choice,
    chat_chunk,
    chat_completion,
    chat_logprobs,
    completion,
    completion_choice,
    summed_usage,
    usage_chunk,
)
from gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from gateway.sse import SSEResponse, sse_event
from gateway.system_media import explained
from gateway.translate import DecoderCalls, chat_request, completion_calls

log = logging.getLogger("mmserve.gateway")
T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; it never reaches that client


class ClientDisconnected(Exception):
    """The HTTP client went away while the gateway was waiting on its behalf."""


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work, cancelling it (and so any gRPC call it has open) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class Gateway:
    """The handlers, and what they share: decoders, image fetcher, metrics, tokenizer."""

    def __init__(self, config: GatewayConfig, pool: DecoderPool | None = None) -> None:
        self.config = config
        self.pool = pool or DecoderPool.of(config.decoders, config.decoder_check_interval_s,
                                           security=config.upstream, routing=config.routing)
        self.metrics = GatewayMetrics()
        self.pool.on_failover = self.metrics.decoder_retries.labels("failover").inc
        self.fetcher = ImageFetcher(config.images)
        self.bytes_in_flight = GatewayBytes(config.images.max_bytes_in_flight)
        self.named_media = MediaMemo(config.images.max_named_media_bytes,  # vLLM's uuid, per tenant
                                     config.images.max_named_media_tenants)
        self.adapters = config.lora_adapters
        self.texts = TokenTexts(config.model)
        self.created = int(time.time())
        self.served = ServedModel(tuple(config.served_model_names), model_root(config.model),
                                  max_model_len(config.model), takes_video(config.model))

    # --- plumbing ---------------------------------------------------------------------------------

    def authorize(self, request: Request) -> str | None:
        """The caller's API key (None when the gateway has none); 401 for a missing or wrong one."""
        if not self.config.api_keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "missing API key: send `Authorization: Bearer KEY`", code="invalid_api_key")
        # Compare with every key in constant time: no early exit that times which one matched.
        matches = [hmac.compare_digest(key.encode(), k.encode()) for k in self.config.api_keys]
        if not any(matches):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return key

    def tenant(self, api_key: str | None) -> str:
        """The tenant of an API key ("" without --api-key: every client is one tenant)."""
        return self.config.tenant_of(api_key) if api_key is not None else ""

    def cache_salt(self, request: Request, api_key: str | None, body_salt: str | None) -> str:
        """The decoder's cache_salt: the tenant of the API key, then the X-Cache-Salt header (or the body's
        `cache_salt`). A header can split a tenant's cache further but never reach another tenant's."""
        given = request.headers.get(self.config.cache_salt_header) or body_salt or ""
        check_salt(given, self.config)
        if api_key is None:
            return given
        tenant = self.config.tenant_of(api_key)
        return f"{tenant}/{given}" if given else tenant

    def check_model(self, model: str | None) -> None:
        """404 for a model this gateway does not serve; no model at all means the served one (vLLM). A
        LoRA adapter's name (--lora-modules) is a served model too."""
        if model is not None and model not in self.config.served_model_names and model not in self.adapters:
            raise self.no_such_model(model)

    def no_such_model(self, model: str) -> APIError:
        """OpenAI's 404 for a model this gateway does not serve (the name cut to a bounded length)."""
        names = ", ".join(repr(n) for n in [*self.config.served_model_names, *self.adapters])
        return APIError(404, f"the model {quoted(model)} does not exist; this server serves {names}",
                        param="model", code="model_not_found")

    def adapter_of(self, model: str | None) -> str:
        """The decoder's lora_adapter for a request's `model`: the adapter it names, else "" (the base)."""
        return model if model is not None and model in self.adapters else ""

    def model_name(self, model: str | None) -> str:
        """The name a response carries: the adapter the request named (as vLLM answers), else the first
        served name."""
        return self.adapter_of(model) or self.config.served_model_name

    def error_response(self, endpoint: str, error: APIError) -> JSONResponse:
        self._count(endpoint, error.status, error.code)
        if error.status >= 500:
            log.warning("%s: %d %s", endpoint, error.status, error.message)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    def _count(self, endpoint: str, status: int, code: str | None = None) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.metrics.errors.labels(str(status), code or "none").inc()

    async def _start(self, request: Request, endpoint: str, schema: type, translate) -> tuple:
        """Authorize, parse, admit, translate and start the Generate calls, one per prompt, each for `n`
        samples: (parsed request, its Choices). Every count and size is checked (admission.py) before any
        image is fetched; images are fetched once for all choices."""
        api_key = self.authorize(request)
        body = await read_json(request, self.config.limits, self.config.http.body_timeout_s)
        req = parse_body(schema, body)
        del body
        self.check_model(req.model)
        (admit_chat if schema is ChatCompletionRequest else admit_completion)(req, self.config)
        salt = self.cache_salt(request, api_key, req.cache_salt)
        # Each choice's call carries the request's images: count them n times, and hold them against the
        # gateway-wide budget until the request ends (GenerationGroup.cancel).
        budget = ByteBudget(self.config.images.max_total_image_bytes, self.bytes_in_flight)
        try:
            calls: DecoderCalls = await cancel_on_disconnect(
                request, translate(req, salt, budget, self.tenant(api_key)))
            attempts = DecoderAttempts(self.pool, calls.choices(req.n, self.adapter_of(req.model)),
                                       calls.request_id, req.user or "", self.config.request_timeout_s,
                                       self.config.decoder_retries, on_retry=self._count_restart)
            try:
                group = await cancel_on_disconnect(request, attempts.start())
            except grpc.aio.AioRpcError as exc:
                raise explained(req, exc) or exc from None
        except BaseException:
            budget.release()
            raise
        return req, Choices(group, req.n, attempts, on_end=budget.release)

    def _count_restart(self) -> None:
        self.metrics.decoder_retries.labels("restart").inc()

    async def _handle(self, request: Request, endpoint: str, schema: type, translate, respond) -> Response:
        started = time.perf_counter()
        try:
            req, generation = await self._start(request, endpoint, schema, translate)
            try:
                return await respond(request, req, generation, started)
            except BaseException:  # no response will end the calls: end them (and free the bytes) now
                generation.cancel()
                raise
        except APIError as exc:
            return self.error_response(endpoint, exc)
        except grpc.aio.AioRpcError as exc:
            return self.error_response(endpoint, from_rpc_error(exc))
        except ClientDisconnected:
            self.metrics.disconnects.inc()
            self._count(endpoint, CLIENT_CLOSED_REQUEST)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except UnicodeEncodeError:  # a lone surrogate in a field admission does not look at
            return self.error_response(endpoint, bad_request(
                "the request contains a lone UTF-16 surrogate, which is not valid Unicode",
                code="invalid_value"))
        except Exception:  # a bug: still an OpenAI-shaped 500, counted, with the details in the log only
            log.exception("%s: unexpected error", endpoint)
            return self.error_response(endpoint, APIError(500, "internal error in the gateway",
                                                          code="internal_error"))

    async def _chunks(self, generation: Choices, endpoint: str, started: float, per_prompt: int
                      ) -> AsyncIterator[tuple[int, decoder_pb2.GenerateResponse]]:
        """The decoders' messages as (choice index, message), observing TTFT (first token of any
        choice), E2E (last choice's end) and token counts (each prompt once: per_prompt choices each) on
        the way."""
        open_choices = generation.num
        async for index, chunk in generation:
            if not generation.first_token_seen and chunk.token_ids:
                generation.first_token_seen = True
                self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - started)
            if chunk.finish_reason:
                if index not in generation.usage_seen:  # once, should the request start again elsewhere
                    generation.usage_seen.add(index)
                    u = chunk.usage
                    lead = index % per_prompt == 0
                    self.metrics.observe_usage(u.prompt_tokens if lead else 0,
                                               u.cached_prompt_tokens if lead else 0, u.completion_tokens)
                open_choices -= 1
                if not open_choices:
                    self.metrics.e2e.labels(endpoint).observe(time.perf_counter() - started)
            yield index, chunk

    def _stream(self, endpoint: str, generation: Choices, events: AsyncIterator[dict]
                ) -> SSEResponse:
        """An SSE response of events, then `data: [DONE]`; a decoder error mid-stream becomes an error
        event (the status line has gone out already); a client that leaves cancels the call."""
        async def body() -> AsyncIterator[str]:
            status, code, done = 200, None, False
            try:
                async for event in events:
                    yield sse_event(event)
                done = True
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc)
                status, code, done = error.status, error.code, True
                yield sse_event(error.body())
            except Exception:  # a bug mid-stream: an error event, and the stream still ends with [DONE]
                log.exception("%s: unexpected error in a stream", endpoint)
                error = APIError(500, "internal error in the gateway", code="internal_error")
                status, code, done = error.status, error.code, True
                yield sse_event(error.body())
            finally:
                generation.cancel()
                if done:
                    self._count(endpoint, status, code)
                else:  # cancelled: the client went away
                    self.metrics.disconnects.inc()
                    self._count(endpoint, CLIENT_CLOSED_REQUEST)
            yield sse_event("[DONE]")

        return SSEResponse(body(), on_close=generation.cancel)

    # --- routes -----------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        async def translate(req, salt, budget, tenant) -> DecoderCalls:
            out = await chat_request(req, self.fetcher, salt, self.served.takes_video, budget,
                                     self.named_media.of(tenant))
            return DecoderCalls(out.request_id, [out])

        return await self._handle(request, "chat", ChatCompletionRequest, translate, self._chat_response)

    @staticmethod
    def _running_usage(req, generation: Choices) -> RunningUsage | None:
        """Usage so far for continuous_usage_stats (None without it), the prompt's counts taken from the
        decoders' first messages, so that every chunk has them, the role chunks included (vLLM)."""
        if not req.continuous_usage:
            return None
        running = RunningUsage()
        running.prime(generation.firsts, 1)  # one call per prompt
        return running

    async def _whole(self, request: Request, endpoint: str, generation: Choices, collect
                     ) -> Response:
        """A whole (not streamed) response: collect() awaited, the calls cancelled if the client leaves.
        Nothing is sent before collect() returns: a decoder that went away meanwhile is replaced and the
        calls start over (Choices.restart), collect() with them."""
        try:
            while True:
                try:
                    body = await cancel_on_disconnect(request, collect())
                    break
                except grpc.aio.AioRpcError as exc:
                    if not await cancel_on_disconnect(request, generation.restart(exc)):
                        raise exc from None
        finally:
            generation.cancel()  # already ended unless the client left: free the decoder's blocks now
        self._count(endpoint, 200)
        return JSONResponse(body)

    async def _chat_response(self, request: Request, req: ChatCompletionRequest, generation: Choices,
                             started: float) -> Response:
        head = ResponseHeader(generation.request_id, self.model_name(req.model))
        top_n, n = req.top_logprobs or 0, generation.num
        if req.stream:
            async def events() -> AsyncIterator[dict]:
                include = req.include_usage
                running = self._running_usage(req, generation)
                finals: list = [None] * n
                for index in range(n):  # every choice's role first, as vLLM sends them
                    yield chat_chunk(head, {"role": "assistant", "content": ""}, include_usage=include,
                                     usage=running.body() if running else None, index=index)
                # One event per decoder message, so one token per event: the decoder sends one engine
                # step per message (decoder_svc/stream.py). A token whose text is held back (part of a
                # UTF-8 character, or a possible stop string) has no event of its own; its text comes
                # with a later token's, as in vLLM. The last message's text comes with the finish reason,
                # in one chunk, as vLLM sends it.
                async for index, chunk in self._chunks(generation, "chat", started, n):
                    logprobs = chat_logprobs(chunk, top_n, self.texts) if req.logprobs else None
                    so_far = running.add(chunk) if running else None
                    if chunk.finish_reason:
                        finals[index] = chunk.usage
                        finish = FINISH_REASONS.get(chunk.finish_reason)
                        yield chat_chunk(head, {"content": chunk.text}, finish, logprobs=logprobs,
                                         include_usage=include, usage=so_far, index=index)
                    elif chunk.text or logprobs or (so_far and chunk.token_ids):
                        yield chat_chunk(head, {"content": chunk.text}, logprobs=logprobs,
                                         include_usage=include, usage=so_far, index=index)
                if include:
                    yield usage_chunk(head, "chat.completion.chunk", summed_usage(finals))

            return self._stream("chat", generation, events())

        async def collect() -> dict:
            texts: list[list[str]] = [[] for _ in range(n)]
            logprobs: list[list[dict]] = [[] for _ in range(n)]
            finish: list[str | None] = [None] * n
            finals: list = [None] * n
            async for index, chunk in self._chunks(generation, "chat", started, n):
                texts[index].append(chunk.text)
                if req.logprobs:
                    logprobs[index].extend(chat_logprobs(chunk, top_n, self.texts))
                if chunk.finish_reason:
                    finish[index], finals[index] = FINISH_REASONS.get(chunk.finish_reason), chunk.usage
            choices = [chat_choice(i, "".join(texts[i]), finish[i], logprobs[i] if req.logprobs else None)
                       for i in range(n)]
            return chat_completion(head, choices, summed_usage(finals))

        return await self._whole(request, "chat", generation, collect)

    async def completions(self, request: Request) -> Response:
        async def translate(req, salt, budget, tenant) -> DecoderCalls:
            return completion_calls(req, salt)

        return await self._handle(request, "completions", CompletionRequest, translate,
                                  self._completion_response)

    async def _completion_response(self, request: Request, req: CompletionRequest,
                                   generation: Choices, started: float) -> Response:
        head = ResponseHeader(generation.request_id, self.model_name(req.model))
        n = generation.num

        def fresh_logprobs() -> list[CompletionLogprobs] | None:
            return [CompletionLogprobs(req.logprobs, self.texts) for _ in range(n)] \
                if req.logprobs is not None else None

        if req.stream:
            async def events() -> AsyncIterator[dict]:
                include = req.include_usage
                running = self._running_usage(req, generation)
                finals: list = [None] * n
                logprobs = fresh_logprobs()
                # one token per event, the last text with the finish
                async for index, chunk in self._chunks(generation, "completions", started, req.n):
                    part = logprobs[index].add(chunk) if logprobs is not None else None
                    so_far = running.add(chunk, index // req.n) if running else None
                    finish = FINISH_REASONS.get(chunk.finish_reason) if chunk.finish_reason else None
                    if finish is not None:
                        finals[index] = chunk.usage
                    if finish is not None or chunk.text or part or (so_far and chunk.token_ids):
                        yield completion(head, [completion_choice(index, chunk.text, finish, part)], so_far,
                                         stream=True, include_usage=include)
                if include:
                    yield usage_chunk(head, "text_completion", summed_usage(finals, req.n))

            return self._stream("completions", generation, events())

        async def collect() -> dict:
            texts: list[list[str]] = [[] for _ in range(n)]
            finish: list[str | None] = [None] * n
            finals: list = [None] * n
            logprobs = fresh_logprobs()  # each attempt from nothing
            async for index, chunk in self._chunks(generation, "completions", started, req.n):
                texts[index].append(chunk.text)
                if logprobs is not None:
                    logprobs[index].add(chunk)
                if chunk.finish_reason:
                    finish[index], finals[index] = FINISH_REASONS.get(chunk.finish_reason), chunk.usage
            choices = [completion_choice(i, "".join(texts[i]), finish[i],
                                         logprobs[i].body if logprobs is not None else None)
                       for i in range(n)]
            return completion(head, choices, summed_usage(finals, req.n))

        return await self._whole(request, "completions", generation, collect)

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except APIError as exc:
            return self.error_response("models", exc)
        return JSONResponse({"object": "list", "data": self._cards()})

    def _cards(self) -> list[dict]:
        """/v1/models' entries: the served names, then the LoRA adapters."""
        adapters = [self.served.adapter_card(module, self.created) for module in self.adapters.values()]
        return [self.served.card(name, self.created) for name in self.served.names] + adapters

    async def model(self, request: Request) -> Response:
        """One /v1/models entry by its id (`client.models.retrieve`); 404 in OpenAI's shape otherwise."""
        try:
            self.authorize(request)
            model = request.path_params["model"]
            card = next((card for card in self._cards() if card["id"] == model), None)
            if card is None:
                raise self.no_such_model(model)
        except APIError as exc:
            return self.error_response("models", exc)
        return JSONResponse(card)

    async def health(self, request: Request) -> Response:
        """200 when at least one decoder reports SERVING (asked now, not from the last round). The
        decoders' addresses and states are listed only to a caller with an API key (or when the gateway
        has none); others get the bare status."""
        statuses = await self.pool.check_health()
        ok = any(s == "SERVING" for s in statuses.values())
        body: dict = {"status": "ok" if ok else "unavailable"}
        try:
            self.authorize(request)
            body["decoders"] = statuses
        except APIError:
            pass
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self, request: Request) -> Response:
        for endpoint in self.pool.endpoints:
            self.metrics.outstanding.labels(endpoint.address).set(endpoint.outstanding)
        self.metrics.media_bytes_held.set(self.bytes_in_flight.held)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- lifecycle --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        self.pool.start()
        try:
            yield
        finally:
            await self.fetcher.close()
            await self.pool.close()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route 404, wrong method 405) in OpenAI's JSON shape."""
    error = APIError(exc.status_code, f"{request.method} {quoted(request.url.path, 256)}: {exc.detail}",
                     code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


def build_app(config: GatewayConfig, pool: DecoderPool | None = None) -> Starlette:
    """The Starlette app for config (pool: decoders already connected, for tests)."""
    gateway = Gateway(config, pool)
    app = Starlette(routes=[
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.model, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ], lifespan=gateway.lifespan, exception_handlers={HTTPException: _http_error})
    app.state.gateway = gateway
    return app
