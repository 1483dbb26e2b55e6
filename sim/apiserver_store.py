"""The API server's storage semantics in memory: one resourceVersion counter for everything (as
etcd's revision), uid and creationTimestamp on create, optimistic concurrency on update, a no-op
update that writes nothing, deleted objects returned, and a bounded event history that watches
read from (older versions answer 410 Expired, as after a compaction).

Thread-safe; no IO. The HTTP side (`sim.apiserver`) maps requests onto it and `ApiError`s
onto responses.
"""

from __future__ import annotations

import base64
import bisect
import datetime
import json
import pickle
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sim.apiserver_rules import (
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    STALE,
    FieldError,
    Kind,
    Object,
    Requirement,
    build_status,
    default_resource_slice,
    drop_disabled_slice_fields,
    status_already_exists,
    status_conflict,
    status_expired,
    status_invalid,
    status_not_found,
)

Checks = Callable[[Object, Object | None], list[FieldError]]
"""Validation run on a client's object (and the stored one, on update): errors mean 422."""

_GENERATED_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery utilrand


class ApiError(Exception):
    """A request the server refuses; `status` is the `Status` body it answers with."""

    def __init__(self, status: Object) -> None:
        super().__init__(status["message"])
        self.status = status
        self.code: int = status["code"]


@dataclass(frozen=True, slots=True)
class Event:
    resource_version: int
    type: str  # ADDED, MODIFIED or DELETED
    kind: Kind
    object: Object
    old: Object | None


@dataclass(frozen=True, slots=True)
class Selection:
    """What a list, watch or deletecollection is restricted to."""

    namespace: str | None = None
    fields: tuple[Requirement, ...] = ()
    labels: tuple[Requirement, ...] = ()

    def matches(self, kind: Kind, obj: Object) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        found = kind.selectable(obj)
        labels = meta.get("labels") or {}
        return all(r.matches(found) for r in self.fields) and all(
            r.matches(labels) for r in self.labels
        )


