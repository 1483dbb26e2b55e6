"""The HTTP side of the API server stand-in: requests mapped onto the store, answered as the
real API server answers them (JSON bodies, `Status` on errors, chunked watch streams), over TLS
when a context is given. What to serve and how to misbehave comes from a `Backend`
(`ApiServerStandIn`)."""

from __future__ import annotations

import json
import socket
import socketserver
import ssl
import tempfile
import threading
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from sim.apiserver_rules import (
    KINDS,
    STALE,
    Kind,
    Object,
    SelectorError,
    build_status,
    parse_field_selector,
    parse_label_selector,
    status_conflict,
)
from sim.apiserver_store import ApiError, Checks, Event, Selection, Store

NO_RESOURCE = "the server could not find the requested resource"
MERGE_PATCH = "application/merge-patch+json"
NAMESPACE_MISMATCH = (
    "the namespace of the provided object does not match the namespace sent on the request"
)


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    method: str
    path: str
    query: dict[str, str]
    body: Object | None
    status: int


@dataclass(slots=True)
class Failure:
    """Answers to give instead of serving (see ApiServerStandIn.fail_next)."""

    remaining: int
    status: int
    method: str | None
    path: str | None
    retry_after: int | None
    body: bytes | None = None  # sent as is instead of a Status (ApiServerStandIn.answer_next)


@dataclass(slots=True)
class Misbehaviour:
    """A hostile way to answer the next requests (see ApiServerStandIn.misbehave)."""

    remaining: int
    how: str
    method: str | None
    path: str | None
    interval: float
    size: int
    chunked: bool


HOSTILE = ("trickle", "hang", "huge")


class Backend(Protocol):
    """What the HTTP side needs from the stand-in."""

    store: Store
    token: str
    watch_timeout: float
    bookmark_interval: float

    def take_failure(self, method: str, path: str) -> Failure | None: ...
    def take_misbehaviour(self, method: str, path: str) -> Misbehaviour | None: ...
    def take_conflict(self) -> bool: ...
    def checks(self, kind: Kind) -> Checks: ...
    def record(self, request: LoggedRequest) -> None: ...


class ApiHttpServer(ThreadingHTTPServer):
    """Serves `backend` on `address` until shutdown(); `cut_connections()` then ends every open
    connection, watches included, as a server that goes away does."""

    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        backend: Backend,
        context: ssl.SSLContext | None,
    ) -> None:
        self.backend = backend
        self.context = context
        self.stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host name, which can stall without DNS.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = self.server_address[1]

    def finish_request(self, request: Any, client_address: Any) -> None:
        connection: socket.socket = request
        if self.context is not None:
            connection = self.context.wrap_socket(request, server_side=True)
        with self._connections_lock:
            self._connections.add(connection)
        try:
            super().finish_request(connection, client_address)
        finally:
            with self._connections_lock:
                self._connections.discard(connection)
            connection.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or fails the TLS handshake is not the server's problem."""

    def cut_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True, slots=True)
class _Route:
    kind: Kind
    namespace: str | None
    name: str | None


