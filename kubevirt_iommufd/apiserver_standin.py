"""A Kubernetes API server stand-in on loopback, for the DRA driver's tests and demo: the real
`kubernetes` client talks to it over HTTPS with a bearer token, as it would to a cluster.

It serves, with the real server's status codes and `Status` bodies:
- `GET /api/v1/nodes[/{name}]` (nodes are seeded with `put_node`);
- `resource.k8s.io/v1` ResourceClaims: get and list (claims are seeded with `put_claim` and
  allocated with `set_allocation`, as the scheduler would);
- `resource.k8s.io/v1` ResourceSlices: list (field selectors `metadata.name`, `spec.nodeName`,
  `spec.driver`, label selectors, `limit`/`continue`), watch (chunked JSON events from a
  resourceVersion, `timeoutSeconds`, bookmarks, 410 Expired after `compact()`), get, create
  (`generateName`, 409 AlreadyExists), update (409 Conflict on a stale resourceVersion), delete
  (preconditions) and deletecollection;
- 422 Invalid for objects that break the ResourceSlice rules the real server enforces, or that
  the optional `validate` callback (e.g. the official OpenAPI schema) refuses.

Test controls act as the rest of the cluster would (the kubelet deleting a node's slices, the
scheduler allocating a claim), inject failures (the next N requests answered 5xx, a forced
conflict, the server down and back on the same port) and keep a log of every request.
"""

from __future__ import annotations

import base64
import datetime
import json
import secrets
import socket
import socketserver
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes.client
import yaml

from kubevirt_iommufd.apiserver_rules import (
    KINDS,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    STALE,
    FieldError,
    Kind,
    Object,
    SelectorError,
    build_status,
    parse_field_selector,
    parse_label_selector,
    status_conflict,
    validate_metadata,
    validate_resource_slice,
)
from kubevirt_iommufd.apiserver_store import ApiError, Event, Selection, Store
from kubevirt_iommufd.certs import build_serving_certificate

NO_RESOURCE = "the server could not find the requested resource"
NAMESPACE_MISMATCH = (
    "the namespace of the provided object does not match the namespace sent on the request"
)

