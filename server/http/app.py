"""`batchsim serve`: an OpenAI-compatible HTTP server (aiohttp) on the continuous-batching engine.

Every request becomes a scheduler Request on the same engine as `batchsim run`, so concurrent HTTP
requests decode together in one forward pass. The engine loop runs as a task on the server's event
loop and the executor computes in its own thread, so the loop keeps answering while a step runs.
A client that goes away has its request aborted; its KV is freed at the next step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import itertools
import json
import time
import traceback
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_urldispatcher import _default_expect_handler
from batchsim.configs import ConfigError
from batchsim.scheduler.request import Request, RequestStatus
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.engine.engine import Engine
from batchsim.server.executors.base import Executor
from batchsim.server.http import openai_api as api
from batchsim.server.http.fields import APIError, error_body
from batchsim.server.http.openai_api import GenerationParams
from batchsim.server.http.options import ServeOptions
from batchsim.server.http.prometheus import CONTENT_TYPE, ServerRecorder, mlx_memory_gauges, render
from batchsim.server.http.protocol import Runner
from batchsim.server.http.text_stream import Generation
from batchsim.server.models.tokenizer import special_token_ids
from batchsim.server.platform.signals import leave_closed_terminal, not_ignored

_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error",
                429: "rate_limit_error", 503: "server_error"}
_POST_PATHS = ("/v1/completions", "/v1/chat/completions")
_STREAM_RESPONSE = "batchsim.stream_response"  # a prepared stream, kept on its aiohttp request
_BROKEN_BODY = "batchsim.broken_body"  # the body stalled or broke: the connection cannot go on


class Server:
    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Any,
                 options: ServeOptions):
        if executor.caps.virtual_time:
            raise ValueError("a server answers in real time; this executor keeps virtual time")
        self.recorder = ServerRecorder()  # bounded: a server must not keep every request and step
        # A failed step fails the requests it touched; the server keeps serving the rest.
        self.engine = Engine(scheduler, executor, recorder=self.recorder, on_error="abort")
        self.tokenizer = tokenizer
        self.options = options
        self.eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", None) or ())
        # Read once, not per request (a tokenizer's all_special_ids is worked out on each read)
        self.reserved_names = api.template_reserved_names(tokenizer)
        self.special_ids = special_token_ids(tokenizer)  # None: skip_special_tokens refused
        self.inflight: set[int] = set()
        self.draining = False
        self._hurry = False  # a second signal: abort now instead of waiting out the drain
        self.created = int(time.time())  # the model card's; responses carry their own time
        self._ids = itertools.count(1)
        # Bodies are parsed and prompts tokenized here, one at a time (a tokenizer is not safe to
        # share between threads), so a large prompt never holds up the event loop.
        self.parser_thread = concurrent.futures.ThreadPoolExecutor(1, "tokenize")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.options.max_body_bytes,
                              middlewares=[self._middleware])
        routes = {"/health": self.health, "/metrics": self.metrics, "/v1/models": self.models,
                  "/v1/models/{model_id:.+}": self.model, "/v1/completions": self.completions,
                  "/v1/chat/completions": self.chat_completions}
        for path, handler in routes.items():
            add = app.router.add_post if path in _POST_PATHS else app.router.add_get
            add(path, handler, expect_handler=self._expect)
        # Everything else is a 404 or 405 raised here, so its Expect header is checked too.
        app.router.add_route("*", "/{tail:.*}", self._unrouted, expect_handler=self._expect)
        return app

    # -- plumbing ------------------------------------------------------------------------------
    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` as aiohttp answers it; any other value is a 417 (aiohttp's own
        417 is plain text and runs before the middleware)."""
        try:
            return await _default_expect_handler(request)
        except web.HTTPExpectationFailed:
            expect = request.headers.get("Expect", "")[:80]
            response = _error_response(APIError(417, f"unsupported Expect header {expect!r}"))
            self.recorder.http_responses[417] += 1
            return response

    async def _unrouted(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        allowed = ["POST"] if path in _POST_PATHS else ["GET", "HEAD"] if (
            path in ("/health", "/metrics", "/v1/models") or path.startswith("/v1/models/")
        ) else []
        if allowed and request.method not in allowed:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        raise web.HTTPNotFound()  # e.g. GET /v1/models/ (no id)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/"):
                self._authorize(request)
            response = await handler(request)
        except (asyncio.CancelledError, ConnectionError):
            stream = request.get(_STREAM_RESPONSE)
            if stream is not None:  # the client left mid-stream: its status was sent, count it
                self.recorder.http_responses[stream.status] += 1
            else:  # no answer sent: the client left mid-body or while its request ran
                self.recorder.client_disconnects += 1
            raise
        except APIError as exc:
            response = _error_response(exc)
        except web.HTTPException as exc:  # unknown route, wrong method, body too large
            response = _error_response(APIError(
                exc.status, exc.reason if exc.status != 413 else
                f"request body exceeds {self.options.max_body_bytes} bytes",
                type=_ERROR_TYPES.get(exc.status, "invalid_request_error"),
                code="request_too_large" if exc.status == 413 else None,
                headers={"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None))
        except Exception as exc:  # noqa: BLE001 - a bug: answer this request, serve the others
            traceback.print_exc()
            response = _error_response(APIError(500, f"internal error: {exc!r}",
                                                type="server_error"))
        if request.get(_BROKEN_BODY) or not request.content.is_eof():
            response.force_close()  # a body left unread or broken: no client may reuse this one
        self.recorder.http_responses[response.status] += 1
        return response

    def _authorize(self, request: web.Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")

    async def _read_body(self, request: web.Request) -> bytes:
        if (request.content_length or 0) > self.options.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(self.options.max_body_bytes,
                                                request.content_length or 0)
        timeout_s = self.options.body_timeout_s
        try:
            return await asyncio.wait_for(request.read(), timeout_s)
        except ConnectionResetError:  # the client left mid-body: nobody to answer (aiohttp
            raise asyncio.CancelledError from None  # logs any other exception as a 500)
        except (TimeoutError, HttpProcessingError, web.RequestPayloadError) as exc:
            request[_BROKEN_BODY] = True
            request.content.feed_eof()  # aiohttp would read the rest after answering: don't
            if isinstance(exc, TimeoutError):
                raise APIError(408, f"request body not received within {timeout_s:g} s",
                               code="request_timeout") from None
            # Broken chunk framing, a body cut short, gzip over plain bytes ...
            raise APIError(400, f"malformed request body: {exc}") from None

    def _parse(self, raw: bytes, kind: api.Kind) -> api.GenerationParams:
        """On the parser thread: JSON, fields and the tokenized prompt."""
        body = api.parse_json_object(raw)
        api.check_model(body, self.options.served_model_name)
        params = api.parse_generation(body, kind, self.tokenizer, self.options.vocab_size,
                                      self.options.prompt_bytes_limit, self.reserved_names)
        if params.skip_special_tokens and self.special_ids is None:
            raise APIError(400, "skip_special_tokens: this model's tokenizer does not name its "
                           "special tokens (no all_special_ids); send false or leave it out",
                           param="skip_special_tokens")
        return params

    # -- routes --------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        status = "draining" if self.draining else "ok"
        return web.json_response({"status": status}, status=503 if self.draining else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        text = render(self.recorder, self.engine.scheduler,
                      kv_budget_bytes=self.options.kv_budget_bytes,
                      memory_budget_bytes=self.options.memory_budget_bytes,
                      max_queue=self.options.max_queue, inflight=len(self.inflight),
                      extra_gauges=mlx_memory_gauges())
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    def _card(self) -> dict[str, Any]:
        return {"id": self.options.served_model_name, "object": "model", "created": self.created,
                "owned_by": "batchsim", "max_model_len": self.options.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.options.served_model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                           f"{self.options.served_model_name!r}", param="model",
                           code="model_not_found")
        return web.json_response(self._card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, http: web.Request, kind: api.Kind) -> web.StreamResponse:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="shutting_down", headers={"Retry-After": "5"})
        raw = await self._read_body(http)
        loop = asyncio.get_running_loop()
        params = await loop.run_in_executor(self.parser_thread, self._parse, raw, kind)
        request = self._admit(params)
        gen = Generation(self.engine, request, params, self.tokenizer,
                         self.special_ids or frozenset())
        rid = request.request_id
        self.inflight.add(rid)
        try:
            if params.stream:
                return await self._stream(http, gen, params)
            return await self._complete(gen, params)
        except (asyncio.CancelledError, ConnectionError):
            if not gen.done:  # its client left mid-request (the finally aborts it)
                self.recorder.client_gone += 1
            raise
        finally:
            self.inflight.discard(rid)
            if not gen.done:  # the client went away (or the handler failed): stop computing
                self.engine.abort(rid)
            ok = gen.done and request.status is RequestStatus.FINISHED  # as the scheduler ended it
            self.recorder.request_outcomes["finished" if ok else "aborted"] += 1
            if not ok:  # its tokens so far: generated, and nobody will read the rest
                self.recorder.aborted_generation_tokens += request.num_output_tokens

    def _admit(self, params: GenerationParams) -> Request:
        """A scheduler Request for these params, or an APIError: 400 if it can never run, 429 if
        the waiting queue is full."""
        n_prompt = len(params.prompt_ids)
        room = self.options.max_model_len - n_prompt
        max_tokens = params.max_tokens or max(1, min(api.DEFAULT_MAX_TOKENS[params.kind], room))
        sampling = dataclasses.replace(params.sampling, max_tokens=max_tokens)
        request = Request(next(self._ids), n_prompt, sampling, self.engine.now(),
                          list(params.prompt_ids), self.eos_ids)
        reason = self.engine.scheduler.rejection_reason(request)
        if reason is not None:
            self.recorder.request_outcomes["rejected"] += 1
            too_long = request.max_total_tokens > self.options.max_model_len
            prompt_param = "messages" if params.kind == "chat" else "prompt"
            blame = params.max_tokens_param if params.max_tokens and room >= 1 else prompt_param
            raise APIError(400, f"this request can never run: {reason}", param=blame,
                           code="context_length_exceeded" if too_long else "kv_budget_exceeded")
        if len(self.engine.scheduler.waiting) >= self.options.max_queue:
            raise APIError(429, f"the waiting queue is full ({self.options.max_queue} requests); "
                           "retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        return request

    async def _complete(self, gen: Generation, params: GenerationParams) -> web.Response:
        parts = []
        while not gen.done:
            parts.append(await gen.next())
        body = api.full_response(params.kind, api.new_response_id(params.kind), int(time.time()),
                                 self.options.served_model_name, "".join(parts),
                                 gen.finish_reason, _usage(gen, params))
        return web.json_response(body)

    async def _stream(self, http: web.Request, gen: Generation,
                      params: GenerationParams) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(http)
        http[_STREAM_RESPONSE] = response
        try:
            await self._stream_chunks(response, gen, params)
        except ConnectionError:
            raise  # the client went away: nothing to tell it
        except Exception as exc:  # noqa: BLE001 - a bug mid-stream: said in the stream
            traceback.print_exc()
            await response.write(_sse(error_body(f"internal error: {exc!r}", "server_error")))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_chunks(self, response: web.StreamResponse, gen: Generation,
                             params: GenerationParams) -> None:
        kind, model = params.kind, self.options.served_model_name
        rid, created = api.new_response_id(kind), int(time.time())  # one for every chunk
        first = True
        while not gen.done:
            text = await gen.next()  # a step's text; empty while a character is incomplete
            if not text and not gen.done:
                continue  # no empty deltas: the text waits for the next token (as mlx_lm.server)
            counts = _usage(gen, params)
            chunk = api.stream_chunk(kind, rid, created, model, text,
                                     gen.finish_reason if gen.done else None, first=first,
                                     include_usage=params.include_usage,
                                     usage_counts=counts if params.continuous_usage else None)
            await response.write(_sse(chunk))
            first = False
        if params.include_usage:
            counts = _usage(gen, params)
            await response.write(_sse(api.usage_chunk(kind, rid, created, model, counts)))

    # -- shutdown ------------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, give in-flight ones `timeout_s` to finish, abort the rest and let
        their handlers answer. Returns how many were aborted."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.inflight and loop.time() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        aborted = list(self.inflight)
        for rid in aborted:
            self.engine.abort(rid)
        deadline = loop.time() + 2.0
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return len(aborted)

    def on_signal(self, stop: asyncio.Event, signum: int = 0) -> None:
        """The first SIGINT/SIGTERM/SIGHUP drains; another one cuts the drain short."""
        leave_closed_terminal(signum)
        if stop.is_set():
            self._hurry = True
        stop.set()


def _usage(gen: Generation, params: GenerationParams) -> dict:
    return api.usage(len(params.prompt_ids), gen.num_tokens, gen.request.num_cached_tokens)


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _error_response(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


async def serve(server: Server, host: str, port: int, announce: Callable[[str], None],
                stop: asyncio.Event | None = None) -> dict:
    """Run until SIGINT/SIGTERM/SIGHUP (or the engine fails), then drain and stop. Returns totals.
    `stop`: an event that stops it instead of signals (a server in a test's event loop)."""
    loop = asyncio.get_running_loop()
    signals = not_ignored() if stop is None else ()  # nohup's SIGHUP stays ignored
    stop = stop or asyncio.Event()
    engine = server.engine
    engine.start_clock()
    engine_task = asyncio.create_task(engine.run())
    options = server.options
    # lingering_time: how long an unread body is drained after the response (a stalled one too).
    runner = Runner(server.app(), header_timeout_s=options.header_timeout_s,
                    lingering_time=options.body_timeout_s, handle_signals=False,
                    handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    aborted = 0
    try:
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:  # port taken, address not local: the user's to fix
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        bound_host, bound_port = runner.addresses[0][:2]
        announce(f"http://{_url_host(bound_host)}:{bound_port}")
        for sig in signals:
            loop.add_signal_handler(sig, server.on_signal, stop, sig)
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait({stop_task, engine_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
        if not engine_task.done():
            aborted = await server.drain(options.drain_timeout_s)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        server.parser_thread.shutdown(wait=False)
        engine.stop()
        await engine_task  # re-raises if the engine failed
        engine.close()
    rec = server.recorder
    return {"requests": dict(rec.request_outcomes), "aborted_at_shutdown": aborted,
            "http_responses": {str(k): v for k, v in sorted(rec.http_responses.items())},
            "generation_tokens": rec.generation_tokens, "steps": rec.num_steps,
            "client_gone": rec.client_gone,
            "aborted_generation_tokens": rec.aborted_generation_tokens,
            "max_batch_size": rec.max_batch_size}


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
