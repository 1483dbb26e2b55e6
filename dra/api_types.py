"""What callers of the driver's API calls (`dra.api`) see, without the HTTP stack behind them:
the error every call fails with and the shape of its answers. Kept apart so that the preparer
and the publisher import them before the driver serves the kubelet, while urllib3 and the
connection load only once the first call is made."""

from __future__ import annotations

from typing import Any

Object = dict[str, Any]
MiB = 1024 * 1024


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
