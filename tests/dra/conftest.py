"""Fixtures for the DRA tests. They live in dra_fixtures.py, which mypy checks: mypy cannot take
two modules named `conftest`, so this file only re-exports them (and is excluded from mypy)."""

from dra_fixtures import api_client, apiserver

__all__ = ["api_client", "apiserver"]
