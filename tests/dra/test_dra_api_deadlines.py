"""The driver's API calls against a slow, hung or hostile API server: each call ends by its
overall deadline whatever the server trickles, and no answer is read beyond its cap. The calls go
through the driver's own connection (`hostdev.labels.kube_connection`), and through an official
client's pool where a configuration needs that client."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest

from dra import api as api_module
from dra.api import MAX_OBJECT_BYTES, ApiError, ResourceApi
from hostdev.labels.kube_connection import connect, load_kube_connection
from hostdev.labels.kubeconfig import ClusterAccess
from sim.apiserver import ApiServerStandIn, build_resource_claim

NODE = "node-1"
DRIVER = "vfio.kubevirt-iommufd.io"
DEADLINE = 1.0


@pytest.fixture
def resource_api(apiserver: ApiServerStandIn, tmp_path: Path) -> ResourceApi:
    apiserver.put_claim(build_resource_claim("vms", "gpu", ["gpu"], "vfio-gpu"))
    connection = load_kube_connection(apiserver.write_kubeconfig(tmp_path / "kubeconfig"))
    return ResourceApi(connection, call_seconds=DEADLINE)


def api_at(server: str) -> ResourceApi:
    """Calls to `server`, its certificate unchecked."""
    return ResourceApi(connect(ClusterAccess(server, insecure=True)), call_seconds=DEADLINE)


def failed_within(seconds: float, call: object) -> tuple[str, float]:
    """The error `call()` ended with, and how long it took; it must end within `seconds`."""
    assert callable(call)
    start = time.monotonic()
    with pytest.raises(ApiError) as caught:
        call()
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.1f} s: {caught.value}"
    return str(caught.value), took


@pytest.mark.parametrize("how", ["trickle", "hang"])
def test_a_claim_get_ends_at_its_deadline(
    apiserver: ApiServerStandIn, resource_api: ResourceApi, how: str
) -> None:
    # A byte every 0.2 s: a per-read timeout never trips, and the whole answer takes minutes.
    apiserver.misbehave(how, path="/resourceclaims/gpu", interval=0.2)
    message, took = failed_within(DEADLINE + 1.0, lambda: resource_api.read_claim("vms", "gpu"))
    assert message == "get resourceclaim vms/gpu: the API server did not answer within 1 s"
    assert took >= DEADLINE - 0.05
    # The pool is not left with a half-read connection: the next call is answered.
    assert resource_api.read_claim("vms", "gpu")["metadata"]["name"] == "gpu"


def test_a_call_through_the_official_clients_pool_ends_at_its_deadline(
    apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    """An exec plugin's or a proxy's configuration: the official client's pool, cut as ours."""
    apiserver.put_claim(build_resource_claim("vms", "gpu", ["gpu"], "vfio-gpu"))
    resource_api = ResourceApi(api_client, call_seconds=DEADLINE)
    apiserver.misbehave("trickle", path="/resourceclaims/gpu", interval=0.2)
    message, _ = failed_within(DEADLINE + 1.0, lambda: resource_api.read_claim("vms", "gpu"))
    assert message == "get resourceclaim vms/gpu: the API server did not answer within 1 s"
    assert resource_api.read_claim("vms", "gpu")["metadata"]["name"] == "gpu"


def test_every_slice_call_has_the_deadline(
    apiserver: ApiServerStandIn, resource_api: ResourceApi
) -> None:
    apiserver.put_node(NODE)
    apiserver.misbehave("trickle", count=4, path="/", interval=0.2)
    item = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 0, "resourceSliceCount": 1},
            "devices": [],
        },
    }
    for call in (
        lambda: resource_api.read_node_uid(NODE),
        lambda: resource_api.list_slices(NODE, DRIVER),
        lambda: resource_api.create_slice(item),
        lambda: resource_api.delete_slice("s", ""),
    ):
        message, _ = failed_within(DEADLINE + 1.0, call)
        assert message.endswith("the API server did not answer within 1 s")


