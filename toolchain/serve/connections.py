"""Connection-level timeouts uvicorn does not have: for a request's headers, and for a client that stops reading.

uvicorn (0.54, h11) times out only an idle keep-alive connection (``timeout_keep_alive``, used as is); a connection
that sends part of its headers, slowly or never more, is held for good, and so is one whose client does not read the
response a stream keeps writing (uvicorn waits for the socket to drain). Neither is visible to an ASGI app (it gets a
request only once its headers are in; a send that waits for the drain cannot tell why), hence a protocol of our own,
uvicorn's h11 one with two timers:

- **headers**: from the connection's start, and from the end of each response, a request's headers must be in
  within ``header_timeout_s``; else the connection is closed (nothing is answered: no request was read). The body's
  own limit is the app's (intake.py).
- **writes**: when the transport's buffer stays above its high-water mark (the client reads nothing) for
  ``write_timeout_s``, the connection is aborted: the response's send returns, the app sees the client gone and
  cancels its request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0
    write_timeout_s: float = 30.0

    _headers_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_headers_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._headers_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._arm_headers_timer()  # before: uvicorn may start a pipelined request right away
        super().on_response_complete()

    def _arm_headers_timer(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
        self._headers_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _headers_timed_out(self) -> None:
        self._headers_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # closed already, or a request is in (its headers arrived in time)
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        self.transport.abort()  # close() would wait for the buffer to drain, which is what never happens


def guarded_protocol(header_timeout_s: float, write_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these timeouts."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s,
                                                                "write_timeout_s": write_timeout_s})