class Store:
    def __init__(self, history_limit: int = 10_000, device_taints: bool = True) -> None:
        self.changed = threading.Condition()
        self._device_taints = device_taints
        self._objects: dict[tuple[str, str, str], Object] = {}
        self._history: list[Event] = []
        self._history_limit = history_limit
        self._revision = 100
        self._oldest = self._revision  # a watch may start at this version or later

    @property
    def revision(self) -> int:
        with self.changed:
            return self._revision

    # Reads ---------------------------------------------------------------------------------------
    def get(self, kind: Kind, namespace: str, name: str) -> Object:
        with self.changed:
            found = self._objects.get((kind.resource, namespace, name))
            if found is None:
                raise ApiError(status_not_found(kind, name))
            return _copied(found)

    def list_objects(
        self, kind: Kind, selection: Selection, limit: int = 0, continue_token: str = ""
    ) -> Object:
        """A `<Kind>List` in key order, `limit` items at a time with a `continue` token."""
        start = _decode_continue(continue_token) if continue_token else ""
        with self.changed:
            keys = sorted(
                key
                for key, obj in self._objects.items()
                if key[0] == kind.resource and selection.matches(kind, obj)
            )
            keys = [k for k in keys if f"{k[1]}/{k[2]}" > start]
            page = keys[:limit] if limit > 0 else keys
            items = [_copied(self._objects[k]) for k in page]
            meta: Object = {"resourceVersion": str(self._revision)}
            if len(page) < len(keys):
                last = page[-1]
                meta["continue"] = _encode_continue(self._revision, f"{last[1]}/{last[2]}")
                meta["remainingItemCount"] = len(keys) - len(page)
        for item in items:
            # The real server leaves kind and apiVersion off list items (kubernetes#3030).
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": meta,
            "items": items,
        }

    # Writes --------------------------------------------------------------------------------------
    def create(
        self, kind: Kind, namespace: str, body: Object, checks: Checks | None = None
    ) -> Object:
        """Store a copy of `body`; the answer is the object stored: read it, never change it."""
        obj = _decoded(kind, body)
        meta = obj.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            raise ApiError(
                build_status(
                    500,
                    "Internal error occurred: resourceVersion should not be set on objects to be"
                    " created",
                )
            )
        if kind.namespaced:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"][:58] + "".join(
                secrets.choice(_GENERATED_NAME_CHARS) for _ in range(5)
            )
        if kind is RESOURCE_CLAIMS:
            obj.pop("status", None)  # status is a subresource: a create cannot set it
        if kind is RESOURCE_SLICES and not self._device_taints:
            drop_disabled_slice_fields(obj, None)
        self._check(kind, obj, None, checks)
        with self.changed:
            key = (kind.resource, namespace if kind.namespaced else "", meta["name"])
            if key in self._objects:
                raise ApiError(status_already_exists(kind, meta["name"]))
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            if kind.group:
                meta["generation"] = 1
            return self._write(kind, key, obj, "ADDED", None)

    def update(
        self, kind: Kind, namespace: str, name: str, body: Object, checks: Checks | None = None
    ) -> Object:
        """As `create`: the answer is the object stored."""
        obj = _decoded(kind, body)
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            raise ApiError(
                build_status(
                    400,
                    f"the name of the object ({meta.get('name')}) does not match the name on"
                    f" the URL ({name})",
                )
            )
        with self.changed:
            key = (kind.resource, namespace if kind.namespaced else "", name)
            old = self._objects.get(key)
            if old is None:
                raise ApiError(status_not_found(kind, name))
            old_meta = old["metadata"]
            _check_preconditions(
                kind, name, old_meta, meta.get("uid"), meta.get("resourceVersion"), STALE
            )
            for field in ("uid", "creationTimestamp", "namespace"):
                if field in old_meta:
                    meta[field] = old_meta[field]
            meta["resourceVersion"] = old_meta["resourceVersion"]
            if "generation" in old_meta:
                changed = obj.get("spec") != old.get("spec")
                meta["generation"] = old_meta["generation"] + int(changed)
            if kind is RESOURCE_SLICES and not self._device_taints:
                drop_disabled_slice_fields(obj, old)
            if kind is RESOURCE_CLAIMS:
                obj["status"] = _copied(old.get("status", {}))
            self._check(kind, obj, old, checks)
            if obj == old:
                return old  # etcd writes nothing: no new version, no event
            return self._write(kind, key, obj, "MODIFIED", old)

    def put(self, kind: Kind, obj: Object) -> Object:
        """Create or replace without checks, as another component of the cluster would."""
        meta = obj.get("metadata", {})
        key = (kind.resource, meta.get("namespace", "") if kind.namespaced else "", meta["name"])
        with self.changed:
            old = self._objects.get(key)
            new = _copied(obj)
            new["kind"], new["apiVersion"] = kind.kind, kind.api_version
            new_meta = new["metadata"]
            if old is None:
                new_meta.setdefault("uid", str(uuid.uuid4()))
                new_meta.setdefault("creationTimestamp", _now())
                if kind.group:
                    new_meta.setdefault("generation", 1)
            else:
                for field in ("uid", "creationTimestamp", "generation"):
                    if field in old["metadata"]:
                        new_meta.setdefault(field, old["metadata"][field])
            return _copied(self._write(kind, key, new, "ADDED" if old is None else "MODIFIED", old))

    def delete(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> Object:
        with self.changed:
            key = (kind.resource, namespace if kind.namespaced else "", name)
            old = self._objects.get(key)
            if old is None:
                raise ApiError(status_not_found(kind, name))
            _check_preconditions(
                kind,
                name,
                old["metadata"],
                uid,
                resource_version,
                f"Precondition failed: ResourceVersion in precondition: {resource_version},"
                f" ResourceVersion in object meta: {old['metadata']['resourceVersion']}",
            )
            self._remove(kind, key)
            return _copied(old)

    def delete_collection(self, kind: Kind, selection: Selection) -> Object:
        with self.changed:
            keys = sorted(
                k
                for k, obj in self._objects.items()
                if k[0] == kind.resource and selection.matches(kind, obj)
            )
            items = [_copied(self._objects[k]) for k in keys]
            for key in keys:
                self._remove(kind, key)
            revision = self._revision
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(revision)},
            "items": items,
        }

    # Watch history -------------------------------------------------------------------------------
    def events_after(self, kind: Kind, resource_version: int) -> tuple[list[Event], int]:
        """Events of `kind` newer than `resource_version`, and the version they bring a watcher
        to; 410 Expired once `resource_version` is older than the history."""
        with self.changed:
            if resource_version < self._oldest:
                raise ApiError(status_expired(resource_version, self._oldest))
            start = bisect.bisect_right(
                self._history, resource_version, key=lambda e: e.resource_version
            )
            return [e for e in self._history[start:] if e.kind is kind], self._revision

    def compact(self) -> None:
        """Forget the history, as etcd's compaction does: watches from before now get 410."""
        with self.changed:
            self._history.clear()
            self._oldest = self._revision

    def wait(self, after: int, deadline: float, stopped: Callable[[], bool]) -> None:
        """Block until something newer than `after` is written, `deadline` passes or stopped()."""
        with self.changed:
            while self._revision <= after and not stopped():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.changed.wait(left)

    def wake(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # Internals -----------------------------------------------------------------------------------
    def _check(self, kind: Kind, obj: Object, old: Object | None, checks: Checks | None) -> None:
        if checks is None:
            return
        errors = checks(obj, old)
        if errors:
            meta = obj.get("metadata", {})
            name = meta.get("name") or meta.get("generateName") or ""
            raise ApiError(status_invalid(kind, name, errors))

    def _write(
        self, kind: Kind, key: tuple[str, str, str], obj: Object, type_: str, old: Object | None
    ) -> Object:
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        self._objects[key] = obj
        # Stored objects are replaced, never changed: the event holds the one stored, and a
        # writer's answer is that object too.
        self._record(Event(self._revision, type_, kind, obj, old))
        return obj

    def _remove(self, kind: Kind, key: tuple[str, str, str]) -> None:
        old = self._objects.pop(key)
        self._revision += 1
        gone = _copied(old)
        gone["metadata"]["resourceVersion"] = str(self._revision)
        self._record(Event(self._revision, "DELETED", kind, gone, old))

    def _record(self, event: Event) -> None:
        self._history.append(event)
        if len(self._history) > self._history_limit:
            dropped = self._history.pop(0)
            self._oldest = dropped.resource_version
        self.changed.notify_all()


def _copied(obj: Object) -> Object:
    """A deep copy of an object: through pickle, three times as fast as `copy.deepcopy` on a
    slice of 128 devices (the store copies each object it takes and gives)."""
    copied: Object = pickle.loads(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))  # noqa: S301 - its own bytes
    return copied


