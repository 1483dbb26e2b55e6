"""The few API calls the driver makes, with answers as plain JSON objects and failures as errors
that say what to do.

Calls go through a `KubeConnection` (`hostdev.labels.kube_connection`: the URL, the pool, the
authentication, from the service account or a kubeconfig); `api_http` sends them and reads the
answers, each call under an overall deadline and a cap on its size. The driver works on the
objects' JSON shape, which the API defines, rather than the official client's generated classes.

The connection and the HTTP stack (urllib3) load with the first call, not with this module: the
driver answers the kubelet before any of it is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote

from dra.api_types import ApiError, MiB, Object

if TYPE_CHECKING:
    from kubernetes import client

    from hostdev.labels.kube_connection import KubeConnection

__all__ = ["ApiError", "ResourceApi"]
CALL_SECONDS = 10.0
"""Each call's whole time, from connecting to the last byte. The kubelet gives a DRA driver 45 s
for all of a NodePrepareResources call (`defaultClientCallTimeout`, kubernetes
pkg/kubelet/cm/dra/plugin/dra_plugin.go), which may GET more than one claim and then bind."""
WATCH_GRACE_SECONDS = 30.0
"""A watch asks the server to end it after `timeout_seconds`; one still open this much later is
cut. There is no idle rule: a watch only wakes the publisher early, the resync every minute does
not depend on it, so a silent watch costs nothing but one thread's wait."""
MAX_OBJECT_BYTES = 4 * MiB
"""An object or a watch event. The API server refuses request bodies over 3 MiB
(`MaxRequestBodyBytes`, k8s.io/apiserver/pkg/server/config.go) and etcd stores at most 1.5 MiB
per object by default; a claim holds at most 32 allocation results (`AllocationResultsMaxSize`,
k8s.io/api/resource/v1). 4 MiB leaves room for what the server adds (managedFields) while a
hostile answer costs at most a few tens of MB once decoded."""
MAX_LIST_BYTES = 16 * MiB
"""A list of this node's slices: a few objects, each under MAX_OBJECT_BYTES."""
RESOURCE = "/apis/resource.k8s.io/v1"


