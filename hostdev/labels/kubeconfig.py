"""A kubeconfig's current context as what a connection needs (pure: a decoded document in,
`ClusterAccess` or the reason only the official client can use it out).

What it reads is what client-go reads for those fields: `current-context` names a context, the
context a cluster and (optionally) a user; the cluster's `server`, `certificate-authority` or
`-data`, `insecure-skip-tls-verify` and `tls-server-name`; the user's `token` or `tokenFile`
(the file wins, as in client-go: it is the one kept current) and `client-certificate` /
`client-key` or their `-data` (data wins over a file, as in client-go). Relative paths are
resolved against the kubeconfig's directory. Other fields (namespace, extensions) do not concern
a connection and are ignored, as client-go ignores them.

Left to the official client (`OfficialOnly`): `exec` credential plugins and `auth-provider`s
(they run commands or talk OAuth, which is what the official client is for) and `proxy-url`.
Refused: `username`/`password` (the API server dropped basic auth in Kubernetes 1.19) and
impersonation (`as`, `as-groups`: the official Python client would ignore it and act as the
user itself instead).

Every problem is an `ApiConfigError` naming the field and the fix; no message carries a value
of the file (a token or a key may be in any field a person mistypes).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path

from hostdev.errors import HostdevError

Material = Path | bytes
"""A file to read (each time a connection is made, so a rotated one is picked up) or the bytes
themselves (a `-data` field)."""


class ApiConfigError(HostdevError, ValueError):
    """The API server configuration (a kubeconfig, or the pod's service account) cannot be used;
    the message says what to fix."""


@dataclass(frozen=True, slots=True)
class ClusterAccess:
    """How to reach and authenticate to one API server."""

    server: str
    """Its base URL, without a trailing slash (a path prefix of a proxy in front is kept)."""
    ca: Material | None = None
    """The CAs its certificate is checked against; None: the system's."""
    insecure: bool = False
    tls_server_name: str | None = None
    token: str | Path | None = None
    """A bearer token, or the file holding it (read again as it rotates)."""
    client_cert: Material | None = None
    client_key: Material | None = None


@dataclass(frozen=True, slots=True)
class OfficialOnly:
    """The context needs what only the official `kubernetes` client does: `reason` says what."""

    reason: str


_OFFICIAL = {
    "exec": "an exec credential plugin",
    "auth-provider": "an auth-provider",
}
_IMPERSONATION = ("as", "as-uid", "as-groups", "as-user-extra")


def parse_kubeconfig(document: object, directory: Path) -> ClusterAccess | OfficialOnly:
    """The current context of `document` (a decoded kubeconfig read from `directory`)."""
    config = _mapping(document, "the file")
    current = config.get("current-context")
    if not isinstance(current, str) or not current:
        raise ApiConfigError(
            "no current-context: set one (kubectl config use-context NAME --kubeconfig FILE)"
        )
    context = _named(config, "contexts", "context", current, f"current-context {current!r}")
    cluster_name = context.get("cluster")
    if not isinstance(cluster_name, str) or not cluster_name:
        raise ApiConfigError(f"context {current!r} names no cluster: add its cluster field")
    cluster = _named(config, "clusters", "cluster", cluster_name, f"context {current!r}")
    user_name = context.get("user")
    user: dict[str, object] = {}
    if isinstance(user_name, str) and user_name:
        user = _named(config, "users", "user", user_name, f"context {current!r}")
    elif user_name is not None and user_name != "":
        raise ApiConfigError(f"context {current!r}: user: expected the name of a user")
    official = _official_reason(cluster_name, cluster, user_name or "", user)
    if official is not None:
        return OfficialOnly(official)
    return _access(cluster_name, cluster, str(user_name or ""), user, directory)


def _official_reason(
    cluster_name: str, cluster: dict[str, object], user_name: str, user: dict[str, object]
) -> str | None:
    if "username" in user or "password" in user:
        raise ApiConfigError(
            f"user {user_name!r}: username and password (basic auth) are not accepted by the API"
            " server since Kubernetes 1.19: give the user a token or a client certificate"
        )
    impersonating = [field for field in _IMPERSONATION if user.get(field)]
    if impersonating:
        raise ApiConfigError(
            f"user {user_name!r}: impersonation ({', '.join(impersonating)}) is not supported:"
            " give the driver a kubeconfig of the identity it should act as"
        )
    for field, what in _OFFICIAL.items():
        if user.get(field):
            return f"user {user_name!r} uses {what}"
    if cluster.get("proxy-url"):
        return f"cluster {cluster_name!r} is reached through a proxy (proxy-url)"
    return None


def _access(
    cluster_name: str,
    cluster: dict[str, object],
    user_name: str,
    user: dict[str, object],
    directory: Path,
) -> ClusterAccess:
    where = f"cluster {cluster_name!r}"
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise ApiConfigError(
            f"{where}: server: expected the API server's URL, such as https://10.0.0.1:6443"
        )
    ca = _material(cluster, "certificate-authority", where, directory)
    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise ApiConfigError(f"{where}: insecure-skip-tls-verify: expected true or false")
    if insecure and ca is not None:
        # client-go refuses the pair too: which one was meant cannot be told.
        raise ApiConfigError(
            f"{where}: insecure-skip-tls-verify with a certificate-authority: keep only one"
            " (better: the certificate authority)"
        )
    server_name = cluster.get("tls-server-name")
    if server_name is not None and (not isinstance(server_name, str) or not server_name):
        raise ApiConfigError(f"{where}: tls-server-name: expected a host name")
    who = f"user {user_name!r}"
    cert = _material(user, "client-certificate", who, directory)
    key = _material(user, "client-key", who, directory)
    if cert is not None and key is None:
        raise ApiConfigError(f"{who}: client-certificate without client-key: give both")
    if key is not None and cert is None:
        raise ApiConfigError(f"{who}: client-key without client-certificate: give both")
    return ClusterAccess(
        server=server.rstrip("/"),
        ca=ca,
        insecure=insecure,
        tls_server_name=server_name,
        token=_token(user, who, directory),
        client_cert=cert,
        client_key=key,
    )


def _token(user: dict[str, object], who: str, directory: Path) -> str | Path | None:
    token_file = _path(user, "tokenFile", who, directory)
    if token_file is not None:
        return token_file
    token = user.get("token")
    if token is None or token == "":
        return None
    if not isinstance(token, str):
        raise ApiConfigError(f"{who}: token: expected a string")
    return token


def _material(fields: dict[str, object], name: str, where: str, directory: Path) -> Material | None:
    data = fields.get(f"{name}-data")
    if data is not None and data != "":
        if not isinstance(data, str):
            raise ApiConfigError(f"{where}: {name}-data: expected base64 text")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiConfigError(
                f"{where}: {name}-data is not base64: give the PEM file's content base64-encoded"
                f" (base64 -w0 FILE), or its path as {name}"
            ) from None
    return _path(fields, name, where, directory)


def _path(fields: dict[str, object], name: str, where: str, directory: Path) -> Path | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ApiConfigError(f"{where}: {name}: expected a file's path")
    return directory / value


def _named(
    config: dict[str, object], section: str, field: str, name: str, named_by: str
) -> dict[str, object]:
    """The `field` of the entry called `name` in the list `section`."""
    entries = config.get(section)
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise ApiConfigError(f"{section}: expected a list of {{name, {field}}} entries")
    for index, entry in enumerate(entries):
        item = _mapping(entry, f"{section}[{index}]")
        if item.get("name") == name:
            return _mapping(item.get(field) or {}, f"{section}[{index}].{field}")
    raise ApiConfigError(
        f"{named_by} names {field} {name!r}, which is not in {section}: add it, or correct the name"
    )


def _mapping(value: object, where: str) -> dict[str, object]:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise ApiConfigError(f"{where}: expected a mapping")
    return value
