"""The few API calls the driver makes, with answers as plain JSON objects and failures as errors
that say what to do.

Requests are built and authenticated by the official `kubernetes` client and sent through its
connection pool; `api_http` reads the answers, each call under an overall deadline and a cap on
its size. The driver works on the objects' JSON shape, which the API defines, rather than the
client's generated classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

from kubernetes import client

from dra.api_http import (
    ApiError,
    MiB,
    Object,
    call,
    install_deadlines,
    parse_event,
    query_of,
    stream_lines,
)

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
    """Nodes, ResourceClaims and ResourceSlices, as the driver needs them."""

    def __init__(self, api_client: client.ApiClient, *, call_seconds: float = CALL_SECONDS) -> None:
        install_deadlines(api_client)
        self._client = api_client
        self._seconds = call_seconds

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
        what = "watch resourceslices"
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
            self._client,
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
        return call(
            self._client,
            what,
            method,
            path,
            seconds=self._seconds,
            limit=limit,
            query=query or [],
            body=body,
        )


def _slice_selector(node: str, driver: str) -> str:
    return f"spec.nodeName={node},spec.driver={driver}"


def _metadata(obj: Object) -> Object:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _name_of(item: Object) -> str:
    return str(_metadata(item).get("name", ""))
