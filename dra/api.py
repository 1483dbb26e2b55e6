"""The few API calls the driver makes, through the official `kubernetes` client, with answers as
plain JSON objects and failures as errors that say what to do.

Responses are read raw (`_preload_content=False`) and decoded with `json`: the driver works on
the objects' JSON shape, which the API defines, rather than the client's generated classes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)
Object = dict[str, Any]
REQUEST_TIMEOUT = (5.0, 15.0)
"""Connect and read timeouts of one call: well inside the kubelet's 45 s for NodePrepare."""


class ApiError(Exception):
    """A call failed; `status` is the HTTP status, or None when the server was not reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404


class ResourceApi:
    """Nodes, ResourceClaims and ResourceSlices, as the driver needs them."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._core = client.CoreV1Api(api_client)
        self._resource = client.ResourceV1Api(api_client)

    def read_node_uid(self, name: str) -> str:
        node = self._call(f"get node {name}", self._core.read_node, name)
        return str(node["metadata"]["uid"])

    def read_claim(self, namespace: str, name: str) -> Object:
        return self._call(
            f"get resourceclaim {namespace}/{name}",
            self._resource.read_namespaced_resource_claim,
            name,
            namespace,
        )

    def list_slices(self, node: str, driver: str) -> tuple[list[Object], str]:
        """This node's slices of this driver, and the list's resourceVersion to watch from."""
        listing = self._call(
            "list resourceslices",
            self._resource.list_resource_slice,
            field_selector=f"spec.nodeName={node},spec.driver={driver}",
        )
        return list(listing.get("items") or []), str(listing["metadata"].get("resourceVersion", ""))

    def create_slice(self, item: Object) -> Object:
        return self._call(
            f"create resourceslice {item['metadata']['name']}",
            self._resource.create_resource_slice,
            item,
        )

    def replace_slice(self, item: Object) -> Object:
        name = item["metadata"]["name"]
        return self._call(
            f"update resourceslice {name}", self._resource.replace_resource_slice, name, item
        )

    def delete_slice(self, name: str, resource_version: str) -> None:
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=resource_version or None)
        )
        try:
            self._call(
                f"delete resourceslice {name}",
                self._resource.delete_resource_slice,
                name,
                body=options,
            )
        except ApiError as error:
            if not error.not_found:
                raise

    def watch_slices(
        self, node: str, driver: str, resource_version: str, timeout_seconds: int
    ) -> Iterator[tuple[str, Object]]:
        """Events on this node's slices of this driver, from `resource_version`, until the
        server ends the watch (at most `timeout_seconds`)."""
        what = "watch resourceslices"
        try:
            response: Any = self._resource.list_resource_slice(
                field_selector=f"spec.nodeName={node},spec.driver={driver}",
                watch=True,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                _preload_content=False,
                _request_timeout=(REQUEST_TIMEOUT[0], timeout_seconds + REQUEST_TIMEOUT[1]),
            )
        except ApiException as error:
            raise _api_error(what, error) from None
        except urllib3.exceptions.HTTPError as error:
            raise ApiError(f"{what}: API server unreachable ({error})") from None
        try:
            for line in iter_resp_lines(response):
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, item = str(event.get("type")), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiError(f"{what}: {item.get('message', 'error')}", item.get("code"))
                yield kind, item
        except urllib3.exceptions.HTTPError as error:
            raise ApiError(f"{what}: connection lost ({error})") from None
        except ValueError as error:
            raise ApiError(f"{what}: an event is not JSON ({error})") from None
        finally:
            response.release_conn()

    @staticmethod
    def _call(what: str, method: Any, *args: Any, **kwargs: Any) -> Object:
        try:
            response = method(
                *args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs
            )
            # Reading the body is network IO too: a reset or a timeout can come here.
            data: Object = json.loads(response.data or b"{}")
        except ApiException as error:
            raise _api_error(what, error) from None
        except urllib3.exceptions.HTTPError as error:
            raise ApiError(f"{what}: API server unreachable ({error})") from None
        except ValueError as error:
            raise ApiError(f"{what}: the answer is not JSON ({error})") from None
        return data


def _api_error(what: str, error: ApiException) -> ApiError:
    status = int(error.status) if error.status else None
    message = ""
    try:
        message = str(json.loads(error.body or "{}").get("message", ""))
    except (ValueError, AttributeError):
        message = str(error.reason or "")
    hint = {
        401: "the driver's credentials were refused",
        403: "RBAC denies it: grant the driver's service account this verb (docs/dra.md)",
        404: "not found",
        409: "conflict",
    }.get(status or 0, f"HTTP {status}")
    return ApiError(f"{what}: {hint}" + (f" ({message})" if message else ""), status)
