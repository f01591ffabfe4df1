"""The HTTP side's limits, before a request reaches the application's admission: the header checks
(Content-Length, Content-Type), the body-read slots, reading a body within its timeout, and the
HTTP/1.1 protocol (header timeout, JSON answers to malformed requests, lingering close).

The protocol is a subclass of uvicorn's H11Protocol, a class uvicorn does not document as public:
no uvicorn option times out a request's headers (timeout_keep_alive covers only the idle time
between requests), answers the h11 parser's own refusals in the contract's {"detail": ...} shape,
or keeps a connection refused mid-body open long enough for the client to read the answer. The
methods it relies on are pinned by tests/valen_runtime/test_serve_protocol.py, and pyproject.toml
bounds uvicorn's version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Callable

from ..wire import MAX_BODY, MAX_VIDEO_BODY, encode_response

log = logging.getLogger("valen_serve")

_ASCII_DIGITS = re.compile(r"[0-9]{1,20}")


class _Answer(Exception):
    """Ends a request early with a status and a detail."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _ClientGone(Exception):
    """The client closed the connection before its answer (its args[0] says when); nothing can be sent."""

    def __init__(self, detail: str = "client closed the connection before the body was complete"):
        super().__init__(detail)



def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()



def check_body_headers(headers) -> int:
    """The body's length, once its headers pass the checks, in the upstream worker's order, all
    before a byte of the body is read; else raises _Answer."""
    if "transfer-encoding" in headers:
        raise _Answer(411, "Content-Length is required; chunked request bodies are not accepted")
    lengths = headers.getlist("content-length")
    if len(lengths) != 1:
        raise _Answer(411, "exactly one Content-Length header is required")
    if not _ASCII_DIGITS.fullmatch(lengths[0].strip()):
        raise _Answer(400, "Content-Length is not a number")
    length = int(lengths[0])
    if length > MAX_VIDEO_BODY:  # a body past MAX_BODY without a video: 413 once parsed (wire.py)
        raise _Answer(413, f"body is {length} bytes; the limit is {MAX_VIDEO_BODY}")
    content_types = headers.getlist("content-type")
    if len(content_types) > 1:  # conflicting or not, the body's type would be a guess
        raise _Answer(415, f"exactly one Content-Type header is allowed, got {len(content_types)}")
    if _media_type(headers.get("content-type")) != "application/json":
        raise _Answer(415, "Content-Type must be application/json")
    return length


class _BodyReads:
    """Slots for requests whose bodies are being read, in total, per client address, and for bodies
    declaring more than MAX_BODY (video requests, up to MAX_VIDEO_BODY each), so that the memory
    bodies being read can take stays near total x 8 MiB + large x 24 MiB (event loop only)."""

    def __init__(self, total: int, per_client: int, large: int):
        self.total, self.per_client, self.large = total, per_client, large
        self.by_client: dict[str, int] = {}
        self.large_reads = 0

    def refusal(self, client: str, length: int) -> str | None:
        """Why a body of `length` bytes from `client` cannot be read now, or None when it can."""
        if sum(self.by_client.values()) >= self.total:
            return f"too many request bodies being read: {self.total} (--max-body-reads)"
        if self.by_client.get(client, 0) >= self.per_client:
            return f"too many request bodies being read from {client}: {self.per_client} (--max-body-reads-per-client)"
        if length > MAX_BODY and self.large_reads >= self.large:
            return f"too many bodies over {MAX_BODY} bytes being read: {self.large} (--max-large-body-reads)"
        return None

    @contextlib.contextmanager
    def slot(self, client: str, length: int):
        large = length > MAX_BODY
        self.by_client[client] = self.by_client.get(client, 0) + 1
        self.large_reads += large
        try:
            yield
        finally:
            self.large_reads -= large
            self.by_client[client] -= 1
            if not self.by_client[client]:
                del self.by_client[client]



async def read_body(receive, length: int, read_timeout: float) -> bytes:
    """The body, never more than `length` (<= MAX_VIDEO_BODY) bytes; 408 when it does not arrive within read_timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + read_timeout
    chunks, size, more = [], 0, True
    while more:
        try:
            message = await asyncio.wait_for(receive(), timeout=max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise _Answer(408, f"request body timed out: {size} of {length} bytes in {read_timeout:g} s") from None
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > length:  # the HTTP parser frames by Content-Length; this is a second guard
            raise _Answer(400, f"body is longer than its Content-Length {length}")
        chunks.append(chunk)
        more = message.get("more_body", False)
    if size != length:
        raise _Answer(400, f"incomplete body: {size} of {length} bytes")
    return b"".join(chunks)


LINGER_S = 2.0  # how long a connection refused mid-body keeps discarding what the client still sends


class _LingeringTransport:
    """A transport whose close() lingers while the client is still sending a refused body.

    Closing a socket with unread data makes the kernel send a reset, which can destroy the answer
    (413, 503, ...) before the client reads it. Instead the write side is shut (the client sees
    the end of the answer), further input is discarded, and the socket closes once the client
    closes or after LINGER_S. Everything else is the wrapped transport's.
    """

    def __init__(self, transport, body_pending: Callable[[], bool]):
        self._transport = transport
        self._body_pending = body_pending
        self.discarding = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        transport = self._transport
        if self.discarding or transport.is_closing():
            return
        if not self._body_pending() or not transport.can_write_eof():
            transport.close()
            return
        self.discarding = True
        transport.write_eof()
        transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def is_closing(self) -> bool:
        return self.discarding or self._transport.is_closing()


def _protocol_class(read_timeout: float):
    """uvicorn's HTTP/1.1 protocol, changed in three ways: the parser's own refusals (malformed
    request line, conflicting Content-Length, ...) answer {"detail": ...} like every other error;
    a connection whose request headers do not arrive within read_timeout gets 408 and is closed
    (uvicorn itself never times out a request's headers); and a connection closed while the
    client is still sending its body lingers (_LingeringTransport), so the client reads the answer."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class WireProtocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            self._lingering = _LingeringTransport(transport, lambda: self.conn.their_state is h11.SEND_BODY)
            super().connection_made(self._lingering)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)
            self._lingering._transport.close()

        def data_received(self, data: bytes) -> None:
            if not self._lingering.discarding:
                super().data_received(data)

        def eof_received(self) -> None:
            if self._lingering.discarding:
                self._lingering._transport.close()  # the client finished sending: close now

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():
                self._arm_header_timer()  # the next request on this connection

        def send_400_response(self, msg: str) -> None:
            body = encode_response({"detail": "malformed HTTP request (the request line, headers or framing)"})
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            log.info({"event": "request", "status": 400, "detail": "malformed HTTP request"})

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(read_timeout, self._headers_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            body = encode_response({"detail": f"request headers timed out after {read_timeout:g} s"})
            # No request was parsed, so h11 cannot frame a response: the bytes are written as is.
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()
            log.info({"event": "request", "status": 408, "detail": "request headers timed out"})

    return WireProtocol
