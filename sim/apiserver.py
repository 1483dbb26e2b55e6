"""A Kubernetes API server stand-in on loopback, for the DRA driver's tests and demo: the real
`kubernetes` client talks to it over HTTPS with a bearer token, as it would to a cluster.

It serves, with the real server's status codes and `Status` bodies:
- `GET /api/v1/nodes[/{name}]` (nodes are seeded with `put_node`), and JSON merge patches
  (`application/merge-patch+json`) of any named object;
- `resource.k8s.io/v1` ResourceClaims: get and list (claims are seeded with `put_claim` and
  allocated with `set_allocation`, as the scheduler would; `allocatable` says which devices it
  could pick, leaving out those with a taint the request does not tolerate);
- `resource.k8s.io/v1` ResourceSlices: list (field selectors `metadata.name`, `spec.nodeName`,
  `spec.driver`, label selectors, `limit`/`continue`), watch (chunked JSON events from a
  resourceVersion, `timeoutSeconds`, bookmarks, 410 Expired after `compact()`), get, create
  (`generateName`, 409 AlreadyExists), update (409 Conflict on a stale resourceVersion), delete
  (preconditions) and deletecollection;
- 422 Invalid for objects that break the ResourceSlice rules the real server enforces, or that
  the optional `validate` callback (e.g. the official OpenAPI schema) refuses;
- a device taint's `timeAdded` stamped when a write leaves it out, and (`device_taints=False`)
  taints dropped as by a server whose DRADeviceTaints feature gate is off.

Test controls act as the rest of the cluster would (the kubelet deleting a node's slices, the
scheduler allocating a claim), inject failures (the next N requests answered 5xx, a forced
conflict, the server down and back on the same port), misbehave as a hostile server would (for
tests only: trickled, hung and huge answers) and keep a log of every request.

The HTTP side is `apiserver_http`, storage semantics `apiserver_store`, the server's decisions
(Status bodies, selectors, validation) `apiserver_rules`.
"""

from __future__ import annotations

import base64
import datetime
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.client
import yaml

from sim.apiserver_http import (
    HOSTILE,
    ApiHttpServer,
    Failure,
    LoggedRequest,
    Misbehaviour,
    build_server_context,
)
from sim.apiserver_rules import (
    KINDS,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    FieldError,
    Kind,
    Object,
    build_allocatable,
    build_status,
    parse_field_selector,
    validate_metadata,
    validate_resource_slice,
)
from sim.apiserver_store import ApiError, Checks, Selection, Store
from webhook.certs import build_serving_certificate

_Planned = TypeVar("_Planned", Failure, Misbehaviour)
Validator = Callable[[Object], list[FieldError]]
"""Checks an object a client sent (kind and apiVersion filled in); errors make it a 422."""


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One `status.allocation.devices.results[]` entry of a ResourceClaim."""

    request: str
    driver: str
    pool: str
    device: str


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
        device_taints: bool = True,
    ) -> None:
        """`device_taints=False`: a server with the DRADeviceTaints feature gate off, which
        drops the taints of slices it is sent."""
        self.validate = validate
        self.watch_timeout = watch_timeout
        self.bookmark_interval = bookmark_interval
        self.token = secrets.token_urlsafe(24)
        self.store = Store(history_limit, device_taints)
        self.port = 0
        self._tls = build_serving_certificate([self.host]) if tls else None
        self._server: ApiHttpServer | None = None
        self._lock = threading.Lock()
        self._log: list[LoggedRequest] = []
        self._failures: list[Failure] = []
        self._misbehaviours: list[Misbehaviour] = []
        self._conflicts = 0

    # Lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        context = None
        if self._tls is not None:
            context = build_server_context(self._tls.cert_pem, self._tls.key_pem)
        server = ApiHttpServer((self.host, self.port), self, context)
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

    def allocatable(
        self, node_name: str, driver: str, tolerations: Sequence[Object] = ()
    ) -> list[str]:
        """The devices of the node's pool the scheduler would allocate to a request with these
        `tolerations` (`DeviceToleration`s), as `build_allocatable` decides."""
        return build_allocatable(self.slices(node_name, driver), tolerations)

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
            self._failures.append(Failure(count, status, method, path, retry_after))

    def misbehave(
        self,
        how: str,
        count: int = 1,
        *,
        method: str | None = None,
        path: str | None = None,
        interval: float = 2.0,
        size: int = 256 * 1024 * 1024,
        chunked: bool = False,
    ) -> None:
        """Test only: answer the next `count` requests (of `method`, whose path contains `path`)
        as a hostile or broken server would:
        - `trickle`: the real answer, one byte every `interval` seconds;
        - `hang`: nothing, until the stand-in stops;
        - `huge`: the real answer padded to a body of `size` bytes, with Content-Length or,
          with `chunked`, without."""
        if how not in HOSTILE:
            raise ValueError(f"misbehave: {how!r} is none of {', '.join(HOSTILE)}")
        with self._lock:
            self._misbehaviours.append(
                Misbehaviour(count, how, method, path, interval, size, chunked)
            )

    def conflict_next_update(self, count: int = 1) -> None:
        """Answer the next `count` updates with 409 Conflict, as if someone wrote first."""
        with self._lock:
            self._conflicts += count

    def answer_next(
        self,
        body: bytes,
        count: int = 1,
        status: int = 200,
        *,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        """Answer the next `count` requests (of `method`, whose path contains `path`) with `body`
        as is, as a broken server or a proxy in front of one might: not JSON, or JSON of any
        shape."""
        with self._lock:
            self._failures.append(Failure(count, status, method, path, None, body))

    @property
    def requests(self) -> tuple[LoggedRequest, ...]:
        with self._lock:
            return tuple(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    # Used by the HTTP side (apiserver_http.Backend) ------------------------------------------
    def record(self, request: LoggedRequest) -> None:
        with self._lock:
            self._log.append(request)

    def take_failure(self, method: str, path: str) -> Failure | None:
        with self._lock:
            return _take(self._failures, method, path)

    def take_misbehaviour(self, method: str, path: str) -> Misbehaviour | None:
        with self._lock:
            return _take(self._misbehaviours, method, path)

    def take_conflict(self) -> bool:
        with self._lock:
            if self._conflicts > 0:
                self._conflicts -= 1
                return True
            return False

    def checks(self, kind: Kind) -> Checks:
        def check(obj: Object, old: Object | None) -> list[FieldError]:
            if self.validate is not None and (errors := self.validate(obj)):
                return errors
            try:
                errors = validate_metadata(obj) if old is None else []
                if kind is RESOURCE_SLICES:
                    errors += validate_resource_slice(obj, old)
            except (TypeError, AttributeError) as e:
                # A value of the wrong type: the real server fails to decode the body.
                message = (
                    f'{kind.kind} in version "{kind.version}" cannot be handled as a'
                    f" {kind.kind}: {e}"
                )
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


def _take(planned: Sequence[_Planned], method: str, path: str) -> _Planned | None:
    """The first planned answer with uses left that applies to this request, one use spent."""
    for answer in planned:
        if (
            answer.remaining > 0
            and answer.method in (None, method)
            and (answer.path is None or answer.path in path)
        ):
            answer.remaining -= 1
            return answer
    return None


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
