from __future__ import annotations

import pytest

from hostdev.bdf import Bdf, is_bdf
from hostdev.errors import InvalidBdf


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0000:3b:00.0", Bdf(0, 0x3B, 0, 0)),
        ("0000:00:1f.7", Bdf(0, 0, 0x1F, 7)),
        ("10000:e1:00.1", Bdf(0x10000, 0xE1, 0, 1)),  # VMD domain, as the kernel prints it
        ("ffff:ff:1f.7", Bdf(0xFFFF, 0xFF, 0x1F, 7)),
    ],
    ids=["gpu", "max-slot", "vmd-domain", "all-max"],
)
def test_parses_kernel_form(text: str, expected: Bdf) -> None:
    assert Bdf.parse(text) == expected
    assert str(expected) == text
    assert is_bdf(text)


@pytest.mark.parametrize(
    "text",
    [
        "0000:3B:00.0",
        "3b:00.0",
        "0000:3b:00",
        "0000:3b:20.0",
        "0000:3b:00.8",
        "000:3b:00.0",
        " 0000:3b:00.0",
        "0000:3b:00.0\n",
        "../0000:3b:00.0",
        "0000:3b:00.0/../../etc",
        "..",
        "",
        "0000:3b:00.0:1",
    ],
    ids=[
        "upper-case",
        "no-domain",
        "no-function",
        "slot-over-1f",
        "function-over-7",
        "short-domain",
        "leading-space",
        "newline",
        "parent-dir",
        "traversal",
        "dotdot",
        "empty",
        "trailing",
    ],
)
def test_refuses_anything_else(text: str) -> None:
    with pytest.raises(InvalidBdf) as caught:
        Bdf.parse(text)
    assert repr(text) in str(caught.value)
    assert "dddd:bb:ss.f" in str(caught.value)
    assert not is_bdf(text)


def test_orders_by_address_and_names_the_device() -> None:
    addresses = [Bdf.parse(t) for t in ("0000:3b:00.1", "0000:18:00.0", "0000:3b:00.0")]
    assert [str(b) for b in sorted(addresses)] == ["0000:18:00.0", "0000:3b:00.0", "0000:3b:00.1"]
    assert Bdf.parse("0000:3b:00.1").device_address == "0000:3b:00"
