"""The hook's edge: domain XML and VMI JSON parsed into values, or refused with a reason.

The domain arrives from virt-launcher, but a chained hook before us may have produced it, so it is
treated as untrusted: libxml2 gets no entity expansion, no DTD loading and no network, the input
is capped, and any DOCTYPE is refused outright (KubeVirt never writes one, and an internal subset
is where entity tricks live).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import cast

from lxml import etree

from hostdev.untrusted import quote_untrusted
from launcher_hook.errors import InvalidInput
from launcher_hook.model import Vmi

MAX_DOMAIN_BYTES = 4 * 1024 * 1024
MAX_VMI_BYTES = 4 * 1024 * 1024
_BOM = b"\xef\xbb\xbf"


def parse_domain_xml(data: bytes) -> etree._ElementTree:
    """Parse a libvirt domain document safely; refuse anything else."""
    if len(data) > MAX_DOMAIN_BYTES:
        raise InvalidInput(
            f"domain XML is {len(data)} bytes, over the {MAX_DOMAIN_BYTES} byte limit"
        )
    # A parser per call: lxml parsers keep per-document state and the gRPC server is threaded.
    parser = etree.XMLParser(
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,
        strip_cdata=False,
    )
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError as error:
        # libxml2 quotes the document in its messages: names, namespace URIs with newlines.
        raise InvalidInput(f"domain XML is malformed: {quote_untrusted(str(error), 300)}") from None
    tree = root.getroottree()
    # lxml gives every DOCTYPE, with or without an internal subset, an internalDTD object.
    if cast(object, tree.docinfo.internalDTD) is not None:
        raise InvalidInput("domain XML has a DOCTYPE; libvirt domain XML never needs one")
    if root.tag != "domain":
        raise InvalidInput(
            f"expected a libvirt <domain> document, found {quote_untrusted(str(root.tag))}"
        )
    return tree


def serialize_domain(tree: etree._ElementTree, original: bytes) -> bytes:
    """UTF-8 XML, with a declaration and a final newline only when the input had them."""
    declared = original.removeprefix(_BOM).startswith(b"<?xml")
    output = etree.tostring(tree, encoding="UTF-8", xml_declaration=declared)
    return output + b"\n" if original.endswith(b"\n") else output


def parse_vmi(data: bytes) -> Vmi:
    """Name, namespace and annotations of the VMI JSON virt-launcher passes along."""
    if len(data) > MAX_VMI_BYTES:
        raise InvalidInput(f"VMI JSON is {len(data)} bytes, over the {MAX_VMI_BYTES} byte limit")
    if not data.strip():
        return Vmi(name="(unnamed)", namespace="(unknown)")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise InvalidInput(f"VMI is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(document, Mapping):
        raise InvalidInput("VMI JSON is not an object")
    metadata = document.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise InvalidInput("VMI metadata is not an object")
    annotations = metadata.get("annotations") or {}
    if not isinstance(annotations, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
    ):
        raise InvalidInput("VMI metadata.annotations is not a map of strings")
    return Vmi(
        name=str(metadata.get("name") or "(unnamed)"),
        namespace=str(metadata.get("namespace") or "(unknown)"),
        annotations=dict(annotations),
    )