class ResourceApi:
    """Nodes, ResourceClaims and ResourceSlices, as the driver needs them, through `connection`
    or, made with `loading`, through the connection its loader makes at the first call."""

    def __init__(
        self,
        connection: KubeConnection | client.ApiClient | None = None,
        *,
        call_seconds: float = CALL_SECONDS,
    ) -> None:
        self._connection = None if connection is None else _with_deadlines(connection)
        self._loader: Callable[[], KubeConnection] | None = None
        self._lock = threading.Lock()
        self._seconds = call_seconds

    @classmethod
    def loading(
        cls, loader: Callable[[], KubeConnection], *, call_seconds: float = CALL_SECONDS
    ) -> ResourceApi:
        """Calls through the connection `loader` makes when first needed (by `load` or a call)."""
        api = cls(call_seconds=call_seconds)
        api._loader = loader
        return api

    def load(self) -> KubeConnection:
        """The connection, made now if it was not yet; the loader's error if it cannot be made
        (a call gets that error as an ApiError)."""
        with self._lock:
            if self._connection is None:
                if self._loader is None:
                    raise ValueError("a ResourceApi needs a connection or a loader")
                self._connection = _with_deadlines(self._loader())
            return self._connection

    def read_node_uid(self, name: str) -> str:
        what = f"get node {name}"
        node = self._call(what, "GET", f"/api/v1/nodes/{quote(name, safe='')}")
        uid = _metadata(node).get("uid")
        if not isinstance(uid, str) or not uid:
            raise ApiError(f"{what}: the answer has no metadata.uid")
        return uid

    def read_claim(self, namespace: str, name: str) -> Object:
        return self._call(
            f"get resourceclaim {namespace}/{name}",
            "GET",
            f"{RESOURCE}/namespaces/{quote(namespace, safe='')}/resourceclaims/"
            f"{quote(name, safe='')}",
        )

    def list_slices(self, node: str, driver: str) -> tuple[list[Object], str]:
        """This node's slices of this driver, and the list's resourceVersion to watch from."""
        from dra.api_http import query_of

        what = "list resourceslices"
        listing = self._call(
            what,
            "GET",
            f"{RESOURCE}/resourceslices",
            query=query_of({"fieldSelector": _slice_selector(node, driver)}),
            limit=MAX_LIST_BYTES,
        )
        items = listing.get("items") or []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ApiError(f"{what}: the answer's items are not a list of objects")
        return items, str(_metadata(listing).get("resourceVersion") or "")

    def create_slice(self, item: Object) -> Object:
        return self._call(
            f"create resourceslice {_name_of(item)}",
            "POST",
            f"{RESOURCE}/resourceslices",
            body=item,
        )

    def replace_slice(self, item: Object) -> Object:
        name = _name_of(item)
        return self._call(
            f"update resourceslice {name}",
            "PUT",
            f"{RESOURCE}/resourceslices/{quote(name, safe='')}",
            body=item,
        )

    def delete_slice(self, name: str, resource_version: str) -> None:
        preconditions = {"resourceVersion": resource_version} if resource_version else {}
        try:
            self._call(
                f"delete resourceslice {name}",
                "DELETE",
                f"{RESOURCE}/resourceslices/{quote(name, safe='')}",
                body={"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": preconditions},
            )
        except ApiError as error:
            if not error.not_found:
                raise

    def watch_slices(
        self, node: str, driver: str, resource_version: str, timeout_seconds: int
    ) -> Iterator[tuple[str, Object]]:
        """Events on this node's slices of this driver, from `resource_version`, until the
        server ends the watch (at most `timeout_seconds`, cut WATCH_GRACE_SECONDS later)."""
        from dra.api_http import parse_event, query_of, stream_lines

        what = "watch resourceslices"
        connection = self._loaded(what)
        query = query_of(
            {
                "fieldSelector": _slice_selector(node, driver),
                "watch": True,
                "resourceVersion": resource_version,
                "allowWatchBookmarks": True,
                "timeoutSeconds": timeout_seconds,
            }
        )
        for line in stream_lines(
            connection,
            what,
            f"{RESOURCE}/resourceslices",
            seconds=timeout_seconds + WATCH_GRACE_SECONDS,
            limit=MAX_OBJECT_BYTES,
            query=query,
        ):
            if line.strip():
                yield parse_event(what, line)

    def _call(
        self,
        what: str,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Object | None = None,
        limit: int = MAX_OBJECT_BYTES,
    ) -> Object:
        from dra.api_http import call

        return call(
            self._loaded(what),
            what,
            method,
            path,
            seconds=self._seconds,
            limit=limit,
            query=query or [],
            body=body,
        )

    def _loaded(self, what: str) -> KubeConnection:
        from hostdev.labels.kube_connection import ApiConfigError

        try:
            return self.load()
        except ApiConfigError as error:
            raise ApiError(f"{what}: no API server configuration: {error}") from error


def _with_deadlines(connection: KubeConnection | client.ApiClient) -> KubeConnection:
    """The connection, its pool's connections cut at each call's deadline; an official client
    (tests', the demo's) as a connection through its configuration and pool."""
    from dra.api_http import install_deadlines
    from hostdev.labels.kube_connection import KubeConnection, connection_of

    if not isinstance(connection, KubeConnection):
        connection = connection_of(connection)
    install_deadlines(connection.pool)
    return connection


def _slice_selector(node: str, driver: str) -> str:
    return f"spec.nodeName={node},spec.driver={driver}"


def _metadata(obj: Object) -> Object:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _name_of(item: Object) -> str:
    return str(_metadata(item).get("name", ""))
