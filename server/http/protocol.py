"""The HTTP connection layer of `batchsim serve` (aiohttp): a runner whose connections time out
when a client never completes a request head, and whose answers to malformed HTTP (a bad request
line, headers or chunk framing, which aiohttp refuses before any route or middleware sees them)
carry the OpenAI error body like every other 4xx."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web, web_protocol
from batchsim.server.http.fields import error_body


class _Handler(web_protocol.RequestHandler):
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # a bug past the middleware; its message is aiohttp's generic one
            super().handle_error(request, status, exc, message)  # logs it; refuses if sent
            body = error_body("internal error", "server_error")
        else:  # the client's malformed HTTP: its 4xx says so, the log no traceback (aiohttp's)
            if request.writer.output_size > 0:
                raise ConnectionError("a response was sent already: no room for an error")
            text = getattr(exc, "message", None) or message or "malformed HTTP request"
            body = error_body(f"malformed HTTP request: {text}", "invalid_request_error")
        response = web.Response(status=status, text=json.dumps(body),
                                content_type="application/json")
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """An AppRunner whose connections are `_Handler`s. `header_timeout_s` is aiohttp's keep-alive
    timer, which runs from a connection's start and from each response until a complete request
    head arrives (data does not reset it): it closes stalled, trickling and idle connections."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any):
        super().__init__(app, keepalive_timeout=header_timeout_s, **kwargs)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _Server(plain.request_handler, request_factory=plain.request_factory,
                       handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                       **plain._kwargs)