def _decoded(kind: Kind, body: Object) -> Object:
    """A client's object as the server holds it once decoded: its own copy (the request log
    keeps the body as sent), kind and apiVersion set, defaults filled in."""
    obj = _copied(body)
    obj["kind"], obj["apiVersion"] = kind.kind, kind.api_version
    if kind is RESOURCE_SLICES:
        default_resource_slice(obj, _now())
    return obj


def _check_preconditions(
    kind: Kind,
    name: str,
    meta: Object,
    uid: str | None,
    resource_version: str | None,
    stale: str,
) -> None:
    if uid and uid != meta["uid"]:
        raise ApiError(
            status_conflict(
                kind,
                name,
                f"Precondition failed: UID in precondition: {uid}, UID in object meta:"
                f" {meta['uid']}",
            )
        )
    if resource_version and resource_version != meta["resourceVersion"]:
        raise ApiError(status_conflict(kind, name, stale))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _encode_continue(revision: int, last_key: str) -> str:
    token = {"v": "meta.k8s.io/v1", "rv": revision, "start": last_key + "\x00"}
    return base64.urlsafe_b64encode(json.dumps(token).encode()).decode().rstrip("=")


def _decode_continue(token: str) -> str:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        start = decoded["start"]
    except (ValueError, KeyError, TypeError) as e:
        raise ApiError(build_status(400, f"continue key is not valid: {e}")) from None
    return str(start).rstrip("\x00")