@pytest.fixture
def trickled_tls_handshake() -> Iterator[str]:
    """A server whose TLS handshake is a record header announcing 16 KiB, then a byte a
    second: the client's handshake reads never time out."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.sendall(b"\x16\x03\x03\x40\x00")
            while not stop.wait(1.0):
                try:
                    connection.sendall(b"\x00")
                except OSError:
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()


def test_a_trickled_tls_handshake_ends_at_the_deadline(trickled_tls_handshake: str) -> None:
    resource_api = api_at(trickled_tls_handshake)
    message, _ = failed_within(DEADLINE + 1.0, lambda: resource_api.read_claim("vms", "gpu"))
    assert message.endswith("did not answer within 1 s")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_huge_claim_is_refused_while_reading(
    apiserver: ApiServerStandIn, resource_api: ResourceApi, chunked: bool
) -> None:
    apiserver.misbehave("huge", path="/resourceclaims/gpu", size=64 * 1024 * 1024, chunked=chunked)
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as caught:
            resource_api.read_claim("vms", "gpu")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "the answer is larger than 4 MiB" in str(caught.value)
    assert ("Content-Length 67108864" in str(caught.value)) is not chunked
    # Never buffered whole: at most the cap and a read's worth (the stand-in's own 1 MiB pieces
    # are counted too, as it runs in this process).
    assert peak < MAX_OBJECT_BYTES + 8 * 1024 * 1024
    assert resource_api.read_claim("vms", "gpu")["metadata"]["name"] == "gpu"


def test_a_claim_just_under_the_cap_is_read(
    apiserver: ApiServerStandIn, resource_api: ResourceApi
) -> None:
    apiserver.misbehave("huge", path="/resourceclaims/gpu", size=MAX_OBJECT_BYTES, chunked=True)
    claim = resource_api.read_claim("vms", "gpu")
    assert claim["metadata"]["name"] == "gpu" and len(claim["padding"]) > 4_000_000


def raw_http_server(answer: bytes) -> str:
    """A plain HTTP server that reads one request and sends `answer`, whatever it is."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "the answer is not JSON"),
        (b'["a list"]', "the answer is a JSON list, not an object"),
        (b'{"a": 1', "the answer is not JSON"),
    ],
    ids=["deeply-nested", "list", "truncated"],
)
def test_an_answer_that_is_no_object_is_an_api_error(body: bytes, words: str) -> None:
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    resource_api = api_at(raw_http_server(head + body))
    message, _ = failed_within(5.0, lambda: resource_api.read_claim("vms", "gpu"))
    assert message.startswith(f"get resourceclaim vms/gpu: {words}")


def test_a_compressed_answer_is_refused() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}"
    resource_api = api_at(raw_http_server(answer))
    message, _ = failed_within(5.0, lambda: resource_api.read_claim("vms", "gpu"))
    assert message.endswith("the answer is compressed (gzip) though none was asked for")


def test_a_hung_watch_is_cut_after_its_timeout_and_grace(
    apiserver: ApiServerStandIn, resource_api: ResourceApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_module, "WATCH_GRACE_SECONDS", 0.5)
    apiserver.misbehave("hang", path="/resourceslices")
    message, took = failed_within(
        3.0, lambda: list(resource_api.watch_slices(NODE, DRIVER, "", timeout_seconds=1))
    )
    assert message == "watch resourceslices: the API server did not answer within 1.5 s"
    assert took >= 1.4


def test_a_watch_event_over_the_cap_is_refused(
    apiserver: ApiServerStandIn, resource_api: ResourceApi
) -> None:
    apiserver.misbehave("huge", path="/resourceslices", size=64 * 1024 * 1024, chunked=True)
    message, _ = failed_within(
        30.0, lambda: list(resource_api.watch_slices(NODE, DRIVER, "", timeout_seconds=5))
    )
    assert message == "watch resourceslices: an event is larger than 4 MiB; refused"


def test_a_watch_ends_when_the_server_ends_it(
    apiserver: ApiServerStandIn, resource_api: ResourceApi
) -> None:
    apiserver.put_node(NODE)
    _, version = resource_api.list_slices(NODE, DRIVER)
    assert list(resource_api.watch_slices(NODE, DRIVER, version, timeout_seconds=1)) == []


def test_a_connect_that_never_completes_ends_at_the_deadline() -> None:
    """A listener whose backlog is full never accepts: each connect attempt times out, and
    urllib3 retries it. Every attempt gets only what is left of the call's time."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    waiting: list[socket.socket] = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            waiting.append(filler)
        api = api_at(f"http://127.0.0.1:{port}")
        message, _ = failed_within(DEADLINE + 1.0, lambda: api.read_claim("vms", "gpu"))
        assert message == "get resourceclaim vms/gpu: the API server did not answer within 1 s"
    finally:
        for filler in waiting:
            filler.close()
        listener.close()
