"""One API call as HTTP, under an overall deadline and a cap on what is read, through a
`KubeConnection` (`hostdev.labels.kube_connection`: the server's URL, a urllib3 pool, the
headers that authenticate).

urllib3's timeouts are per socket operation (`Timeout`, `total` included, bounds each read, not
the call): a server that sends one byte every 2 s never trips a 15 s read timeout, in the TLS
handshake, the headers or the body. So every call has a deadline, and a timer cuts the call's
connection when it passes: the pool makes its connections here (`install_deadlines`), each with
a second descriptor of its TCP socket that the timer shuts down, which ends any read or write on
it at once, TLS handshake included. The body is read here, and reading stops at a cap.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError
from urllib3.response import BaseHTTPResponse

from dra.api_types import ApiError, MiB, Object
from hostdev.untrusted import quote_untrusted

if TYPE_CHECKING:
    from hostdev.labels.kube_connection import KubeConnection

READ_SIZE = 64 * 1024
CONNECT_SECONDS = 5.0
# A GET that answered 503 with Retry-After is not retried here: urllib3 would sleep as long as the
# server says, past any deadline. The caller's retry (the kubelet's, the publisher's backoff) is.
JSON_HEADERS = {"Accept": "application/json", "Content-Type": "application/json"}
RETRIES = urllib3.Retry(total=2, redirect=0, status=0, respect_retry_after_header=False)


class Deadline:
    """One call's deadline: when it passes, every connection the call used is cut."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._connections: list[_Cuttable] = []
        self._expired = False
        self.cancelled = False

    @property
    def expired(self) -> bool:
        with self._lock:
            return self._expired

    def remaining(self) -> float:
        return max(0.001, self.at - time.monotonic())

    def start(self) -> None:
        _timers.add(self)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True

    def watch(self, connection: _Cuttable) -> None:
        with self._lock:
            if connection not in self._connections:
                self._connections.append(connection)
            expired = self._expired
        if expired:
            connection.cut()

    def expire(self) -> None:
        with self._lock:
            # Its call ended: the connections it used are back in the pool, serving others.
            if self.cancelled:
                return
            self._expired = True
            connections = list(self._connections)
        for connection in connections:
            connection.cut()


class _Timers:
    """One thread expires every call's deadline when it passes. A timer thread per call cost a
    prepare more than reading the claim's answer did (issue 22's profile)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, deadline: Deadline) -> None:
        with self._changed:
            heapq.heappush(self._due, (deadline.at, next(self._order), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="api-deadlines", daemon=True)
                self._thread.start()
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                due = self._next_due()
            due.expire()

    def _next_due(self) -> Deadline:
        """Wait (holding the condition) for the first deadline not cancelled to pass."""
        while True:
            while self._due and self._due[0][2].cancelled:
                heapq.heappop(self._due)
            if not self._due:
                self._changed.wait()
            elif (wait := self._due[0][0] - time.monotonic()) > 0:
                self._changed.wait(wait)
            else:
                return heapq.heappop(self._due)[2]


_timers = _Timers()


_current = threading.local()
"""The deadline of the call this thread is making, while urllib3 connects and sends for it."""


@contextmanager
def _deadline_of_this_thread(deadline: Deadline) -> Iterator[None]:
    _current.deadline = deadline
    try:
        yield
    finally:
        _current.deadline = None


def _watch(connection: _Cuttable) -> None:
    deadline: Deadline | None = getattr(_current, "deadline", None)
    if deadline is not None:
        deadline.watch(connection)


if TYPE_CHECKING:
    _Base = HTTPConnection
else:
    _Base = object


class _Cuttable(_Base):
    """A pool connection a deadline can cut. urllib3 makes it, sends on it and reads its answer
    on the calling thread, so the deadline of that thread's call is the one to watch it."""

    _shutter: socket.socket | None = None

    def _new_conn(self) -> socket.socket:
        # A connect is no socket the timer can cut yet, and urllib3 retries it: each attempt
        # gets what is left of the call's time, and none starts once it is gone.
        deadline: Deadline | None = getattr(_current, "deadline", None)
        if deadline is not None:
            remaining = deadline.remaining()
            if remaining <= 0:
                raise ConnectTimeoutError(self, "the call's deadline passed before connecting")
            self.timeout = remaining if self.timeout is None else min(self.timeout, remaining)
        sock = super()._new_conn()
        self._close_shutter()
        # The same TCP connection under a descriptor of our own: TLS detaches `sock` while it
        # wraps it, and the pool may close it at any time, but shutting this one down ends the
        # connection whatever holds it, and cannot hit a reused descriptor number.
        self._shutter = sock.dup()
        _watch(self)
        return sock

    def request(self, *args: Any, **kwargs: Any) -> None:
        _watch(self)
        super().request(*args, **kwargs)

    def cut(self) -> None:
        shutter = self._shutter
        if shutter is not None:
            with suppress(OSError):
                shutter.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._close_shutter()

    def _close_shutter(self) -> None:
        shutter, self._shutter = self._shutter, None
        if shutter is not None:
            shutter.close()


