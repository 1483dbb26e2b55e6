"""The demo's output: numbered steps, indented details, and checks that remember a failure (or
wait for a condition first)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Checks:
    """Prints steps and checks, and remembers whether every check held."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.failed: list[str] = []

    def step(self, number: int, title: str) -> None:
        print(f"\n[{number}/{self.steps}] {title}")

    def show(self, text: str) -> None:
        for line in text.rstrip("\n").splitlines():
            print(f"      {line}")

    def check(self, ok: bool, text: str) -> bool:
        print(f"  {'ok  ' if ok else 'FAIL'} {text}")
        if not ok:
            self.failed.append(text)
        return ok


def eventually(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Whether `condition` holds within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
