"""Shared fixtures: simulated nodes written as real directory trees under tmp_path."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sim.host import SCENARIOS, BuildHost, HostSpec, build_tree


@pytest.fixture
def build_host(tmp_path: Path) -> BuildHost:
    """Write a HostSpec under a fresh directory and return its root."""
    counter = iter(range(1_000_000))

    def build(spec: HostSpec) -> Path:
        return build_tree(spec, tmp_path / f"host{next(counter)}")

    return build


@pytest.fixture
def scenario_root(build_host: BuildHost) -> Callable[[str], Path]:
    """The root of a named built-in scenario (see sim.host.SCENARIOS)."""

    def build(name: str) -> Path:
        return build_host(SCENARIOS[name]())

    return build


@pytest.fixture
def open_umask() -> Iterator[None]:
    """Umask 000 for the test: nothing masks a mode, so a file has whatever mode its maker gave."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)
