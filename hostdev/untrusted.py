"""Untrusted text (names from a request, ids from a peer) made safe to log or echo.

A raw newline in a logged name forges a log line, a bidi override reorders what an operator reads,
a lone surrogate from JSON makes a UTF-8 log handler raise, and a megabyte id makes a megabyte log
line (or a gRPC trailer over its limit). `quote_untrusted` turns any such text into one short,
printable, quoted line.
"""

from __future__ import annotations

_NAMED = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    if char.isprintable():
        return char
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def quote_untrusted(text: str, limit: int = 200) -> str:
    """`text` in single quotes with Python's escapes for quotes, backslashes and non-printables.

    At most `limit` characters of escaped text sit between the quotes; what did not fit is
    counted after them, as in `'abc'...[+9997 chars]`, so the result is one printable line of at
    most `limit` + 30 characters whatever the input.
    """
    if limit < 0:
        raise ValueError(f"limit must be 0 or more, not {limit}")
    pieces: list[str] = []
    used = 0
    for index, char in enumerate(text):
        escaped = _escape(char)
        if used + len(escaped) > limit:
            return f"'{''.join(pieces)}'...[+{len(text) - index} chars]"
        pieces.append(escaped)
        used += len(escaped)
    return f"'{''.join(pieces)}'"
