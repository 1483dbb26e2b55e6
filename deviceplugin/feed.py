"""A versioned value that many readers wait on: how a new device snapshot reaches every open
ListAndWatch stream without polling. A feed made without a value holds None until the first
`publish` (a resource registered before its devices' health is judged)."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Feed(Generic[T]):
    def __init__(self, value: T | None = None) -> None:
        self._changed = threading.Condition()
        self._value = value
        self._version = 0
        self._closed = False

    def publish(self, value: T) -> None:
        with self._changed:
            self._value = value
            self._version += 1
            self._changed.notify_all()

    def current(self) -> tuple[int, T | None]:
        with self._changed:
            return self._version, self._value

    def wait_newer(self, version: int, timeout: float) -> tuple[int, T | None] | None:
        """The value once its version passes `version` (or the same one after `timeout`, or
        on a `wake`); None once the feed is closed."""
        with self._changed:
            if self._version == version and not self._closed:
                self._changed.wait(timeout)
            if self._closed:
                return None
            return self._version, self._value

    def wake(self) -> None:
        """Let waiters look again (a stream whose client went away ends sooner)."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
