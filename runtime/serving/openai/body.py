"""The OpenAI frontend's connection hygiene: the bounded request body, a read timeout for slow clients, and one
log line (never a traceback) for a client that goes away mid-body.

- `read_body`: the request body, refused with 413 once it exceeds the bound, before anything is parsed.
- `ReadTimeoutH11`: uvicorn's h11 protocol with a read deadline: a connection whose request (headers and body)
  has not fully arrived `read_timeout` seconds after it opened (or after its previous response) is closed. uvicorn
  itself only bounds the idle time between requests (timeout_keep_alive), so 20 slow clients held 20 connections
  for as long as they liked. A request that has fully arrived is never cut: generating its answer may take long.
- `client_disconnect`: the exception handler for a body cut short by the client (one warning line, status 499).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from fastapi import Request
from fastapi.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.serving.openai import protocol as P

log = logging.getLogger("mtp.openai")
DEFAULT_READ_TIMEOUT_S = 30.0
TIMED_OUT = "mtp.read_timed_out"  # set in the request's ASGI scope when the read timeout closed its connection


async def read_body(request: Request, max_prompt_bytes: int) -> bytes:
    """The request body, refused with 413 once it exceeds the bound (before parsing anything)."""
    limit = 2 * max_prompt_bytes + 65536  # JSON escaping may double a prompt; the rest is parameters
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.ProtocolError(f"request body is {declared} bytes; this server accepts at most {limit} "
                              "(start mtp-serve with a larger --max-prompt-bytes)", status=413)  # fmt: skip
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.ProtocolError(f"request body exceeds {limit} bytes (start mtp-serve with a larger "
                                  "--max-prompt-bytes)", status=413)  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


async def client_disconnect(request: Request, _e: Exception) -> Response:
    if request.scope.get(TIMED_OUT):  # the read timeout closed it and said so already: one line per connection
        return Response(status_code=408)
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    log.warning("%s closed the connection before its request body arrived (%s %s)", client, request.method,
                request.url.path)  # fmt: skip
    return Response(status_code=499)  # nobody reads it; uvicorn needs a response to end the cycle


def read_timeout_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's `http=` protocol class with this read deadline."""
    return type("ReadTimeoutH11", (ReadTimeoutH11,), {"read_timeout_s": read_timeout_s})


class ReadTimeoutH11(H11Protocol):
    read_timeout_s = DEFAULT_READ_TIMEOUT_S
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return  # the request arrived in time (its answer may take long), or the connection is going anyway
        if self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]:
            client = "{}:{}".format(*self.client) if self.client else "a client"
            log.warning("closing the connection of %s: its request did not arrive within %g s (--read-timeout)",
                        client, self.read_timeout_s)  # fmt: skip
            if self.conn.their_state is h11.SEND_BODY and self.scope is not None:
                self.scope[TIMED_OUT] = True  # type: ignore[literal-required]
        self.transport.close()  # an ASGI app still reading the body sees a disconnect
