"""`--label-node`: the node labels written to the Node object itself, through the API server with
the official `kubernetes` client (RBAC: `nodes` `get` and `patch`).

Each change is a JSON merge patch of `metadata.labels` naming only keys under
`kubevirt-iommufd.io/` (`hostdev.labels.node_labels.build_node_label_patch`): ours are set or
removed, every other label is never in the request. The API may be slow, away or answer
anything at all, so a thread of its own does the calls and retries every failure with backoff,
saying each once while it repeats; the component's own work never waits for it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hostdev.labels.node_labels import NodeShapeError, build_node_label_patch

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT = (5.0, 10.0)
_RETRY_FIRST = 1.0
_RETRY_MAX = 60.0


class NodeLabelError(Exception):
    """A read or patch of the Node failed; the message says which and why."""


class NodeLabeler:
    """Keeps the Node's labels of ours equal to the last `publish`ed set."""

    def __init__(
        self,
        api_client: client.ApiClient,
        node_name: str,
        *,
        retry_first: float = _RETRY_FIRST,
        retry_max: float = _RETRY_MAX,
    ) -> None:
        self.node_name = node_name
        self._core = client.CoreV1Api(api_client)
        self._retry_first = retry_first
        self._retry_max = retry_max
        self._lock = threading.Lock()
        self._wanted: dict[str, str] | None = None
        self._applied: dict[str, str] | None = None
        self._failure: str | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-labels", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish(self, labels: Mapping[str, str]) -> None:
        with self._lock:
            self._wanted = dict(labels)
        self._wake.set()

    def close(self, timeout: float = 10.0) -> None:
        """Stop, and take our labels off the Node (one try: a clean stop must not hang)."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        try:
            self.sync({})
        except NodeLabelError as error:
            log.warning("cannot remove the node labels node=%s: %s", self.node_name, error)

    def sync(self, wanted: Mapping[str, str]) -> None:
        """Read the Node and patch what differs from `wanted` (nothing when nothing does)."""
        node = self._call("get", self._core.read_node, self.node_name)
        try:
            patch = build_node_label_patch(node, wanted)
        except NodeShapeError as error:
            raise NodeLabelError(f"get node {self.node_name}: {error}") from None
        if patch:
            self._call(
                "patch",
                self._core.patch_node,
                self.node_name,
                {"metadata": {"labels": patch}},
                _content_type=MERGE_PATCH,
            )
            log.info(
                "node labels patched node=%s set=%d removed=%d",
                self.node_name,
                sum(v is not None for v in patch.values()),
                sum(v is None for v in patch.values()),
            )
        with self._lock:
            self._applied = dict(wanted)

    def _run(self) -> None:
        delay = self._retry_first
        while not self._stopping.is_set():
            with self._lock:
                wanted = self._wanted
                pending = wanted is not None and wanted != self._applied
            if not pending or wanted is None:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.sync(wanted)
            # Any failure, not only the API's: later changes must still be applied.
            except Exception as error:
                self._report(error, delay)
                self._wake.clear()
                self._stopping.wait(delay)
                delay = min(delay * 2, self._retry_max)
                continue
            if self._failure is not None:
                log.info("node labels applied again node=%s", self.node_name)
            self._failure = None
            delay = self._retry_first

    def _report(self, error: Exception, delay: float) -> None:
        """A failure is said once while it repeats (at DEBUG after that), not every retry."""
        expected = isinstance(error, NodeLabelError)
        said = str(error) if expected else f"{type(error).__name__}: {error}"
        level = logging.DEBUG if said == self._failure else logging.WARNING
        self._failure = said
        log.log(
            level,
            "node labels not applied node=%s: %s; retrying in %.1f s",
            self.node_name,
            said,
            delay,
            exc_info=not expected and level == logging.WARNING,
        )

    def _call(self, verb: str, method: Any, *args: Any, **kwargs: Any) -> object:
        try:
            response = method(
                *args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs
            )
            answer: object = json.loads(response.data)
        except ApiException as error:
            raise NodeLabelError(_explain(verb, self.node_name, error)) from None
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as error:
            # The server unreachable (after urllib3's retries), or a body that is not JSON.
            raise NodeLabelError(f"{verb} node {self.node_name}: {error}") from None
        except RecursionError:
            raise NodeLabelError(
                f"{verb} node {self.node_name}: the answer is JSON nested too deep to read"
            ) from None
        return answer


def _explain(verb: str, node: str, error: ApiException) -> str:
    status = error.status
    if status in (401, 403):
        return (
            f"{verb} node {node}: HTTP {status}; --label-node needs RBAC to get and patch nodes"
            " (docs/node-labels.md)"
        )
    if status == 404:
        return f"{verb} node {node}: no such Node; check --node-name (or NODE_NAME)"
    return f"{verb} node {node}: HTTP {status} {error.reason}"
