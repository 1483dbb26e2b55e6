"""The PCIe AER counters as the kernel prints them, and as the simulated host writes them."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hostdev.aer import FATAL_TOTAL, AerCounts, parse_aer_total, read_aer_counts
from hostdev.bdf import Bdf
from sim.host import BuildHost, hgx_h100, remove_function, report_aer_error

# The kernel's sample (Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats), shortened.
FATAL = """Undefined 0
Data Link Protocol 0
Surprise Down Error 0
Poisoned TLP 2
Completion Timeout 1
TOTAL_ERR_FATAL 3
"""


@pytest.mark.parametrize(
    ("text", "count"),
    [
        (FATAL, 3),
        ("TOTAL_ERR_FATAL 0\n", 0),
        ("Undefined 0\n", None),
        ("TOTAL_ERR_FATAL many\n", None),
        ("TOTAL_ERR_FATAL -1\n", None),
        ("TOTAL_ERR_FATAL \u00b2\n", None),
        ("TOTAL_ERR_NONFATAL 4\n", None),
        ("", None),
        ("Undefined 0\r\nTOTAL_ERR_FATAL 7\r\n", 7),
        ("TOTAL_ERR_FATAL x\nTOTAL_ERR_FATAL 5\n", 5),
        ("A TOTAL_ERR_FATAL 1\nTOTAL_ERR_FATAL 2", 2),
        ("TOTAL_ERR_FATAL 3 4\n", None),
    ],
    ids=[
        "kernel sample",
        "total alone",
        "no total",
        "not a number",
        "negative",
        "a digit int() refuses",
        "the other total",
        "empty",
        "CRLF line ends",
        "a bad total line, then a good one",
        "the name inside a line first",
        "two counts",
    ],
)
def test_the_total_is_read_from_its_line(text: str, count: int | None) -> None:
    assert parse_aer_total(text, FATAL_TOTAL) == count


def test_the_simulated_host_counts_errors_as_the_kernel(build_host: BuildHost) -> None:
    root = build_host(hgx_h100())
    bdf = "0000:18:00.0"
    assert read_aer_counts(root, Bdf.parse(bdf)) == AerCounts(0, 0)
    report_aer_error(root, bdf, fatal=True)
    report_aer_error(root, bdf, fatal=False)
    report_aer_error(root, bdf, fatal=False)
    assert read_aer_counts(root, Bdf.parse(bdf)) == AerCounts(1, 2)
    text = (root / "sys/bus/pci/devices" / bdf / "aer_dev_fatal").read_text()
    assert text.splitlines()[-1] == "TOTAL_ERR_FATAL 1"
    assert "Completion Timeout 1" in text.splitlines()


def test_no_counters_for_a_function_without_them(build_host: BuildHost) -> None:
    root = build_host(hgx_h100())
    bdf = "0000:18:00.0"
    (root / "sys/bus/pci/devices" / bdf / "aer_dev_nonfatal").unlink()
    assert read_aer_counts(root, Bdf.parse(bdf)) is None
    remove_function(root, "0000:2a:00.0")
    assert read_aer_counts(root, Bdf.parse("0000:2a:00.0")) is None


@pytest.mark.parametrize(
    "content",
    [b"TOTAL_ERR_FATAL \xff\xfe\n", "TOTAL_ERR_FATAL \u00b2\n".encode()],
    ids=["not UTF-8", "superscript digit"],
)
def test_a_garbled_counter_file_is_no_counters(build_host: BuildHost, content: bytes) -> None:
    # The driver's event thread reads these: a ValueError out of here would end it.
    root = build_host(hgx_h100())
    bdf = "0000:18:00.0"
    (root / "sys/bus/pci/devices" / bdf / "aer_dev_fatal").write_bytes(content)
    assert read_aer_counts(root, Bdf.parse(bdf)) is None


def _line_by_line(text: str, total: str) -> int | None:
    """What `parse_aer_total` answers, by its definition: the first line that is the total's."""
    for line in text.splitlines():
        name, _, count = line.rpartition(" ")
        if name == total and count.isascii() and count.isdigit():
            return int(count)
    return None


_PIECES = st.sampled_from(
    [
        FATAL_TOTAL,
        " ",
        "\n",
        "\r",
        "\r\n",
        "\x0b",
        "\u2028",
        "0",
        "12",
        "\u00b2",
        "x",
        "Undefined 0\n",
    ]
)


@given(st.lists(_PIECES, max_size=12).map("".join))
@example(FATAL)
def test_the_total_is_found_as_line_by_line(text: str) -> None:
    assert parse_aer_total(text, FATAL_TOTAL) == _line_by_line(text, FATAL_TOTAL)
