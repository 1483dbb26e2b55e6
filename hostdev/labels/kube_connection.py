"""The connection to the API server that the DRA driver's calls go through: its URL, a urllib3
pool with the TLS settings, and the headers that authenticate each call, from the pod's service
account or a kubeconfig. The official `kubernetes` client is loaded only when the configuration
needs what only it does.

Why not the official client for all of it: loading it (its package pulls every API class,
OAuth, dateutil and pydantic) took 0.33-0.44 s and tens of MB before the driver's first API
call, for what the driver needs of it here: a URL, a CA, a token re-read as it rotates, a client
certificate. Those are kept, as client-go does them:
- in a pod: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT` (an IPv6 address in
  brackets), checked against the service account's `ca.crt`, with its `token`;
- a kubeconfig's current context (`hostdev.labels.kubeconfig`);
- a token file is read again at most every TOKEN_REFRESH_SECONDS, as client-go does (the kubelet
  replaces a projected token well before it expires); a failed re-read keeps the token read
  before, and says so;
- the CA and client certificate files are read again for each new connection (urllib3 does, as
  it did under the official client), so a rotated certificate is used from the next connection.
TLS verification is on unless a kubeconfig says `insecure-skip-tls-verify: true`.

What only the official client does (exec credential plugins, auth-providers, a proxy from
`proxy-url` or from HTTPS_PROXY / HTTP_PROXY / ALL_PROXY, where it also applies NO_PROXY) loads
it, and the calls go through its pool and its authentication (`connection_of`).

No token or key is ever logged or put in an error, nor written to disk: a client key given as
`client-key-data` is handed to TLS through an anonymous memory file (memfd). Files are not
refused for their mode: the kubelet writes projected service account tokens 0644 by default,
inside the pod's own mount namespace, and kubectl and client-go accept any mode; who may read a
kubeconfig on the host is decided where it is kept.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from hostdev.labels.kubeconfig import ApiConfigError, ClusterAccess, Material, OfficialOnly

if TYPE_CHECKING:
    import urllib3
    from kubernetes import client

__all__ = ["ApiConfigError", "KubeConnection", "load_kube_connection"]
log = logging.getLogger(__name__)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REFRESH_SECONDS = 60.0
"""client-go's period for re-reading a token file (transport.NewCachedFileTokenSource)."""
USER_AGENT = "kubevirt-iommufd"
_PROXY_VARIABLES: dict[str, tuple[str, ...]] = {
    "https": ("https_proxy", "HTTPS_PROXY"),
    "http": ("http_proxy", "HTTP_PROXY"),
}


@dataclass(frozen=True, slots=True)
class KubeConnection:
    """Where the API server is, the pool to reach it through, and the headers of each call."""

    server: str
    """The base URL, no trailing slash: a call's URL is this followed by its path."""
    pool: urllib3.PoolManager
    credentials: Callable[[], Mapping[str, str]]
    """The authentication headers as of now (a rotated token once re-read)."""
    held: tuple[BinaryIO, ...] = field(default=(), repr=False)
    """What must live as long as the pool uses it: the memory files of `-data` client keys."""

    def headers(self) -> dict[str, str]:
        return {"User-Agent": USER_AGENT, **self.credentials()}


def load_kube_connection(
    kubeconfig: Path | None, *, environ: Mapping[str, str] = os.environ
) -> KubeConnection:
    """The connection `kubeconfig` describes, or the pod's service account's when there is none;
    ApiConfigError saying what to fix when it cannot be made."""
    if kubeconfig is None:
        access: ClusterAccess | OfficialOnly = read_in_cluster_access(environ, SERVICE_ACCOUNT)
    else:
        access = read_kubeconfig_access(kubeconfig)
    if isinstance(access, ClusterAccess):
        proxy = _proxy_variable(access.server, environ)
        if proxy is None:
            return connect(access)
        access = OfficialOnly(f"{proxy} is set")
    return _official_connection(kubeconfig, access.reason)


def read_kubeconfig_access(kubeconfig: Path) -> ClusterAccess | OfficialOnly:
    from hostdev.documents import DocumentError, read_document
    from hostdev.labels.kubeconfig import parse_kubeconfig

    try:
        return parse_kubeconfig(read_document(kubeconfig, "kubeconfig"), kubeconfig.parent)
    except DocumentError as error:
        raise ApiConfigError(str(error)) from None
    except ApiConfigError as error:
        raise ApiConfigError(f"kubeconfig {kubeconfig}: {error}") from None


