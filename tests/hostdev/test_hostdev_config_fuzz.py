"""Fuzzing the configuration documents: the device plugin's (and DRA driver's) config, the
webhook's config and the reservations file. Whatever a document holds, reading it ends in a value
or in the module's own error with a one-line message, never in another exception.

Bounded and seeded (`derandomize`, explicit `max_examples`): the same examples on every run, a
few seconds in all. Documents are shaped like each schema (its keys, nested as it nests them)
with each value either plausible or arbitrary, so the checks deep inside are reached; they are
also decoded from files, as written and with bytes mangled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from hostdev import config as plugin_config
from hostdev.model import HostInventory
from hostdev.scan import scan_host
from kubevirt_iommufd.reservations import (
    ReservationError,
    load_reservations,
    parse_reservations,
    resolve_reservations,
)
from sim.host import build_tree, hgx_h100
from webhook import config as webhook_config

FUZZ = settings(
    max_examples=250,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

PLAUSIBLE = st.sampled_from(
    [
        "10de",
        "2330",
        "0302",
        "03",
        "vfio-pci",
        "auto",
        "nvidia",
        "0000:3b:00.0",
        "0000:18:00.0",
        "10de:2330",
        "10de:*",
        "vendor=10de,class=0302",
        "nvidia.com/H100",
        "nvidia.com/",
        "devices.kubevirt.io/iommufd",
        "kubernetes.io/x",
        "both",
        "legacy",
        "iommufd",
        "0660",
        "0666",
        "unhealthy",
        "IfNotPresent",
        "/run/x.sock",
        "/var/run/kubevirt-iommufd",
        "",
        " ",
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    PLAUSIBLE,
)
ANY = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6) | PLAUSIBLE, inner, max_size=3)
    ),
    max_leaves=8,
)

Shape = dict[str, Any] | list[Any] | st.SearchStrategy[Any]


def shaped(shape: Shape) -> st.SearchStrategy[Any]:
    """Documents with `shape`'s keys (each optional, sometimes replaced by anything), nested as
    it says: a dict is a mapping, a one-item list a list of that shape, a strategy a value."""
    if isinstance(shape, dict):
        inner = st.fixed_dictionaries({}, optional={k: shaped(v) for k, v in shape.items()})
        extra = st.dictionaries(st.text(max_size=8), ANY, max_size=1)
        strategy = st.one_of(inner, st.tuples(inner, extra).map(lambda p: {**p[1], **p[0]}))
    elif isinstance(shape, list):
        strategy = st.lists(shaped(shape[0]), max_size=3)
    else:
        strategy = shape
    return st.one_of(strategy, strategy, strategy, ANY)


TEXTS = st.lists(PLAUSIBLE | st.text(max_size=8), max_size=3)
NUMBER = st.one_of(st.integers(-5, 200), st.floats(allow_nan=True), PLAUSIBLE)
FLAG = st.booleans() | PLAUSIBLE

PLUGIN = shaped(
    {
        "resources": [
            {
                "resourceName": PLAUSIBLE,
                "autoName": PLAUSIBLE,
                "resetAfterUse": FLAG,
                "selectors": {
                    "vendors": TEXTS,
                    "devices": TEXTS,
                    "classes": TEXTS,
                    "drivers": TEXTS,
                    "pciAddresses": TEXTS,
                },
            }
        ],
        "deviceMode": PLAUSIBLE,
        "iommufd": {
            "enabled": FLAG,
            "resourceName": PLAUSIBLE,
            "slots": NUMBER,
            "socketDir": PLAUSIBLE,
            "socketOwner": {"uid": NUMBER, "gid": NUMBER},
            "socketMode": PLAUSIBLE,
            "handoffTimeoutSeconds": NUMBER,
            "withoutIommu": PLAUSIBLE,
        },
        "rescanIntervalSeconds": NUMBER,
        "pciIds": PLAUSIBLE,
        "podResources": {"socket": PLAUSIBLE, "pollIntervalSeconds": NUMBER},
        "nodeLabels": {"featuresDir": PLAUSIBLE},
    }
)
WEBHOOK = shaped(
    {
        "managedResources": {"names": TEXTS, "prefixes": TEXTS},
        "strict": FLAG,
        "skip": {
            "namespaces": TEXTS,
            "vmiLabels": st.dictionaries(PLAUSIBLE | st.text(max_size=6), PLAUSIBLE, max_size=2),
        },
        "hookSidecar": {
            "enabled": FLAG,
            "image": PLAUSIBLE,
            "imagePullPolicy": PLAUSIBLE,
            "command": TEXTS,
            "args": TEXTS,
        },
    }
)
DEVICES = shaped([{"pciAddress": PLAUSIBLE, "match": PLAUSIBLE, "driver": PLAUSIBLE}])
# `devices` is required: most documents have it, so the entries' checks are reached.
RESERVATIONS = st.one_of(
    shaped({"driver": PLAUSIBLE, "devices": DEVICES}),
    st.fixed_dictionaries({"devices": DEVICES}, optional={"driver": PLAUSIBLE | ANY}),
    st.fixed_dictionaries({"devices": DEVICES}, optional={"driver": PLAUSIBLE | ANY}),
)


@pytest.fixture(scope="module")
def inventory(tmp_path_factory: pytest.TempPathFactory) -> HostInventory:
    return scan_host(build_tree(hgx_h100(), tmp_path_factory.mktemp("host") / "root"))


def one_line(error: Exception) -> None:
    message = str(error)
    assert message and "\n" not in message and "\r" not in message, repr(message)


def parses_or_refuses(read: Callable[[], object], own: type[Exception]) -> None:
    try:
        read()
    except own as error:
        one_line(error)


@FUZZ
@given(document=PLUGIN)
@example(document={"\n": None})  # an unknown key that was printed raw
def test_plugin_config(document: object) -> None:
    parses_or_refuses(lambda: plugin_config.parse_config(document), plugin_config.ConfigError)


@FUZZ
@given(document=WEBHOOK)
@example(document={"\n": None})  # an unknown key that was printed raw
def test_webhook_config(document: object) -> None:
    parses_or_refuses(lambda: webhook_config.parse_config(document), webhook_config.ConfigError)


@FUZZ
@given(document=RESERVATIONS)
@example(document={"devices": [{"x\ny": 1}]})  # an unknown key that was printed raw
def test_reservations(document: object, inventory: HostInventory) -> None:
    parses_or_refuses(
        lambda: resolve_reservations(parse_reservations(document), inventory), ReservationError
    )


LOADERS: dict[str, tuple[Callable[[Path], object], type[Exception], st.SearchStrategy[Any]]] = {
    "plugin": (plugin_config.load_config, plugin_config.ConfigError, PLUGIN),
    "webhook": (webhook_config.read_config, webhook_config.ConfigError, WEBHOOK),
    "reservations": (load_reservations, ReservationError, RESERVATIONS),
}


def encoded(document: object, as_json: bool) -> bytes:
    if as_json:
        return json.dumps(document).encode()
    return yaml.safe_dump(document, allow_unicode=True).encode()


@st.composite
def files(draw: st.DrawFn, documents: st.SearchStrategy[Any]) -> tuple[str, bytes]:
    """(suffix, content): a document as JSON or YAML, as written or with bytes mangled."""
    as_json = draw(st.booleans())
    content = encoded(draw(documents), as_json)
    mangle = draw(st.sampled_from(["none", "cut", "splice", "raw"]))
    if mangle == "cut":
        content = content[: draw(st.integers(0, len(content)))]
    elif mangle == "splice":
        at = draw(st.integers(0, len(content)))
        content = content[:at] + draw(st.binary(max_size=6)) + content[at:]
    elif mangle == "raw":
        content = draw(st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
    return (".json" if as_json else ".yaml", content)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_files(kind: str, tmp_path: Path) -> None:
    load, own, documents = LOADERS[kind]

    @settings(FUZZ, max_examples=150)
    @given(file=files(documents))
    def check(file: tuple[str, bytes]) -> None:
        path = tmp_path / f"config{file[0]}"
        path.write_bytes(file[1])
        parses_or_refuses(lambda: load(path), own)

    check()


def with_key_again(document: dict[str, Any], key: str, value: object, as_json: bool) -> bytes:
    """`document` written with `key: value` after its own keys, `key` being one of them."""
    if as_json:
        text = json.dumps(document)
        return f"{text[:-1]}, {json.dumps(key)}: {json.dumps(value)}}}".encode()
    return encoded(document, False) + encoded({key: value}, False)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_key_given_twice_is_refused(kind: str, tmp_path: Path) -> None:
    load, own, documents = LOADERS[kind]

    @settings(FUZZ, max_examples=60)
    @given(document=documents, again=st.data(), as_json=st.booleans())
    def check(document: object, again: st.DataObject, as_json: bool) -> None:
        assume(isinstance(document, dict) and document)
        assert isinstance(document, dict)
        key = again.draw(st.sampled_from(sorted(document)))
        path = tmp_path / ("config.json" if as_json else "config.yaml")
        path.write_bytes(with_key_again(document, key, again.draw(ANY), as_json))
        with pytest.raises(own) as caught:
            load(path)
        one_line(caught.value)
        assert f"duplicate key {repr(key)[:40]} (first at line " in str(caught.value)

    check()
