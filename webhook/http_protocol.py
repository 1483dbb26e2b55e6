"""HTTP/1.1 over an asyncio transport, TLS or plain: h11 parses, a synchronous handler answers.

Every answer the webhook gives is a few hundred microseconds of CPU with no IO, so the handler
runs inline in `data_received`: no task per request, no awaits on the hot path. Connections are
kept alive; pipelined requests are answered in order. Each connection sits in its listener's
`ConnectionTable` and runs under one timer: a new connection must finish its TLS handshake and
send a whole request within the request timeout, an answered one must start its next request
within the idle timeout and finish it within the request timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import h11

from hostdev.untrusted import quote_untrusted
from webhook.connections import ConnectionTable
from webhook.tls_session import TlsSession

MAX_BODY = 1024 * 1024
MAX_HEADERS = 16 * 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    content_type: str  # the media type only, lower case: parameters such as charset dropped
    body: bytes


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = field(default=())


Handler = Callable[[Request], Response]


def text(status: int, message: str) -> Response:
    return Response(status, (message + "\n").encode())


class HttpProtocol(asyncio.Protocol):
    """One connection. The handler must not raise; a bug that does costs this request a 500."""

    def __init__(
        self,
        handler: Handler,
        table: ConnectionTable,
        tls_context: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self._handler = handler
        self._table = table
        self._tls_context = tls_context  # called per connection: the current certificate
        self._tls: TlsSession | None = None
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADERS)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._body: list[bytes] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._reading = False  # some bytes of a request have come and its answer has not gone
        self._answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self._tls_context is not None:
            self._tls = TlsSession(self._tls_context())
        self._table.admit(self)
        self._arm_timer(self._table.limits.request_timeout, "request_timeout")

    def data_received(self, data: bytes) -> None:
        if self._tls is not None:
            try:
                data = self._tls.receive(data)
            except ssl.SSLError as error:
                log.debug("TLS failed: %s", error)
                self._send_tls()  # OpenSSL's alert, if it wrote one
                self.close()
                return
            self._send_tls()
            if self._tls.peer_closed:
                self._received(data)
                self.eof_received()
                return
        self._received(data)

    def _open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def _received(self, data: bytes) -> None:
        if not data or not self._open():
            return
        if not self._reading:
            self._reading = True
            self._table.reading(self)
            if self._answered:  # a new connection's first deadline runs from its accept
                self._arm_timer(self._table.limits.request_timeout, "request_timeout")
        self._table.received(self, len(data))
        self._conn.receive_data(data)
        self._process()

    def eof_received(self) -> bool:
        if self._open():
            self._conn.receive_data(b"")
            self._process()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._table.remove(self)
        self._transport = None

    def pause_writing(self) -> None:
        # A client that does not read its answers gets no more requests read from it.
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def _process(self) -> None:
        while self._open():
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as error:
                self._refuse(error.error_status_hint, f"bad HTTP request: {error}")
                return
            if event is h11.NEED_DATA:
                return
            if event is h11.PAUSED:
                if not self._next_cycle():
                    return
            elif isinstance(event, h11.Request):
                self._start(event)
            elif isinstance(event, h11.Data):
                self._size += len(event.data)
                if self._size > MAX_BODY:
                    self._refuse(413, f"request body over {MAX_BODY} bytes")
                    return
                self._body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._finish()
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return

    def _start(self, event: h11.Request) -> None:
        self._request = event
        self._body = []
        self._size = 0
        length = _header(event.headers, b"content-length")
        if length is not None and int(length) > MAX_BODY:
            # Answered before the body is read; h11 then marks the connection for closing.
            self._refuse(413, f"request body over {MAX_BODY} bytes")
            return
        if self._conn.client_is_waiting_for_100_continue:
            self._write(self._conn.send(h11.InformationalResponse(status_code=100, headers=[])))

    def _finish(self) -> None:
        event = self._request
        assert event is not None
        target = event.target.decode("ascii", "replace")
        request = Request(
            method=event.method.decode("ascii", "replace"),
            path=target.partition("?")[0],
            content_type=_media_type(_header(event.headers, b"content-type")),
            body=b"".join(self._body),
        )
        self._body = []
        self._table.released(self)
        try:
            response = self._handler(request)
        except Exception:
            log.exception(
                "bug: handler failed on %s %s",
                quote_untrusted(request.method, 20),
                quote_untrusted(request.path, 100),
            )
            response = text(500, "internal error; see the webhook's log")
        self._respond(response)

    def _next_cycle(self) -> bool:
        if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
            self._conn.start_next_cycle()
            self._answered = True
            limits = self._table.limits
            if self._conn.trailing_data[0]:  # a pipelined request has already begun
                self._arm_timer(limits.request_timeout, "request_timeout")
            else:
                self._reading = False
                self._table.waiting(self)
                self._arm_timer(limits.idle_timeout, "idle_timeout")
            return True
        self.close()
        return False

    def _respond(self, response: Response) -> None:
        headers = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
            *response.headers,
        ]
        out = self._conn.send(h11.Response(status_code=response.status, headers=headers))
        assert out is not None
        out += self._conn.send(h11.Data(data=response.body)) or b""
        out += self._conn.send(h11.EndOfMessage()) or b""
        self._write(out)
        if self._conn.our_state is h11.MUST_CLOSE:
            self.close()
        elif self._conn.their_state is h11.DONE:
            self._next_cycle()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request we will not read to the end, then close the connection."""
        if self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            # A peer that broke the exchange too early gets no answer at all.
            with contextlib.suppress(h11.LocalProtocolError):
                self._respond(
                    Response(status, (message + "\n").encode(), headers=(("connection", "close"),))
                )
        self.close()

    def _write(self, data: bytes) -> None:
        if self._transport is None:
            return
        if self._tls is None:
            self._transport.write(data)
            return
        self._tls.send(data)
        self._send_tls()

    def _send_tls(self) -> None:
        assert self._tls is not None
        out = self._tls.outgoing()
        if out and self._transport is not None:
            self._transport.write(out)

    def close(self) -> None:
        """Close after what was written has gone; a peer that does not read it is cut later."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._tls is not None:
            self._tls.close_notify()
            self._send_tls()
        transport.close()
        self._arm_timer(self._table.limits.request_timeout, "request_timeout")

    def evict(self) -> None:
        """Drop the connection now: nothing more is read, written or flushed."""
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is not None:
            self._transport.abort()

    def _arm_timer(self, seconds: float, reason: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, reason)

    def _expire(self, reason: str) -> None:
        transport = self._transport
        if transport is None:
            return
        self._table.count_closed(reason)
        log.debug("closing a connection: %s", reason.replace("_", " "))
        if transport.is_closing():
            self.evict()  # it was closed, but the peer never read what was left to send
            return
        self.close()
        if transport.get_write_buffer_size():
            self.evict()


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _media_type(value: bytes | None) -> str:
    if value is None:
        return ""
    return value.partition(b";")[0].strip().lower().decode("ascii", "replace")