Validator = Callable[[Object], list[FieldError]]
"""Checks an object a client sent (kind and apiVersion filled in); errors make it a 422."""


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    method: str
    path: str
    query: dict[str, str]
    body: Object | None
    status: int


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One `status.allocation.devices.results[]` entry of a ResourceClaim."""

    request: str
    driver: str
    pool: str
    device: str


@dataclass(slots=True)
class _Failure:
    remaining: int
    status: int
    method: str | None
    path: str | None
    retry_after: int | None


class ApiServerStandIn:
    """Start with `start()` or `with running_apiserver() as api:`; `api.api_client()` gives a
    client for it. The port is chosen on the first start and kept across `restart()`."""

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        validate: Validator | None = None,
        tls: bool = True,
        watch_timeout: float = 1800.0,
        bookmark_interval: float = 60.0,
        history_limit: int = 10_000,
    ) -> None:
        self.validate = validate
        self.watch_timeout = watch_timeout
        self.bookmark_interval = bookmark_interval
        self.token = secrets.token_urlsafe(24)
        self.store = Store(history_limit)
        self.port = 0
        self._tls = build_serving_certificate([self.host]) if tls else None
        self._server: _Server | None = None
        self._lock = threading.Lock()
        self._log: list[LoggedRequest] = []
        self._failures: list[_Failure] = []
        self._conflicts = 0

    # Lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        context = None
        if self._tls is not None:
            context = _server_context(self._tls.cert_pem, self._tls.key_pem)
        server = _Server((self.host, self.port), self, context)
        self.port = server.server_address[1]
        threading.Thread(
            target=server.serve_forever, args=(0.05,), name="apiserver-standin", daemon=True
        ).start()
        self._server = server

    def stop(self) -> None:
        """Go away as an unreachable API server does: the port closes, open connections
        (watches included) are cut mid-stream."""
        server, self._server = self._server, None
        if server is None:
            return
        server.stopping.set()
        self.store.wake()
        server.shutdown()
        server.server_close()
        server.cut_connections()

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self.host}:{self.port}"

    @property
    def ca_pem(self) -> bytes | None:
        return self._tls.ca_pem if self._tls else None

    # Clients -------------------------------------------------------------------------------------
    def configuration(self) -> kubernetes.client.Configuration:
        config = kubernetes.client.Configuration(host=self.url)
        config.api_key = {"BearerToken": self.token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        if self._tls is not None:
            config.ca_cert_data = self._tls.ca_pem.decode()
        return config

    def api_client(self) -> kubernetes.client.ApiClient:
        return kubernetes.client.ApiClient(self.configuration())

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for it (for `--kubeconfig`, or `kubernetes.config.load_kube_config`)."""
        cluster: Object = {"server": self.url}
        if self._tls is not None:
            cluster["certificate-authority-data"] = base64.b64encode(self._tls.ca_pem).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": cluster}],
            "users": [{"name": "standin", "user": {"token": self.token}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
            "current-context": "standin",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    # The rest of the cluster ---------------------------------------------------------------------
    @property
    def resource_version(self) -> int:
        return self.store.revision

    def put(self, obj: Object) -> Object:
        """Create or replace any served object (by its `kind`) without validation."""
        return self.store.put(_kind_named(obj.get("kind", "")), obj)

    def put_node(self, name: str, labels: Mapping[str, str] | None = None) -> Object:
        meta: Object = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
        return self.put({"kind": "Node", "metadata": meta, "spec": {}, "status": {}})

    def put_claim(self, claim: Object) -> Object:
        return self.put({**claim, "kind": "ResourceClaim"})

    def set_allocation(
        self,
        namespace: str,
        name: str,
        devices: Sequence[AllocatedDevice],
        node_name: str | None = None,
    ) -> Object:
        """Allocate a claim as the scheduler does (no devices: deallocate it)."""
        claim = self.store.get(RESOURCE_CLAIMS, namespace, name)
        status = claim.setdefault("status", {})
        if not devices:
            status.pop("allocation", None)
            return self.store.put(RESOURCE_CLAIMS, claim)
        allocation: Object = {
            "devices": {
                "results": [
                    {"request": d.request, "driver": d.driver, "pool": d.pool, "device": d.device}
                    for d in devices
                ]
            },
            "allocationTimestamp": datetime.datetime.now(datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ"
            ),
        }
        if node_name is not None:
            term = {"key": "metadata.name", "operator": "In", "values": [node_name]}
            allocation["nodeSelector"] = {"nodeSelectorTerms": [{"matchFields": [term]}]}
        status["allocation"] = allocation
        return self.store.put(RESOURCE_CLAIMS, claim)

    def read(self, kind: str, name: str, namespace: str = "") -> Object | None:
        try:
            return self.store.get(_kind_named(kind), namespace, name)
        except ApiError:
            return None

    def slices(self, node_name: str | None = None, driver: str | None = None) -> list[Object]:
        """The stored ResourceSlices (with kind and apiVersion), by name."""
        found = self.store.list_objects(RESOURCE_SLICES, _slice_selection(node_name, driver))[
            "items"
        ]
        return [{"kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1", **s} for s in found]

    def delete(self, kind: str, name: str, namespace: str = "") -> Object:
        return self.store.delete(_kind_named(kind), namespace, name)

    def delete_slices(self, node_name: str | None = None, driver: str | None = None) -> int:
        """Delete slices as the kubelet does (all of a node's when it starts); returns how many."""
        deleted = self.store.delete_collection(RESOURCE_SLICES, _slice_selection(node_name, driver))
        return len(deleted["items"])

    def compact(self) -> None:
        """Forget the watch history: a watch from an older resourceVersion gets 410 Expired."""
        self.store.compact()

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Wait, re-checking after every write, until `predicate()` holds; False on timeout."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            self.store.wait(self.store.revision, min(deadline, time.monotonic() + 0.1), _never)
        return True

    # Failures and the log ------------------------------------------------------------------------
    def fail_next(
        self,
        count: int = 1,
        status: int = 503,
        *,
        method: str | None = None,
        path: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the next `count` requests (of `method`, whose path contains `path`) with a
        `Status` of code `status`. With `retry_after`, the answer carries Retry-After (which
        urllib3 obeys by retrying GET, PUT and DELETE on 429 and 503 by itself)."""
        with self._lock:
            self._failures.append(_Failure(count, status, method, path, retry_after))

    def conflict_next_update(self, count: int = 1) -> None:
        """Answer the next `count` updates with 409 Conflict, as if someone wrote first."""
        with self._lock:
            self._conflicts += count

    @property
    def requests(self) -> tuple[LoggedRequest, ...]:
        with self._lock:
            return tuple(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    # Used by the request handler -----------------------------------------------------------------
    def _record(self, request: LoggedRequest) -> None:
        with self._lock:
            self._log.append(request)

    def _take_failure(self, method: str, path: str) -> _Failure | None:
        with self._lock:
            for failure in self._failures:
                if (
                    failure.remaining > 0
                    and failure.method in (None, method)
                    and (failure.path is None or failure.path in path)
                ):
                    failure.remaining -= 1
                    return failure
            return None

    def _take_conflict(self) -> bool:
        with self._lock:
            if self._conflicts > 0:
                self._conflicts -= 1
                return True
            return False

    def _checks(self, kind: Kind) -> Callable[[Object, Object | None], list[FieldError]]:
        def check(obj: Object, old: Object | None) -> list[FieldError]:
            if self.validate is not None and (errors := self.validate(obj)):
                return errors
            try:
                errors = validate_metadata(obj) if old is None else []
                if kind is RESOURCE_SLICES:
                    errors += validate_resource_slice(obj, old)
            except (TypeError, AttributeError) as e:
                # A value of the wrong type: the real server fails to decode the body.
                message = f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: {e}'  # noqa: E501
                raise ApiError(build_status(400, message)) from None
            return errors

        return check


@contextmanager
def running_apiserver(**options: Any) -> Iterator[ApiServerStandIn]:
    """An `ApiServerStandIn(**options)`, started, and stopped at the end."""
    api = ApiServerStandIn(**options)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def build_resource_claim(
    namespace: str, name: str, requests: Sequence[str], device_class: str
) -> Object:
    """A `resource.k8s.io/v1` ResourceClaim asking for one device of `device_class` per request."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {"name": r, "exactly": {"deviceClassName": device_class, "count": 1}}
                    for r in requests
                ]
            }
        },
    }


