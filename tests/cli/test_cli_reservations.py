"""The reservations file `bind --from-config` reads: errors that name the key or the file, and
its devices resolved on a host."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostdev.bdf import Bdf
from hostdev.binding.plan import BindRequest
from hostdev.scan import scan_host
from kubevirt_iommufd.reservations import (
    ReservationError,
    load_reservations,
    parse_reservations,
    resolve_reservations,
)
from sim.host import BuildHost, hgx_h100

B = Bdf.parse


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "the document: expected a mapping, got list []"),
        ({"devices": {}}, "devices: expected a list, got dict {}"),
        ({"devices": [{"pciAddress": "0000:3b:00.0"}], "extra": 1}, "extra: unknown key"),
        ({"devices": [{}]}, "devices[0]: give exactly one of pciAddress and match"),
        (
            {"devices": [{"pciAddress": 3900000.0}]},
            "devices[0].pciAddress: expected a non-empty string, got float 3900000.0; quote PCI"
            " addresses and ids in YAML",
        ),
        ({"devices": [{"pciAddress": "3b:00.0"}]}, "devices[0].pciAddress: invalid PCI address"),
        ({"devices": [{"match": "nvidia"}]}, "devices[0].match: invalid device selector"),
        (
            {"devices": [{"match": "10de:2330", "driver": "a b"}]},
            "devices[0].driver: expected auto or a driver name such as vfio-pci, got 'a b'",
        ),
        ({"driver": "", "devices": [{"match": "10de:2330"}]}, "driver: expected a non-empty"),
    ],
)
def test_reservation_errors_name_the_key(document: object, message: str) -> None:
    with pytest.raises(ReservationError) as caught:
        parse_reservations(document)
    assert str(caught.value).startswith(message)


def test_reservations_file_resolves_on_a_host(build_host: BuildHost, tmp_path: Path) -> None:
    inventory = scan_host(build_host(hgx_h100()))
    path = tmp_path / "reserved.yaml"
    path.write_text(
        'driver: vfio-pci\ndevices:\n  - pciAddress: "0000:18:00.0"\n    driver: auto\n'
        '  - match: "10de:2330"\n  - match: "15b3:101e"\n'
    )
    requests = resolve_reservations(load_reservations(path), inventory)
    assert len(requests) == 8
    assert requests[0] == BindRequest(B("0000:18:00.0"), "auto")
    assert requests[1] == BindRequest(B("0000:2a:00.0"), "vfio-pci")


def test_reservations_naming_a_missing_address_fail(build_host: BuildHost, tmp_path: Path) -> None:
    inventory = scan_host(build_host(hgx_h100()))
    path = tmp_path / "reserved.json"
    path.write_text('{"devices": [{"pciAddress": "0000:01:00.0"}]}')
    with pytest.raises(ReservationError) as caught:
        resolve_reservations(load_reservations(path), inventory)
    assert str(caught.value).startswith(
        "devices[0].pciAddress: no PCI function 0000:01:00.0 on this host"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("devices: [\n", "is not valid YAML at line 2, column 1"),
        ("devices:\n  - pciAddress: 0000:18:00.0\n", "quote PCI addresses"),
    ],
)
def test_reservations_file_errors_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "reserved.yaml"
    path.write_text(text)
    with pytest.raises(ReservationError) as caught:
        load_reservations(path)
    assert str(caught.value).startswith(f"reservations {path}")
    assert message in str(caught.value)
