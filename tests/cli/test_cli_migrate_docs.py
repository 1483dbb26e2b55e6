"""docs/migrate-to-dra.md names only what exists: every `kubevirt-iommufd` command parses, every
node label is a DaemonSet's node selector, every manifest path, DaemonSet, ConfigMap key and
DeviceClass (with its extendedResourceName) is in the manifests, every webhook key is one the
webhook accepts, and the paths, variables, annotation and messages are the code's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra.claims import EXTENDED_RESOURCE_CLAIM_ANNOTATION
from hostdev.iommufd_handoff import CONTAINER_SOCKET_PATH
from hostdev.naming import pci_resource_env
from kubevirt_iommufd.cli import build_parser
from kubevirt_iommufd.demo_scenarios import SCENARIOS
from webhook.config import ConfigError
from webhook.config import parse_config as parse_webhook_config

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "migrate-to-dra.md"
CODE_BLOCK = re.compile(r"```sh\n(.*?)```", re.DOTALL)


def manifests() -> list[dict[str, Any]]:
    found = []
    for path in sorted((REPO / "manifests").rglob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    return found


def commands(text: str) -> list[list[str]]:
    lines = [line for block in CODE_BLOCK.findall(text) for line in block.splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def check_commands(text: str) -> list[str]:
    problems = []
    objects = manifests()
    daemonsets = {o["metadata"]["name"] for o in objects if o.get("kind") == "DaemonSet"}
    selectors = {
        key
        for o in objects
        if o.get("kind") == "DaemonSet"
        for key in o["spec"]["template"]["spec"].get("nodeSelector", {})
    }
    for words in commands(text):
        if words[:1] == ["kubevirt-iommufd"]:
            try:
                build_parser(words[1]).parse_args(words[1:])
            except SystemExit:
                problems.append(f"does not parse: {shlex.join(words)}")
        if words[:3] == ["kubectl", "label", "node"]:
            for label in words[4:]:
                key = label.removesuffix("-").partition("=")[0]
                if key not in selectors:
                    problems.append(f"no DaemonSet selects nodes by {key}")
        for word in words:
            name = word.removeprefix("daemonset/")
            if word.startswith("daemonset/") and name not in daemonsets:
                problems.append(f"no DaemonSet {name}")
            if word.startswith("manifests/") and not (REPO / word).exists():
                problems.append(f"no {word}")
    return problems


def check_names(text: str) -> list[str]:
    problems = []
    objects = manifests()
    for path in re.findall(r"`(manifests/[^`]+)`", text):
        if not (REPO / path).exists():
            problems.append(f"no {path}")
    classes = {
        o["metadata"]["name"]: o["spec"].get("extendedResourceName")
        for o in objects
        if o.get("kind") == "DeviceClass"
    }
    pairs = re.findall(r"`([a-z0-9.-]+)`\s*\(`extendedResourceName: ([^`]+)`\)", text)
    pairs += re.findall(r"`([a-z0-9.-]+)`\s*\(`([a-z0-9.-]+/[A-Za-z0-9_]+)`\)", text)
    if len(pairs) < 3:
        problems.append(f"only {len(pairs)} DeviceClasses named with their resource")
    for name, resource in pairs:
        if classes.get(name) != resource:
            problems.append(
                f"DeviceClass {name}: the doc says {resource}, the manifests {classes.get(name)}"
            )
    for name in re.findall(r"DeviceClass `([^`]+)`", text):
        if name not in classes:
            problems.append(f"no DeviceClass {name}")
    return problems


def check_settings(text: str) -> list[str]:
    """ConfigMap keys, webhook keys, variables and demo scenarios the doc names."""
    problems = []
    configmaps = {
        o["metadata"]["name"]: o["data"] for o in manifests() if o.get("kind") == "ConfigMap"
    }
    for name, key in re.findall(r"`(kubevirt-iommufd-[a-z]+)`,\s+key\s+`([^`]+)`", text):
        if key not in configmaps.get(name, {}):
            problems.append(f"no ConfigMap {name} with key {key}")
    for key in set(re.findall(r"`hookSidecar\.([A-Za-z]+)`", text)):
        try:
            parse_webhook_config({"hookSidecar": {"enabled": True, "image": "x", key: True}})
        except ConfigError:
            problems.append(f"the webhook has no hookSidecar.{key}")
    for variable in set(re.findall(r"PCI_RESOURCE_[A-Z0-9_]+", text)):
        if variable != pci_resource_env("nvidia.com/GH100H100_SXM5_80GB"):
            problems.append(f"{variable} is not the variable of nvidia.com/GH100H100_SXM5_80GB")
    for scenario in re.findall(r"demo --scenario ([a-z-]+)", text):
        if scenario not in SCENARIOS:
            problems.append(f"no demo scenario {scenario}")
    return problems


def check_code_strings(text: str) -> list[str]:
    """Strings the doc quotes from the code, and where the code has them."""
    sources = {
        '`resource.kubernetes.io/extended-resource-claim: "true"`': (
            EXTENDED_RESOURCE_CLAIM_ANNOTATION == "resource.kubernetes.io/extended-resource-claim"
        ),
        "`/var/run/kubevirt/iommufd.sock`": CONTAINER_SOCKET_PATH
        == "/var/run/kubevirt/iommufd.sock",
        "`cannot prepare its iommufd fd": "cannot prepare its iommufd fd"
        in (REPO / "dra" / "prepare.py").read_text(),
        "does not exist`": "does not exist: "
        in (REPO / "hostdev" / "iommufd_handoff.py").read_text(),
        "`withoutIommu: legacy`": '"legacy"' in (REPO / "hostdev" / "config.py").read_text(),
        "`pciAddresses`": '"pciAddresses"' in (REPO / "hostdev" / "config.py").read_text(),
        "`/var/lib/kubevirt-iommufd/dra`": "--state-dir=/var/lib/kubevirt-iommufd/dra"
        in (REPO / "manifests/overlays/dra/dra-daemonset.yaml").read_text(),
        "`DRAExtendedResource`": "DRAExtendedResource"
        in (REPO / "manifests/overlays/dra/deviceclasses-extended-resources.yaml").read_text(),
    }
    return [
        f"{quoted} is not in the doc" if quoted not in text else f"{quoted} is not the code's"
        for quoted, true in sources.items()
        if quoted not in text or not true
    ]


def test_the_doc_names_only_what_exists() -> None:
    text = DOC.read_text()
    assert len(commands(text)) >= 10
    assert check_commands(text) == []
    assert check_names(text) == []
    assert check_settings(text) == []
    assert check_code_strings(text) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        (
            "passthrough- kubevirt-iommufd.io/dra=true",
            "passthrough- kubevirt-iommufd.io/dra-node=true",
            "no DaemonSet selects nodes by kubevirt-iommufd.io/dra-node",
        ),
        ("dra-classes --config dra.yaml --root /", "dra-classes --cfg dra.yaml", "not parse"),
        ("daemonset/kubevirt-iommufd-dra", "daemonset/kubevirt-iommufd-driver", "no DaemonSet"),
        (
            "(`extendedResourceName: devices.kubevirt.io/iommufd`)",
            "(`extendedResourceName: devices.kubevirt.io/fd`)",
            "the doc says devices.kubevirt.io/fd",
        ),
        ("`hookSidecar.draClaims`", "`hookSidecar.draClaim`", "no hookSidecar.draClaim"),
        ("`dra.yaml`", "`driver.yaml`", "no ConfigMap kubevirt-iommufd-dra with key"),
        ("PCI_RESOURCE_NVIDIA_COM_GH100H100", "PCI_RESOURCE_NVIDIA_GH100H100", "is not the var"),
    ],
)
def test_the_check_sees_a_wrong_name(old: str, new: str, problem: str) -> None:
    text = DOC.read_text()
    assert old in text
    wrong = text.replace(old, new, 1)
    found = check_commands(wrong) + check_names(wrong) + check_settings(wrong)
    assert any(problem in p for p in found), found


def test_the_check_sees_a_quoted_string_gone() -> None:
    text = DOC.read_text().replace("`/var/run/kubevirt/iommufd.sock`", "`/run/iommufd.sock`")
    assert check_code_strings(text) == ["`/var/run/kubevirt/iommufd.sock` is not in the doc"]
