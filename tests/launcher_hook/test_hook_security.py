"""Hostile domain XML is refused without reading a file or the network.

"Not read" is proven, not assumed: the files named are FIFOs, so a parser that opened one would
block until a writer came, and the test would time out; the URLs point at a listening socket
that must have no connection queued afterwards.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from xml.sax import saxutils

import pytest

from hook_kit import read_data
from launcher_hook.capabilities import LibvirtVersionSource
from launcher_hook.domain import rewrite_domain
from launcher_hook.errors import HookError, InvalidInput, IommufdRequired
from launcher_hook.handler import HookConfig, define_domain
from launcher_hook.model import (
    ANNOTATION_LIBVIRT_VERSION,
    ANNOTATION_MODE,
    Capabilities,
    LibvirtVersion,
    Policy,
)
from launcher_hook.parse import MAX_DOMAIN_BYTES, MAX_VMI_BYTES, parse_vmi

CAPS = Capabilities(kernel_iommufd=True, devices={}, libvirt=None)
BODY = "<name>evil</name><memory>1</memory><os><type>hvm</type></os><devices/>"


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    os.mkfifo(path)
    return path


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server, f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def refuse(xml: bytes) -> str:
    """Run the rewrite in a thread with a deadline; the error message it refused with."""
    outcome: list[BaseException | bytes] = []

    def attempt() -> None:
        try:
            outcome.append(rewrite_domain(xml, b"", CAPS, Policy.AUTO).domain_xml)
        except HookError as error:
            outcome.append(error)

    worker = threading.Thread(target=attempt, daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "the parser blocked: it opened a file it was pointed at"
    assert time.monotonic() - started < 1
    (result,) = outcome
    assert isinstance(result, InvalidInput), f"accepted: {result!r}"
    return str(result)


def assert_no_connection(listener: tuple[socket.socket, str]) -> None:
    with pytest.raises(BlockingIOError):
        listener[0].accept()


def test_xxe_file_entity(fifo: Path) -> None:
    xml = (
        f'<!DOCTYPE domain [<!ENTITY xxe SYSTEM "file://{fifo}">]>'
        f'<domain type="kvm">{BODY}<description>&xxe;</description></domain>'
    )
    assert "DOCTYPE" in refuse(xml.encode())


def test_xxe_network_entity(listener: tuple[socket.socket, str]) -> None:
    xml = (
        f'<!DOCTYPE domain [<!ENTITY xxe SYSTEM "{listener[1]}/x">]>'
        f'<domain type="kvm">{BODY}<description>&xxe;</description></domain>'
    )
    assert "DOCTYPE" in refuse(xml.encode())
    assert_no_connection(listener)


def test_parameter_entities(fifo: Path, listener: tuple[socket.socket, str]) -> None:
    xml = (
        f'<!DOCTYPE domain [<!ENTITY % local SYSTEM "file://{fifo}"> %local;'
        f' <!ENTITY % remote SYSTEM "{listener[1]}/p"> %remote;]><domain type="kvm">{BODY}</domain>'
    )
    refuse(xml.encode())
    assert_no_connection(listener)


@pytest.mark.parametrize("scheme", ["file", "http"])
def test_external_dtd(scheme: str, fifo: Path, listener: tuple[socket.socket, str]) -> None:
    url = f"file://{fifo}" if scheme == "file" else f"{listener[1]}/domain.dtd"
    xml = f'<!DOCTYPE domain SYSTEM "{url}"><domain type="kvm">{BODY}</domain>'
    assert "DOCTYPE" in refuse(xml.encode())
    assert_no_connection(listener)


def test_billion_laughs() -> None:
    entities = '<!ENTITY lol0 "lol">' + "".join(
        f'<!ENTITY lol{i} "{f"&lol{i - 1};" * 10}">' for i in range(1, 10)
    )
    xml = (
        f"<!DOCTYPE domain [{entities}]>"
        f"<domain type='kvm'>{BODY}<description>&lol9;</description></domain>"
    )
    message = refuse(xml.encode())
    # libxml2 may stop the amplification itself before our DOCTYPE check sees the tree.
    assert "DOCTYPE" in message or "amplification" in message


def test_xinclude_is_not_processed(fifo: Path) -> None:
    xml = (
        f'<domain type="kvm" xmlns:xi="http://www.w3.org/2001/XInclude">{BODY}'
        f'<xi:include href="file://{fifo}" parse="text"/></domain>'
    ).encode()
    result: list[bytes] = []
    worker = threading.Thread(
        target=lambda: result.append(rewrite_domain(xml, b"", CAPS, Policy.AUTO).domain_xml),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert result == [xml]  # no PCI hostdev: passed through untouched, include and all


def test_undeclared_entity_is_malformed() -> None:
    message = refuse(f'<domain type="kvm">{BODY}<description>&xxe;</description></domain>'.encode())
    assert message.startswith("domain XML is malformed: 'Entity \\'xxe\\' not defined")


def test_oversized_domain_is_refused_before_parsing() -> None:
    padding = b"<!--" + b"x" * MAX_DOMAIN_BYTES + b"-->"
    xml = read_data("kubevirt-gpus.xml").replace(b"<devices>", padding + b"<devices>", 1)
    assert refuse(xml) == (
        f"domain XML is {len(xml)} bytes, over the {MAX_DOMAIN_BYTES} byte limit"
    )


def test_largest_allowed_domain_is_accepted() -> None:
    base = read_data("kubevirt-gpus.xml")
    filler = MAX_DOMAIN_BYTES - len(base) - len(b"<!---->")
    xml = base.replace(b"<devices>", b"<!--" + b"x" * filler + b"--><devices>", 1)
    assert len(xml) == MAX_DOMAIN_BYTES
    assert rewrite_domain(xml, b"", CAPS, Policy.AUTO).domain_xml.count(b"x" * 1000) > 0


def test_deep_nesting_is_refused() -> None:
    xml = f"<domain type='kvm'>{BODY}{'<a>' * 300}{'</a>' * 300}</domain>".encode()
    assert refuse(xml).startswith("domain XML is malformed: ")


@pytest.mark.parametrize(
    ("vmi", "message"),
    [
        (b"{not json", "VMI is not valid JSON"),
        (b"[]", "VMI JSON is not an object"),
        (b'{"metadata": {"annotations": {"a": 1}}}', "not a map of strings"),
        (b"[" * 100_000, "VMI is not valid JSON"),
        (b" " * (MAX_VMI_BYTES + 1), "over the"),
    ],
    ids=["malformed", "array", "annotation-types", "deep", "oversized"],
)
def test_bad_vmi_is_refused(vmi: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_vmi(vmi)


# Untrusted text in logs and errors ------------------------------------------------------------

FORGED = "x\nCRITICAL launcher_hook: forged\r\u202egnp.exe"
PCI_SOURCE = "<source><address domain='0' bus='0x18' slot='0' function='0'/></source>"


def hostile_domain(alias: str, preset: str = "no") -> bytes:
    quoted = saxutils.quoteattr(alias, {"\n": "&#10;", "\r": "&#13;"})
    return (
        f"<domain type='kvm'>{BODY[: -len('<devices/>')]}<devices>"
        f"<hostdev mode='subsystem' type='pci'><driver iommufd={saxutils.quoteattr(preset)}/>"
        f"{PCI_SOURCE}<alias name={quoted}/></hostdev></devices></domain>"
    ).encode()


def hostile_vmi(name: str, **annotations: str) -> bytes:
    metadata = {"name": name, "namespace": "ns", "annotations": annotations}
    return json.dumps({"metadata": metadata}).encode()


def assert_one_short_line(text: str, limit: int) -> None:
    assert len(text) < limit
    assert text.isprintable(), repr(text)


@pytest.mark.parametrize("size", [1, 5_000], ids=["forged-line", "huge"])
def test_names_are_logged_quoted_on_one_short_line(
    size: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = HookConfig(Policy.AUTO, tmp_path, LibvirtVersionSource(None, LibvirtVersion(12, 9)))
    alias, name = FORGED * size, FORGED * size
    with caplog.at_level("INFO", logger="launcher_hook"):
        define_domain(hostile_domain(alias, preset=FORGED), hostile_vmi(name), config)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "launcher_hook"]
    assert_one_short_line(message, 1200)
    assert message.startswith("vmi 'ns/x\\nCRITICAL launcher_hook: forged\\r\\u202egnp.exe")
    assert "<driver iommufd='x\\nCRITICAL " in message


@pytest.mark.parametrize("size", [1, 5_000], ids=["forged-line", "huge"])
def test_require_error_names_devices_on_one_short_line(size: int) -> None:
    caps = Capabilities(True, {}, None)
    with pytest.raises(IommufdRequired) as raised:
        rewrite_domain(
            hostile_domain(FORGED * size), hostile_vmi(FORGED * size), caps, Policy.REQUIRE
        )
    assert_one_short_line(str(raised.value), 1500)
    assert "hostdev 'x\\nCRITICAL launcher_hook: forged" in str(raised.value)


@pytest.mark.parametrize(
    ("xml", "vmi"),
    [
        (hostile_domain("a"), hostile_vmi(FORGED, **{ANNOTATION_MODE: FORGED})),
        (hostile_domain("a"), hostile_vmi(FORGED, **{ANNOTATION_LIBVIRT_VERSION: FORGED})),
        (f"<domain xmlns='urn:{'&#10;x' * 50_000}'/>".encode(), b""),
        (f"<domain><{'a' * 40_000}></b></domain>".encode(), b""),
        (f"<domain>&{'e' * 40_000};</domain>".encode(), b""),
    ],
    ids=["mode-annotation", "libvirt-annotation", "namespace", "tag-mismatch", "entity"],
)
def test_refusals_are_one_short_line(xml: bytes, vmi: bytes) -> None:
    with pytest.raises(InvalidInput) as raised:
        rewrite_domain(xml, vmi, CAPS, Policy.AUTO)
    assert_one_short_line(str(raised.value), 600)
