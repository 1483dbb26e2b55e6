"""`hookSidecar.draClaims`: the hook sidecar for VMIs whose GPUs or host devices come from DRA
claims, with the rules device-plugin VMIs have (added once, another release of our hook counts,
opt-outs respected, an unreadable entry warns or, with `strict`, denies), over real HTTPS."""

from __future__ import annotations

import copy
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from webhook.config import ConfigError, parse_config
from webhook_kit import (
    Tls,
    admission_review,
    admit,
    apply_patch,
    decode_patch,
    https,
    make_tls,
    running_server,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests/examples"
HOOKS = "hooks.kubevirt.io/hookSidecars"
IMAGE = "ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0"
Json = dict[str, Any]


def config(**sidecar: Any) -> Any:
    """The configuration as an operator writes it, through the webhook's own parser."""
    return parse_config(
        {
            "skip": {"namespaces": ["ml"], "vmiLabels": {"iommufd.kubevirt.io/inject": "false"}},
            "hookSidecar": {"enabled": True, "image": IMAGE, **sidecar},
        }
    )


def example_vmi(name: str) -> Json:
    """The VMI of a repository example (manifests/examples), as the API server sends it."""
    documents = yaml.safe_load_all((EXAMPLES / name).read_text())
    (vmi,) = [d for d in documents if d and d["kind"] == "VirtualMachineInstance"]
    assert isinstance(vmi, dict)
    return vmi


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    return make_tls(tmp_path)


@pytest.fixture
def on(tls: Tls) -> Iterator[http.client.HTTPSConnection]:
    with running_server(config(draClaims=True), tls) as server:
        connection = https(server, tls)
        yield connection
        connection.close()


def mutate(conn: http.client.HTTPSConnection, vmi: Json, namespace: str | None = None) -> Json:
    review = admission_review(vmi, kind="VirtualMachineInstance", namespace=namespace)
    return admit(conn, "/mutate-vmi", review)


@pytest.mark.parametrize("example", ["vmi-gpu-dra.yaml", "vmi-hostdevice-dra.yaml"])
def test_a_dra_vmi_gets_the_sidecar_once(on: http.client.HTTPSConnection, example: str) -> None:
    vmi = example_vmi(example)

    answer = mutate(on, vmi)

    patched = apply_patch(vmi, answer)
    entries = json.loads(patched["metadata"]["annotations"][HOOKS])
    assert [e["image"] for e in entries] == [IMAGE]
    expected = copy.deepcopy(vmi)
    expected.setdefault("metadata", {}).setdefault("annotations", {})[HOOKS] = patched["metadata"][
        "annotations"
    ][HOOKS]
    assert patched == expected
    # Reinvocation (reinvocationPolicy: IfNeeded) and a VMI re-created from it: no second entry.
    assert decode_patch(mutate(on, patched)) == []


def test_the_switch_is_off_by_default(tls: Tls) -> None:
    vmi = example_vmi("vmi-gpu-dra.yaml")
    with running_server(config(), tls) as server:
        conn = https(server, tls)
        assert decode_patch(mutate(conn, vmi)) == []
        conn.close()


def test_a_device_plugin_vmi_still_gets_it_beside_the_switch(
    on: http.client.HTTPSConnection,
) -> None:
    vmi = example_vmi("vmi-gpu.yaml")
    assert len(decode_patch(mutate(on, vmi))) == 1


def test_another_release_of_our_hook_counts_as_present(on: http.client.HTTPSConnection) -> None:
    vmi = example_vmi("vmi-gpu-dra.yaml")
    entry = {"image": "ghcr.io/kubevirt-iommufd/kubevirt-iommufd@sha256:" + "ab" * 32}
    vmi.setdefault("metadata", {}).setdefault("annotations", {})[HOOKS] = json.dumps([entry])
    assert decode_patch(mutate(on, vmi)) == []


def test_opted_out_vmis_are_left_alone(on: http.client.HTTPSConnection) -> None:
    vmi = example_vmi("vmi-gpu-dra.yaml")
    assert decode_patch(mutate(on, vmi, namespace="ml")) == []
    vmi["metadata"]["labels"] = {"iommufd.kubevirt.io/inject": "false"}
    assert decode_patch(mutate(on, vmi)) == []


def test_a_claim_entry_without_its_request_warns(on: http.client.HTTPSConnection) -> None:
    vmi = example_vmi("vmi-gpu-dra.yaml")
    del vmi["spec"]["domain"]["devices"]["gpus"][0]["requestName"]

    answer = mutate(on, vmi)

    assert answer["response"]["allowed"] is True
    assert "patch" not in answer["response"]
    assert "claimName and requestName" in answer["response"]["warnings"][0]


def test_with_strict_a_claim_entry_without_its_request_is_denied(tls: Tls) -> None:
    vmi = example_vmi("vmi-gpu-dra.yaml")
    vmi["spec"]["domain"]["devices"]["gpus"][0]["requestName"] = 7
    strict = parse_config(
        {"strict": True, "hookSidecar": {"enabled": True, "image": IMAGE, "draClaims": True}}
    )
    with running_server(strict, tls) as server:
        conn = https(server, tls)
        answer = mutate(conn, vmi)
        conn.close()
    assert answer["response"]["allowed"] is False
    assert "spec.domain.devices.gpus[0]" in answer["response"]["status"]["message"]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_switch_takes_only_true_or_false(value: object) -> None:
    with pytest.raises(ConfigError, match=r"hookSidecar\.draClaims: expected true or false"):
        config(draClaims=value)
