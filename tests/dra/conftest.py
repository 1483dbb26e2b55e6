"""Fixtures for the DRA tests. They live in apiserver_kit.py (at the tests root, shared with
tests/sim), which mypy checks: mypy cannot take two modules named `conftest`, so this file only
re-exports them (and is excluded from mypy)."""

from apiserver_kit import api_client, apiserver

__all__ = ["api_client", "apiserver"]