def read_in_cluster_access(environ: Mapping[str, str], directory: Path) -> ClusterAccess:
    """The service account's access, as client-go's rest.InClusterConfig finds it."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ApiConfigError(
            "not in a pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set"
        )
    return ClusterAccess(
        server=build_in_cluster_server(host, port),
        ca=directory / "ca.crt",
        token=directory / "token",
    )


def build_in_cluster_server(host: str, port: str) -> str:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ApiConfigError(f"KUBERNETES_SERVICE_PORT {port!r} is not a port number")
    # net.JoinHostPort's rule: an IPv6 address (or one with a zone) goes in brackets.
    return f"https://[{host}]:{port}" if ":" in host or "%" in host else f"https://{host}:{port}"


def connect(
    access: ClusterAccess, *, token_refresh_seconds: float = TOKEN_REFRESH_SECONDS
) -> KubeConnection:
    """A pool for `access`, its files checked now: a wrong CA or key fails here, naming it,
    rather than at each call."""
    import urllib3

    held: list[BinaryIO] = []
    options: dict[str, Any] = {"maxsize": (os.cpu_count() or 1) * 5}
    if access.insecure:
        log.warning(
            "insecure-skip-tls-verify: the API server's certificate is not checked, so anyone"
            " on the way can read and answer the driver's calls"
        )
        options |= {"cert_reqs": ssl.CERT_NONE, "assert_hostname": False}
    else:
        options["cert_reqs"] = ssl.CERT_REQUIRED
    if access.ca is not None:
        options |= _ca_options(access.ca)
    if access.tls_server_name is not None:
        options["server_hostname"] = access.tls_server_name
    if access.client_cert is not None and access.client_key is not None:
        cert = _as_file(access.client_cert, held)
        key = _as_file(access.client_key, held)
        _check_client_certificate(access, cert, key)
        options |= {"cert_file": cert, "key_file": key}
    return KubeConnection(
        server=access.server,
        pool=urllib3.PoolManager(**options),
        credentials=_credentials(access.token, token_refresh_seconds),
        held=tuple(held),
    )


def _ca_options(ca: Material) -> dict[str, str]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if isinstance(ca, Path):
            context.load_verify_locations(cafile=ca)
            return {"ca_certs": str(ca)}
        pem = ca.decode("ascii")
        context.load_verify_locations(cadata=pem)
        return {"ca_cert_data": pem}
    except OSError as error:
        what = _named_material("certificate-authority", ca)
        if isinstance(error, ssl.SSLError):
            raise ApiConfigError(f"{what} holds no PEM certificate ({error.reason})") from None
        raise ApiConfigError(f"cannot read {what}: {error.strerror or error}") from None
    except (UnicodeDecodeError, ValueError):
        raise ApiConfigError("certificate-authority-data holds no PEM certificate") from None


def _as_file(material: Material, held: list[BinaryIO]) -> str:
    """A path TLS can load `material` from: the file, or a memory file holding the data."""
    if isinstance(material, Path):
        return str(material)
    memory = os.memfd_create("kube-client-credential", os.MFD_CLOEXEC)
    file = os.fdopen(memory, "wb", buffering=0)
    file.write(material)
    held.append(file)
    return f"/proc/self/fd/{memory}"


def _check_client_certificate(access: ClusterAccess, cert: str, key: str) -> None:
    what = (
        f"{_named_material('client-certificate', access.client_cert)} and"
        f" {_named_material('client-key', access.client_key)}"
    )

    def no_password() -> str:
        raise ApiConfigError(f"{what}: the key is encrypted; give it unencrypted")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as error:
        raise ApiConfigError(
            f"{what}: not a PEM certificate and its private key ({error.reason})"
        ) from None
    except OSError as error:
        raise ApiConfigError(f"cannot read {what}: {error.strerror or error}") from None


def _named_material(name: str, material: Material | None) -> str:
    return f"{name} {material}" if isinstance(material, Path) else f"{name}-data"


def _credentials(
    token: str | Path | None, refresh_seconds: float
) -> Callable[[], Mapping[str, str]]:
    if token is None:
        return dict
    if isinstance(token, Path):
        return TokenFile(token, refresh_seconds)
    headers = _bearer(parse_token(token, "the kubeconfig's token"))
    return lambda: headers


class TokenFile:
    """The Authorization header from a token file, read again at most every `refresh_seconds`."""

    def __init__(self, path: Path, refresh_seconds: float) -> None:
        self.path = path
        self._refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._headers = _bearer(self._read())
        self._read_at = time.monotonic()

    def __call__(self) -> Mapping[str, str]:
        with self._lock:
            if time.monotonic() - self._read_at >= self._refresh_seconds:
                # Tried again a period later, not at every call, when it fails.
                self._read_at = time.monotonic()
                try:
                    self._headers = _bearer(self._read())
                except ApiConfigError as error:
                    log.warning("%s; the token read before is kept", error)
            return self._headers

    def _read(self) -> str:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8"
            raise ApiConfigError(f"cannot read the token file {self.path}: {reason}") from None
        return parse_token(text, f"the token file {self.path}")


def parse_token(text: str, where: str) -> str:
    """The token in `text` (surrounding whitespace dropped, as client-go does)."""
    token = text.strip()
    if not token:
        raise ApiConfigError(f"{where} is empty")
    if not all("!" <= char <= "~" for char in token):
        raise ApiConfigError(
            f"{where} holds characters no bearer token has (spaces, line breaks or beyond"
            " ASCII): is it the right file?"
        )
    return token


def _bearer(token: str) -> Mapping[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _proxy_variable(server: str, environ: Mapping[str, str]) -> str | None:
    """The environment variable naming a proxy for `server`, as the official client reads them
    (lower case first, then upper; ALL_PROXY for any scheme)."""
    scheme = server.partition("://")[0]
    for name in (*_PROXY_VARIABLES.get(scheme, ()), "all_proxy", "ALL_PROXY"):
        if environ.get(name):
            return name
    return None


def _official_connection(kubeconfig: Path | None, reason: str) -> KubeConnection:
    from hostdev.labels.kube_client import load_api_client

    log.info("%s: the official kubernetes client makes the connection", reason)
    try:
        api_client = load_api_client(kubeconfig)
    # Its loaders raise many kinds of error for a configuration they cannot use.
    except Exception as error:
        raise ApiConfigError(
            f"{reason}, which only the official kubernetes client handles, and it failed: {error}"
        ) from error
    return connection_of(api_client)


def connection_of(api_client: client.ApiClient) -> KubeConnection:
    """The calls through an official client's pool, authenticated as it does (its refresh hook
    runs an exec plugin again or re-reads a token when due)."""
    configuration = api_client.configuration

    def credentials() -> Mapping[str, str]:
        auth = configuration.auth_settings().get("BearerToken")
        value = auth["value"] if auth else None
        return {"Authorization": value} if value else {}

    return KubeConnection(
        server=configuration.host.rstrip("/"),
        pool=api_client.rest_client.pool_manager,
        credentials=credentials,
    )