class _CuttableHTTPConnection(_Cuttable, HTTPConnection):
    pass


class _CuttableHTTPSConnection(_Cuttable, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _CuttableHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _CuttableHTTPSConnection


def install_deadlines(manager: urllib3.PoolManager) -> None:
    """Make the pool open connections a deadline can cut. A SOCKS proxy's pools (the official
    client's, for a socks5:// proxy) are left alone: there, a deadline is checked between reads
    only."""
    if type(manager) in (urllib3.PoolManager, urllib3.ProxyManager):
        manager.clear()
        manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


def call(
    connection: KubeConnection,
    what: str,
    method: str,
    path: str,
    *,
    seconds: float,
    limit: int,
    query: Sequence[tuple[str, str]] = (),
    body: Object | None = None,
) -> Object:
    """`method` on `path`, answered within `seconds` with a JSON object of at most `limit`
    bytes, or an ApiError saying which of these failed."""
    deadline = Deadline(seconds)
    deadline.start()
    try:
        response = _open(connection, what, method, path, query, body, deadline)
        with _released(response):
            data = _read_body(response, what, limit, deadline)
        if not 200 <= response.status <= 299:
            raise _status_error(what, response.status, data)
        return _json_object(what, data)
    finally:
        deadline.cancel()


def stream_lines(
    connection: KubeConnection,
    what: str,
    path: str,
    *,
    seconds: float,
    limit: int,
    query: Sequence[tuple[str, str]],
) -> Iterator[bytes]:
    """The lines of a streamed GET (a watch) until the server ends it, each at most `limit`
    bytes; the whole stream is cut after `seconds`."""
    deadline = Deadline(seconds)
    deadline.start()
    try:
        response = _open(connection, what, "GET", path, query, None, deadline)
        with _released(response):
            if not 200 <= response.status <= 299:
                raise _status_error(
                    what, response.status, _read_body(response, what, limit, deadline)
                )
            pending = bytearray()
            for chunk in _chunks(response, what, deadline):
                pending += chunk
                while (end := pending.find(b"\n")) >= 0:
                    line = bytes(pending[:end])
                    del pending[: end + 1]
                    yield line
                if len(pending) > limit:
                    raise ApiError(f"{what}: an event is larger than {_size(limit)}; refused")
    finally:
        deadline.cancel()


def _open(
    connection: KubeConnection,
    what: str,
    method: str,
    path: str,
    query: Sequence[tuple[str, str]],
    body: Object | None,
    deadline: Deadline,
) -> BaseHTTPResponse:
    url = connection.server + path
    if query:
        url += "?" + urlencode(query, quote_via=quote)
    headers = {**JSON_HEADERS, **connection.headers()}
    remaining = deadline.remaining()
    timeout = urllib3.Timeout(connect=min(CONNECT_SECONDS, remaining), read=remaining)
    try:
        with _deadline_of_this_thread(deadline):
            return connection.pool.request(
                method,
                url,
                body=json.dumps(body) if body is not None else None,
                headers=headers,
                timeout=timeout,
                retries=RETRIES,
                preload_content=False,
                decode_content=False,
            )
    except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as error:
        raise _network_error(what, error, deadline, "API server unreachable") from None


def _read_body(response: BaseHTTPResponse, what: str, limit: int, deadline: Deadline) -> bytes:
    """The body, refused as soon as it is known to exceed `limit`: by Content-Length when the
    server gives one, else by counting what arrives."""
    length = response.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(what, limit, f" (Content-Length {length})")
    data = bytearray()
    for chunk in _chunks(response, what, deadline):
        data += chunk
        if len(data) > limit:
            raise _too_large(what, limit, "")
    return bytes(data)


def _chunks(response: BaseHTTPResponse, what: str, deadline: Deadline) -> Iterator[bytes]:
    encoding = response.headers.get("Content-Encoding", "identity").lower()
    if encoding != "identity":
        # Never asked for; decoding it would let a small body grow without bound.
        raise ApiError(f"{what}: the answer is compressed ({encoding}) though none was asked for")
    while True:
        if deadline.expired:
            raise _timed_out(what, deadline)
        try:
            chunk = response.read1(READ_SIZE, decode_content=False)
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as error:
            raise _network_error(what, error, deadline, "connection lost") from None
        if not chunk:
            if deadline.expired:
                raise _timed_out(what, deadline)
            return
        yield chunk


@contextmanager
def _released(response: BaseHTTPResponse) -> Iterator[None]:
    """The connection goes back to the pool; closed first unless the answer was read to its
    end, as what is left of it would be read as the next answer."""
    try:
        yield
    except BaseException:
        response.close()
        raise
    finally:
        response.release_conn()


def _json_object(what: str, data: bytes) -> Object:
    try:
        decoded = json.loads(data or b"{}")
    # Deep nesting is a RecursionError, not a ValueError.
    except (ValueError, RecursionError) as error:
        raise ApiError(f"{what}: the answer is not JSON ({str(error)[:200]})") from None
    if not isinstance(decoded, dict):
        raise ApiError(f"{what}: the answer is a JSON {type(decoded).__name__}, not an object")
    return decoded


def parse_event(what: str, line: bytes) -> tuple[str, Object]:
    """A watch event's type and object."""
    event = _json_object(what, line)
    kind, item = event.get("type"), event.get("object")
    if not isinstance(kind, str) or not isinstance(item, dict):
        raise ApiError(f"{what}: an event lacks its type or object")
    if kind == "ERROR":
        code = item.get("code")
        raise ApiError(
            f"{what}: {str(item.get('message', 'error'))[:500]}",
            code if isinstance(code, int) else None,
        )
    return kind, item


def _status_error(what: str, status: int, data: bytes) -> ApiError:
    message = ""
    with suppress(ApiError):
        # The server's words, quoted: a lone surrogate or a control character in them must not
        # reach the kubelet's answer (protobuf strings are UTF-8) or the log as it came.
        message = quote_untrusted(str(_json_object(what, data).get("message", "")), 500)
    hint = {
        401: "the driver's credentials were refused",
        403: "RBAC denies it: grant the driver's service account this verb (docs/dra.md)",
        404: "not found",
        409: "conflict",
    }.get(status, f"HTTP {status}")
    return ApiError(f"{what}: {hint}" + (f" ({message})" if message else ""), status)


def _network_error(what: str, error: Exception, deadline: Deadline, fallback: str) -> ApiError:
    if deadline.expired:
        return _timed_out(what, deadline)
    return ApiError(f"{what}: {fallback} ({error})")


def _timed_out(what: str, deadline: Deadline) -> ApiError:
    return ApiError(f"{what}: the API server did not answer within {deadline.seconds:g} s")


def _too_large(what: str, limit: int, detail: str) -> ApiError:
    return ApiError(
        f"{what}: the answer is larger than {_size(limit)}{detail}, more than the API server"
        " stores in one object; refused"
    )


def _size(limit: int) -> str:
    return f"{limit / MiB:g} MiB" if limit >= MiB else f"{limit} bytes"


def query_of(options: Mapping[str, str | int | bool | None]) -> list[tuple[str, str]]:
    """Query parameters as the API server reads them (booleans as `true`), unset ones left out."""
    return [
        (name, ("true" if value else "false") if isinstance(value, bool) else str(value))
        for name, value in options.items()
        if value is not None
    ]
