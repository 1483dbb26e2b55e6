"""TLS over memory buffers: ciphertext in, plaintext out, and the bytes to send back.

asyncio's own TLS layer gives every accepted connection a 256 KiB read buffer before the handshake
has even started, which made idle connections the webhook's largest cost: 600 of them held
193 MiB. This session drives the same OpenSSL object through two memory BIOs instead, so a
connection costs what OpenSSL keeps for it, and the handshake runs under the HTTP connection's own
deadline. No IO here: the connection feeds it what the socket read and writes what it returns.
"""

from __future__ import annotations

import contextlib
import ssl

# One TLS record's worth; `read` is called until OpenSSL has nothing left.
READ_SIZE = 16 * 1024


class TlsSession:
    """The server side of one TLS connection. `ssl.SSLError` from any method means: drop it."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._established = False
        self.peer_closed = False  # the peer sent close_notify: nothing more will come

    def receive(self, ciphertext: bytes) -> bytes:
        """Take bytes from the peer; the application data they completed (may be empty)."""
        self._incoming.write(ciphertext)
        if not self._established:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self._established = True
        chunks = []
        while not self.peer_closed:
            try:
                chunk = self._ssl.read(READ_SIZE)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                self.peer_closed = True
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def send(self, plaintext: bytes) -> None:
        """Encrypt application data; collect it with `outgoing()`."""
        self._ssl.write(plaintext)

    def close_notify(self) -> None:
        """Queue our close_notify alert (after a completed handshake; otherwise nothing)."""
        if self._established:
            # The peer's own alert is not awaited: the connection is closed right after.
            with contextlib.suppress(ssl.SSLError):
                self._ssl.unwrap()

    def outgoing(self) -> bytes:
        """Everything waiting to go to the peer: handshake messages, records, alerts."""
        return self._outgoing.read()
