"""Every HTTP request's way in, before the app sees it (an ASGI middleware around the FastAPI app): a request id, the
API key, and the body read within a size and a time limit.

- **Request id**: ``req-<hex>`` per request, in ``scope["state"]["request_id"]`` (the app's ``request.state``) and in
  every response's ``X-Request-Id`` header. A 500 says it; the log line with the traceback carries it.
- **API key** (auth.py): without one of the accepted keys, a 401 with OpenAI's error body before a byte of the body
  is read; ``/health`` and ``/metrics`` are open.
- **Body**: a declared ``Content-Length`` above the limit is a 413 at once, nothing read; otherwise the body is read
  here, counted as it arrives (a chunked body declares no length) and refused with a 413 as soon as it passes the
  limit, or with a 408 when it has not all arrived within the body timeout. A client that goes away before sending
  all of it is dropped without a word in the log (there is nobody to answer). The app then gets the body whole.
  These refusals close the connection: uvicorn would otherwise read and discard the rest of the body, every byte
  restarting its keep-alive timer.
- **Access log**: one line per request once its response has ended (a stream's at its last event): the client,
  method and path, status, duration, prompt + generated tokens (what the app put in ``state["usage"]``) and the id.
- **Errors**: an exception the app raised (its handler has sent the 500 body by then) is logged here, once, with the
  request id and the traceback, instead of uvicorn's "Exception in ASGI application".

Written here because neither uvicorn nor Starlette bounds a request body, in size or in time (uvicorn's h11 limit
is on the headers; its only timeout is keep-alive, between requests).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import anyio

from toolchain.serve.auth import OPEN_PATHS, authorized

log = logging.getLogger("dstc.serve")
TRIM_AFTER_BYTES = 256 << 10  # a body from this size on: memory is given back to the system after its request

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def new_request_id() -> str:
    return "req-" + secrets.token_hex(12)


def error_body(message: str, *, type: str, code: str | None = None, param: str | None = None) -> bytes:
    """OpenAI's error body."""
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


def internal_error(request_id: str, what: str = "") -> str:
    """A 500's message: no internals, the id to find them in the server's log."""
    return f"internal error{': ' + what if what else ''} (request id {request_id})"


class Intake:
    """The ASGI middleware (see the module doc); ``reject(reason)`` counts each refusal in the metrics."""

    def __init__(self, app: App, *, api_keys: Sequence[str], max_body_bytes: int, body_timeout_s: float,
                 reject: Callable[[str], None] = lambda reason: None,
                 access_log: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.access_log = access_log
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        started = False
        status = 499  # the client went away before a response began (nginx's code for it)
        arrived = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self._serve(scope, receive, send_with_id, request_id, lambda: started)
        finally:
            if self.access_log is not None:
                self.access_log(_access_line(scope, status, time.perf_counter() - arrived, request_id))

    async def _serve(self, scope: Scope, receive: Receive, send_with_id: Send, request_id: str,
                     started: Callable[[], bool]) -> None:
        headers = dict(scope["headers"])  # lower-case names (ASGI); a repeated header's last value
        if self.api_keys and scope["path"] not in OPEN_PATHS and not authorized(headers.get(b"authorization"),
                                                                               self.api_keys):
            self.reject("unauthorized")
            given = bool(headers.get(b"authorization", b"").strip())
            message = ("Incorrect API key provided." if given else
                       "You didn't provide an API key. Send it in an Authorization header: Bearer YOUR_KEY.")
            await _refuse(send_with_id, 401, error_body(message, type="invalid_request_error", code="invalid_api_key"),
                          extra=[(b"www-authenticate", b"Bearer")])
            return
        body = await self._body(scope, headers, receive, send_with_id)
        if body is None:
            return
        delivered = False

        async def replay() -> Message:  # the body once, whole; then the client's own messages (its disconnect)
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, send_with_id)
        except Exception:
            log.exception("dstc serve: %s: internal error", request_id)
            if not started():
                await _refuse(send_with_id, 500, error_body(internal_error(request_id), type="server_error"))
        finally:
            if len(body) >= TRIM_AFTER_BYTES:
                body = b""
                await anyio.to_thread.run_sync(_give_memory_back)

    async def _body(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when it was refused (the response is sent) or the client went away."""
        limit = self.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(send, f"the request body is {int(declared)} bytes")
            return None
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.body_timeout_s) as timer:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    await self._too_large(send, f"the request body is over {limit} bytes")
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        assert timer.cancelled_caught
        self.reject("body_timeout")
        await _refuse(send, 408, error_body(
            f"the request body did not arrive within {self.body_timeout_s:g} s ({size} bytes came)",
            type="invalid_request_error", code="request_timeout"))
        return None

    async def _too_large(self, send: Send, what: str) -> None:
        self.reject("body_too_large")
        await _refuse(send, 413, error_body(f"{what}; this server takes at most {self.max_body_bytes} bytes "
                                            f"(dstc serve --max-body-bytes)", type="invalid_request_error",
                                            code="request_too_large"))


def _access_line(scope: Scope, status: int, seconds: float, request_id: str) -> str:
    client = scope.get("client")
    usage = scope["state"].get("usage")
    tokens = ""
    if usage is not None:
        counted = usage()
        tokens = f" {counted.prompt_tokens}+{counted.completion_tokens} tokens"
    return (f"dstc serve: {client[0] if client else '-'} \"{scope['method']} {scope['path']}\" {status} "
            f"{seconds:.3f} s{tokens} {request_id}")


def _give_memory_back() -> None:
    """What a big request's body, parsing and tokenization took and freed stays in glibc's arenas (the worker
    thread's among them: 400 MB after a 2-million character prompt, measured); malloc_trim returns it."""
    with contextlib.suppress(AttributeError):  # a C library without malloc_trim (not glibc)
        ctypes.CDLL(None).malloc_trim(0)


async def _refuse(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), *(extra or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