def _route(path: str) -> _Route | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:3] == ["apis", "resource.k8s.io", "v1"]:
        group, rest = "resource.k8s.io", parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not 1 <= len(rest) <= 2:
        return None
    kind = next((k for k in KINDS if (k.group, k.resource) == (group, rest[0])), None)
    if kind is None or (namespace is not None and not kind.namespaced):
        return None
    name = rest[1] if len(rest) == 2 else None
    if kind.namespaced and namespace is None and name is not None:
        return None
    return _Route(kind, namespace, name)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # As Go's net/http (the real API server): with Nagle on, a response written in two pieces
    # waits for the client's delayed ACK, and every call on a kept-alive connection takes 40 ms.
    disable_nagle_algorithm = True
    server: ApiHttpServer

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are in the stand-in's log, not on stderr."""

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def _serve(self, method: str) -> None:
        backend = self.server.backend
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body: Object | None = None
        watch: _Watch | None = None
        headers: dict[str, str] = {}
        try:
            body = _parse_body(raw)
            failure = backend.take_failure(method, split.path)
            if failure is not None and failure.body is not None:
                # Nothing below applies to an answer sent as is, logging aside.
                backend.record(LoggedRequest(method, split.path, query, body, failure.status))
                self._send(failure.status, failure.body, {})
                return
            if failure is not None:
                status = failure.status
                answer = build_status(
                    status, f"the API server stand-in was told to answer {status}"
                )
                retry_after = failure.retry_after
                headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
            else:
                if self.headers.get("Authorization") != f"Bearer {backend.token}":
                    raise ApiError(build_status(401, "Unauthorized"))
                route = _route(split.path)
                if route is None:
                    raise ApiError(build_status(404, NO_RESOURCE, details={}))
                if method == "GET" and route.name is None and query.get("watch") in ("true", "1"):
                    watch = _plan_watch(route, query, backend.watch_timeout)
                    status, answer = 200, {}
                else:
                    status, answer = self._dispatch(method, route, query, body)
        except ApiError as e:
            status, answer = e.code, e.status
        # Logged before answering, so the log has a request once its client has the answer.
        backend.record(LoggedRequest(method, split.path, query, body, status))
        misbehaviour = backend.take_misbehaviour(method, split.path)
        try:
            if misbehaviour is not None:
                self._misbehave(misbehaviour, status, answer)
            elif watch is not None:
                self._watch(watch)
            else:
                self._send_json(status, answer, headers)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass

    def _dispatch(
        self, method: str, route: _Route, query: dict[str, str], body: Object | None
    ) -> tuple[int, Object]:
        store, kind = self.server.backend.store, route.kind
        namespace = route.namespace or ""
        if route.name is None:
            if method == "GET":
                limit = _integer(query.get("limit", "0"), "limit")
                _check_not_too_new(query.get("resourceVersion", ""), store.revision)
                token = query.get("continue", "")
                return 200, store.list_objects(kind, _selection(route, query), limit, token)
            if method == "POST" and (route.namespace is not None or not kind.namespaced):
                obj = _sent_object(kind, body)
                if obj.get("metadata", {}).get("namespace", namespace) != namespace:
                    raise ApiError(build_status(400, NAMESPACE_MISMATCH))
                return 201, store.create(kind, namespace, obj, self.server.backend.checks(kind))
            if method == "DELETE":
                return 200, store.delete_collection(kind, _selection(route, query))
        elif method == "GET":
            return 200, store.get(kind, namespace, route.name)
        elif method in ("PUT", "PATCH"):
            obj = (
                self._patched(route, route.name, body)
                if method == "PATCH"
                else _sent_object(kind, body)
            )
            if method == "PUT" and self.server.backend.take_conflict():
                raise ApiError(status_conflict(kind, route.name, STALE))
            return 200, store.update(
                kind, namespace, route.name, obj, self.server.backend.checks(kind)
            )
        elif method == "DELETE":
            preconditions = (body or {}).get("preconditions") or {}
            return 200, store.delete(
                kind,
                namespace,
                route.name,
                preconditions.get("uid"),
                preconditions.get("resourceVersion"),
            )
        raise ApiError(
            build_status(405, "the server does not allow this method on the requested resource")
        )

    def _patched(self, route: _Route, name: str, body: Object | None) -> Object:
        """The stored object with a JSON merge patch applied (the only patch type served)."""
        if self.headers.get("Content-Type") != MERGE_PATCH:
            raise ApiError(build_status(415, f"the stand-in takes only {MERGE_PATCH} patches"))
        stored = self.server.backend.store.get(route.kind, route.namespace or "", name)
        patched = merge_patch(stored, _sent_object(route.kind, body))
        assert isinstance(patched, dict)  # an object patched by an object
        return patched

    def _watch(self, watch: _Watch) -> None:
        store, kind, selection = self.server.backend.store, watch.kind, watch.selection
        cursor, bookmarks = watch.resource_version, watch.bookmarks
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if cursor == 0:
            # No version: the current state first, as synthetic ADDED events.
            listed = store.list_objects(kind, selection)
            for item in listed["items"]:
                self._chunk({"type": "ADDED", "object": _with_type(kind, item)})
            cursor = int(listed["metadata"]["resourceVersion"])
        deadline = time.monotonic() + watch.timeout
        next_bookmark = time.monotonic() + self.server.backend.bookmark_interval
        while not self.server.stopping.is_set():
            try:
                events, cursor = store.events_after(kind, cursor)
            except ApiError as e:
                self._chunk({"type": "ERROR", "object": e.status})
                break
            for event in events:
                shown = _as_seen(event, selection)
                if shown is not None:
                    self._chunk({"type": shown[0], "object": shown[1]})
            now = time.monotonic()
            if now >= deadline:
                break
            if bookmarks and now >= next_bookmark:
                meta = {"resourceVersion": str(cursor)}
                self._chunk({"type": "BOOKMARK", "object": _with_type(kind, {"metadata": meta})})
                next_bookmark = now + self.server.backend.bookmark_interval
            wake = min(deadline, next_bookmark) if bookmarks else deadline
            store.wait(cursor, wake, self.server.stopping.is_set)
        if not self.server.stopping.is_set():
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _misbehave(self, how: Misbehaviour, status: int, answer: Object) -> None:
        """Answer as a hostile or broken server would; the connection is not reused after."""
        self.close_connection = True
        stopping = self.server.stopping
        if how.how == "hang":
            stopping.wait()
        elif how.how == "trickle":
            data = json.dumps(answer).encode()
            head = (
                f"HTTP/1.1 {status} {self.responses[status][0]}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode()
            for byte in head + data:
                if stopping.wait(how.interval):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
        else:
            self._send_huge(how, status, answer)

    def _send_huge(self, how: Misbehaviour, status: int, answer: Object) -> None:
        """`answer` with a padding field that makes its body `how.size` bytes, streamed (the
        stand-in never holds it whole), with Content-Length or chunked."""
        head = b'{"padding": "'
        tail = (b'", ' + json.dumps(answer).encode()[1:]) if answer else b'"}'
        padding = max(0, how.size - len(head) - len(tail))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if how.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(head) + padding + len(tail)))
        self.end_headers()
        piece = b"x" * (1024 * 1024)
        self._write_piece(head, how.chunked)
        while padding > 0:
            self._write_piece(piece[:padding], how.chunked)
            padding -= len(piece)
        self._write_piece(tail, how.chunked)
        if how.chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_piece(self, data: bytes, chunked: bool) -> None:
        if chunked:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        else:
            self.wfile.write(data)

    def _chunk(self, event: Object) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(self, status: int, obj: Object, headers: Mapping[str, str] = {}) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _send(self, status: int, data: bytes, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()


@dataclass(frozen=True, slots=True)
class _Watch:
    kind: Kind
    selection: Selection
    resource_version: int  # 0: from now, after the current objects as ADDED events
    timeout: float
    bookmarks: bool


def _plan_watch(route: _Route, query: dict[str, str], default_timeout: float) -> _Watch:
    requested = query.get("resourceVersion", "")
    timeout = query.get("timeoutSeconds")
    return _Watch(
        route.kind,
        _selection(route, query),
        0 if requested in ("", "0") else _integer(requested, "resourceVersion"),
        default_timeout if not timeout else _integer(timeout, "timeoutSeconds"),
        query.get("allowWatchBookmarks") in ("true", "1"),
    )


def _parse_body(raw: bytes) -> Object | None:
    if not raw:
        return None
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(build_status(400, f"the request body is not JSON: {e}")) from None
    if not isinstance(body, dict):
        raise ApiError(build_status(400, "the request body must be a JSON object"))
    return body


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch: objects merge key by key, null removes a key, the rest
    replaces."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def _as_seen(event: Event, selection: Selection) -> tuple[str, Object] | None:
    """What a watcher with `selection` sees of `event`: an object leaving the selection is
    DELETED for it, one entering it is ADDED."""
    kind = event.kind
    before = event.old is not None and selection.matches(kind, event.old)
    now = event.type != "DELETED" and selection.matches(kind, event.object)
    if now:
        return ("MODIFIED" if before else "ADDED"), event.object
    if before:
        return "DELETED", event.object
    return None


def _with_type(kind: Kind, obj: Object) -> Object:
    return {"kind": kind.kind, "apiVersion": kind.api_version, **obj}


def _sent_object(kind: Kind, body: Object | None) -> Object:
    if body is None:
        raise ApiError(build_status(400, "the request needs a body: the object to write"))
    sent = body.get("apiVersion")
    if sent is not None and sent != kind.api_version:
        raise ApiError(
            build_status(
                400,
                f"the API version in the data ({sent}) does not match the expected API version"
                f" ({kind.api_version})",
            )
        )
    if body.get("kind") not in (None, kind.kind):
        raise ApiError(
            build_status(
                400,
                f"the kind in the data ({body['kind']}) does not match the expected kind"
                f" ({kind.kind})",
            )
        )
    return body


def _selection(route: _Route, query: dict[str, str]) -> Selection:
    try:
        return Selection(
            route.namespace,
            tuple(parse_field_selector(query.get("fieldSelector", ""), route.kind, {})),
            tuple(parse_label_selector(query.get("labelSelector", ""))),
        )
    except SelectorError as e:
        raise ApiError(build_status(400, str(e))) from None


def _integer(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ApiError(build_status(400, f"{name}: Invalid value: {text!r}")) from None


def _check_not_too_new(requested: str, current: int) -> None:
    if requested not in ("", "0") and _integer(requested, "resourceVersion") > current:
        raise ApiError(
            build_status(
                504,
                f"Too large resource version: {requested}, current: {current}",
                details={
                    "causes": [
                        {
                            "reason": "ResourceVersionTooLarge",
                            "message": "Too large resource version",
                        }
                    ],
                    "retryAfterSeconds": 1,
                },
            )
        )


def build_server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as directory:
        cert, key = Path(directory, "tls.crt"), Path(directory, "tls.key")
        cert.write_bytes(cert_pem)
        key.write_bytes(key_pem)
        context.load_cert_chain(cert, key)
    return context
