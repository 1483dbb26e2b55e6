"""Fixtures for the simulated world's own tests. They live in apiserver_kit.py, which mypy
checks: mypy cannot take two modules named `conftest`, so this file only re-exports them (and is
excluded from mypy)."""

from apiserver_kit import api_client, apiserver

__all__ = ["api_client", "apiserver"]
