"""The API server stand-in as fixtures (tests/dra and tests/sim conftest.py re-export them): on
loopback, checking every object a client sends against the official Kubernetes 1.37 schema as well
as the server's own rules."""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes.client
import pytest

from k8s_schema_kit import schema_errors
from sim.apiserver import ApiServerStandIn, running_apiserver


@pytest.fixture
def apiserver() -> Iterator[ApiServerStandIn]:
    """A running stand-in (HTTPS, bearer token) that refuses schema-invalid objects with 422."""
    with running_apiserver(validate=schema_errors) as api:
        yield api


@pytest.fixture
def api_client(apiserver: ApiServerStandIn) -> Iterator[kubernetes.client.ApiClient]:
    """A real `kubernetes` client for `apiserver`."""
    with apiserver.api_client() as client:
        yield client
