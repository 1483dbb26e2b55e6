"""The serving certificate: loaded from files, swapped for new handshakes when the files change.

cert-manager rotates the Secret and the kubelet swaps the mounted files (a symlink flip, so the
inode changes). A new pair is loaded into a fresh SSLContext and only swapped in once it loaded
whole; each new connection takes the context current when it is accepted. Established
connections keep the session they have. Loading into the live context instead could leave it
half-updated (new certificate, old key) if the files change between the two reads.

The files are compared by their stat before and after loading: a pair is taken only if neither
file changed while it was read, so what was loaded is exactly what the recorded signature
describes. Recording the signature taken before loading alone was not enough: files replaced in
between were loaded already, then "changed" again at the next check and reloaded a second time.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int, int], ...]


class TlsError(Exception):
    """A certificate or key that cannot be loaded."""


def build_server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS ≥ 1.2 server context holding the pair, or TlsError saying what is wrong."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as error:
        raise TlsError(f"{error.filename}: {error.strerror}; pass --cert and --key") from error
    except (OSError, ssl.SSLError) as error:
        raise TlsError(
            f"cannot load certificate {cert} with key {key}: {error}; both must be PEM and"
            " the key must belong to the certificate"
        ) from error
    return context


def read_signature(*paths: Path) -> Signature:
    """What changes when a file is replaced or rewritten: device, inode, size, mtime."""
    signature = []
    for path in paths:
        st = path.stat()  # follows the kubelet's ..data symlinks to the real file
        signature.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(signature)


def _signature_or_none(*paths: Path) -> Signature | None:
    try:
        return read_signature(*paths)
    except OSError:
        return None


class CertificateReloader:
    """Owns the listening context; `check()` loads changed files into the next handshake's."""

    def __init__(
        self, cert: Path, key: Path, on_reload: Callable[[bool], None] = lambda ok: None
    ) -> None:
        self._cert = cert
        self._key = key
        self._on_reload = on_reload
        try:
            # Taken before loading, so a rotation racing with startup is seen at the first check.
            self._signature = read_signature(cert, key)
        except OSError as error:
            raise TlsError(f"{error.filename}: {error.strerror}; pass --cert and --key") from error
        self._current = build_server_context(cert, key)

    def current(self) -> ssl.SSLContext:
        """The context for the next connection's handshake."""
        return self._current

    def check(self) -> None:
        """Reload the pair if either file changed; on failure keep serving the old one."""
        try:
            signature = read_signature(self._cert, self._key)
        except OSError as error:
            # Mid-rotation a file can be briefly missing; the next check sees the new one.
            log.warning("cannot stat certificate files: %s; keeping the current certificate", error)
            return
        if signature == self._signature:
            return
        failure: TlsError | None = None
        try:
            context = build_server_context(self._cert, self._key)
        except TlsError as error:
            failure = error
        if _signature_or_none(self._cert, self._key) != signature:
            return  # changed while being read (mid-rotation): the next check takes the end state
        self._signature = signature  # a broken pair is reported once, retried when it changes
        if failure is not None:
            log.error("certificate reload failed, still serving the previous one: %s", failure)
            self._on_reload(False)
            return
        self._current = context
        log.info("reloaded certificate %s and key %s for new connections", self._cert, self._key)
        self._on_reload(True)