def _never() -> bool:
    return False


def _kind_named(name: str) -> Kind:
    for kind in KINDS:
        if kind.kind == name:
            return kind
    raise ValueError(
        f"the API server stand-in serves no kind {name!r}: use one of "
        + ", ".join(k.kind for k in KINDS)
    )


def _slice_selection(node_name: str | None, driver: str | None) -> Selection:
    wanted = [f"spec.nodeName={node_name}"] if node_name is not None else []
    wanted += [f"spec.driver={driver}"] if driver is not None else []
    sample: Object = {}
    return Selection(fields=tuple(parse_field_selector(",".join(wanted), RESOURCE_SLICES, sample)))


def _server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as directory:
        cert, key = Path(directory, "tls.crt"), Path(directory, "tls.key")
        cert.write_bytes(cert_pem)
        key.write_bytes(key_pem)
        context.load_cert_chain(cert, key)
    return context


# HTTP ------------------------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        standin: ApiServerStandIn,
        context: ssl.SSLContext | None,
    ) -> None:
        self.standin = standin
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
    server: _Server

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
        standin = self.server.standin
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body: Object | None = None
        watch: _Watch | None = None
        headers: dict[str, str] = {}
        try:
            body = _parse_body(raw)
            failure = standin._take_failure(method, split.path)
            if failure is not None:
                status = failure.status
                answer = build_status(
                    status, f"the API server stand-in was told to answer {status}"
                )
                if failure.retry_after is not None:
                    headers["Retry-After"] = str(failure.retry_after)
            else:
                if self.headers.get("Authorization") != f"Bearer {standin.token}":
                    raise ApiError(build_status(401, "Unauthorized"))
                route = _route(split.path)
                if route is None:
                    raise ApiError(build_status(404, NO_RESOURCE, details={}))
                if method == "GET" and route.name is None and query.get("watch") in ("true", "1"):
                    watch = _plan_watch(route, query, standin.watch_timeout)
                    status, answer = 200, {}
                else:
                    status, answer = self._dispatch(method, route, query, body)
        except ApiError as e:
            status, answer = e.code, e.status
        # Logged before answering, so the log has a request once its client has the answer.
        standin._record(LoggedRequest(method, split.path, query, body, status))
        try:
            if watch is not None:
                self._watch(watch)
            else:
                self._send_json(status, answer, headers)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _dispatch(
        self, method: str, route: _Route, query: dict[str, str], body: Object | None
    ) -> tuple[int, Object]:
        store, kind = self.server.standin.store, route.kind
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
                return 201, store.create(kind, namespace, obj, self.server.standin._checks(kind))
            if method == "DELETE":
                return 200, store.delete_collection(kind, _selection(route, query))
        elif method == "GET":
            return 200, store.get(kind, namespace, route.name)
        elif method == "PUT":
            obj = _sent_object(kind, body)
            if self.server.standin._take_conflict():
                raise ApiError(status_conflict(kind, route.name, STALE))
            return 200, store.update(
                kind, namespace, route.name, obj, self.server.standin._checks(kind)
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

    def _watch(self, watch: _Watch) -> None:
        store, kind, selection = self.server.standin.store, watch.kind, watch.selection
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
        next_bookmark = time.monotonic() + self.server.standin.bookmark_interval
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
                next_bookmark = now + self.server.standin.bookmark_interval
            wake = min(deadline, next_bookmark) if bookmarks else deadline
            store.wait(cursor, wake, self.server.stopping.is_set)
        if not self.server.stopping.is_set():
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _chunk(self, event: Object) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(self, status: int, obj: Object, headers: Mapping[str, str] = {}) -> None:
        data = json.dumps(obj).encode()
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
