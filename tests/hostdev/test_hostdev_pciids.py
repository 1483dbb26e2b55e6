from __future__ import annotations

from pathlib import Path

import pytest

from hostdev.errors import PciIdsError
from hostdev.pciids import DEFAULT_PATHS, PciIds

SAMPLE = """\
# pci.ids sample: vendors, devices, subsystems, then classes
#	comment lines may be indented after the hash
10de  NVIDIA Corporation
	2330  GH100[H100 SXM5 80GB]
		10de 16c1  H100 SXM5 80GB
	1aef  GA102 High Definition Audio Controller
15b3  Mellanox Technologies

C 03  Display controller
	00  VGA compatible controller
		00  VGA controller
	02  3D controller
C 04  Multimedia controller
"""


def sample(tmp_path: Path, text: str = SAMPLE) -> PciIds:
    path = tmp_path / "pci.ids"
    path.write_text(text)
    return PciIds(path)


def test_names(tmp_path: Path) -> None:
    names = sample(tmp_path)
    assert names.vendor_name(0x10DE) == "NVIDIA Corporation"
    assert names.device_name(0x10DE, 0x2330) == "GH100[H100 SXM5 80GB]"
    assert names.subsystem_name(0x10DE, 0x2330, 0x10DE, 0x16C1) == "H100 SXM5 80GB"
    assert names.device_name(0x15B3, 0x2330) is None
    assert names.vendor_name(0x1234) is None


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (0x030000, "VGA controller"),
        (0x030001, "VGA compatible controller"),
        (0x030200, "3D controller"),
        (0x040300, "Multimedia controller"),
        (0x0C0330, None),
    ],
)
def test_class_names_use_the_most_specific_entry(tmp_path: Path, code: int, name: str) -> None:
    assert sample(tmp_path).class_name(code) == name


def test_nothing_is_read_until_asked(tmp_path: Path) -> None:
    path = tmp_path / "pci.ids"
    names = PciIds(path)  # does not exist yet: creating the object must not touch the file
    path.write_text(SAMPLE)
    assert names.vendor_name(0x10DE) == "NVIDIA Corporation"


def test_without_a_database_every_name_is_none(tmp_path: Path) -> None:
    for names in (PciIds(None), PciIds(tmp_path / "missing")):
        assert names.vendor_name(0x10DE) is None
        assert names.class_name(0x030200) is None


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("10de NVIDIA one space\n", 1),
        ("10de  NVIDIA\n\t23x0  Bad id\n", 2),
        ("\t2330  device before any vendor\n", 1),
        ("10de  NVIDIA\n\t\t10de  subsystem with one id\n", 2),
        ("10de  NVIDIA\n\t2330  H100\n15b3  Mellanox\n\t\t15b3 0061  before a device\n", 4),
        ("10de  NVIDIA\n\t02  a subclass below a vendor\n", 2),
        ("10de  NVIDIA\nC 03  Display controller\n\t2330  a device below a class\n", 3),
        ("C 03  Display controller\n\t\t00  an interface before a subclass\n", 2),
    ],
    ids=[
        "vendor-one-space",
        "bad-hex",
        "orphan-device",
        "short-subsystem",
        "subsystem-first-in-another-vendor",
        "subclass-under-vendor",
        "device-under-class",
        "prog-if-first",
    ],
)
def test_malformed_database_names_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    """Whichever name is asked: the whole file is checked at the first look-up, though only
    the vendors asked for are parsed."""
    names = sample(tmp_path, text)
    with pytest.raises(PciIdsError) as caught:
        names.vendor_name(0x10DE)
    assert caught.value.line_number == line
    assert str(caught.value).startswith(f"{tmp_path / 'pci.ids'}:{line}: unexpected line")
    assert "--pci-ids none" in str(caught.value)


@pytest.mark.skipif(not DEFAULT_PATHS[0].is_file(), reason="Debian package pci.ids not installed")
def test_debian_database_gives_nvidia_plugin_names() -> None:
    names = PciIds(DEFAULT_PATHS[0])
    assert names.device_name(0x10DE, 0x2330) == "GH100[H100 SXM5 80GB]"
