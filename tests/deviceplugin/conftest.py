"""Fixtures for the device plugin tests. They live in dp_kit.py, which mypy checks: mypy cannot
take two modules named `conftest`, so this file only re-exports them (and is excluded from mypy)."""

from dp_kit import short_dir, start_plugin

__all__ = ["short_dir", "start_plugin"]
