"""Configuration files: what they mean, and errors that name the key and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from webhook.config import Config, ConfigError, HookSidecar, parse_config, read_config

FULL_YAML = """\
managedResources:
  names: [intel.com/qat_4xxx]
  prefixes: [nvidia.com/, amd.com/]
strict: true
skip:
  namespaces: [kube-system, ci]
  vmiLabels:
    iommufd.kubevirt.io/inject: "false"
hookSidecar:
  enabled: true
  image: ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0
  imagePullPolicy: Always
  args: [hook, --policy, prefer]
"""


def test_a_missing_config_means_nvidia_prefix_no_sidecar_not_strict() -> None:
    config = parse_config({})

    assert config == Config()
    assert config.is_managed("nvidia.com/GH100_H100")
    assert not config.is_managed("intel.com/qat_4xxx")
    assert config.hook_sidecar is None
    assert not config.strict


def test_a_full_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "webhook.yaml"
    path.write_text(FULL_YAML)

    config = read_config(path)

    assert config.resource_names == {"intel.com/qat_4xxx"}
    assert config.resource_prefixes == ("nvidia.com/", "amd.com/")
    assert config.strict
    assert config.skip_namespaces == {"kube-system", "ci"}
    assert dict(config.skip_labels) == {"iommufd.kubevirt.io/inject": "false"}
    assert config.hook_sidecar == HookSidecar(
        image="ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0",
        image_pull_policy="Always",
        args=("hook", "--policy", "prefer"),
    )
    assert config.is_managed("amd.com/MI300X")
    assert config.is_managed("intel.com/qat_4xxx")
    assert not config.is_managed("intel.com/qat_c62x")


def test_a_json_file_means_the_same(tmp_path: Path) -> None:
    path = tmp_path / "webhook.json"
    path.write_text(json.dumps(yaml.safe_load(FULL_YAML)))
    yaml_path = tmp_path / "webhook.yaml"
    yaml_path.write_text(FULL_YAML)

    assert read_config(path) == read_config(yaml_path)


def test_an_empty_file_is_the_default(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing configured\n")

    assert read_config(path) == Config()


def test_names_alone_drop_the_default_prefix() -> None:
    config = parse_config({"managedResources": {"names": ["nvidia.com/GH100_H100"]}})

    assert config.is_managed("nvidia.com/GH100_H100")
    assert not config.is_managed("nvidia.com/AD102GL_L40S")


def test_skips_say_why() -> None:
    config = parse_config({"skip": {"namespaces": ["ci"], "vmiLabels": {"team": "infra"}}})

    assert config.skips("ci", {}) == "namespace ci is opted out"
    assert config.skips("vms", {"team": "infra"}) == "label team=infra opts it out"
    assert config.skips("vms", {"team": "ml"}) is None


@pytest.mark.parametrize(
    ("document", "key", "expected"),
    [
        pytest.param([], "top level", "mapping", id="top-level-list"),
        pytest.param({"stricts": True}, "stricts", "expected one of", id="unknown-top-key"),
        pytest.param(
            {"skip": {"namespace": ["ci"]}}, "skip.namespace", "namespaces", id="misspelt-skip"
        ),
        pytest.param({"strict": "yes"}, "strict", "true or false", id="strict-not-bool"),
        pytest.param(
            {"managedResources": {"names": ["GH100"]}},
            "managedResources.names",
            "domain/name",
            id="name-without-domain",
        ),
        pytest.param(
            {"managedResources": {"names": ["devices.kubevirt.io/iommufd"]}},
            "managedResources.names",
            "what the webhook adds",
            id="iommufd-as-managed",
        ),
        pytest.param(
            {"managedResources": {"prefixes": ["nvidia"]}},
            "managedResources.prefixes",
            "no '/'",
            id="prefix-without-slash",
        ),
        pytest.param(
            {"managedResources": {"names": [], "prefixes": []}},
            "managedResources",
            "at least one",
            id="nothing-managed",
        ),
        pytest.param(
            {"managedResources": {"prefixes": "nvidia.com/"}},
            "managedResources.prefixes",
            "list of non-empty strings",
            id="prefixes-a-string",
        ),
        pytest.param(
            {"skip": {"vmiLabels": {"inject": False}}},
            "skip.vmiLabels",
            'quote "true"/"false"',
            id="label-value-a-bool",
        ),
        pytest.param(
            {"hookSidecar": {"enabled": True}},
            "hookSidecar.image",
            "image reference",
            id="sidecar-without-image",
        ),
        pytest.param(
            {"hookSidecar": {"enabled": True, "image": "x", "imagePullPolicy": "always"}},
            "hookSidecar.imagePullPolicy",
            "IfNotPresent",
            id="pull-policy-case",
        ),
        pytest.param(
            {"hookSidecar": {"enabled": True, "image": "x", "args": [1]}},
            "hookSidecar.args",
            "list of non-empty strings",
            id="args-not-strings",
        ),
    ],
)
def test_errors_name_the_key_and_what_was_expected(
    document: object, key: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document)

    assert key in str(caught.value)
    assert expected in str(caught.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "webhook.yaml"
    path.write_text("strict: [\n")

    with pytest.raises(ConfigError, match=r"webhook\.yaml is not valid YAML"):
        read_config(path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_config(tmp_path / "absent.yaml")
    path.write_text("strict: 1\n")
    with pytest.raises(ConfigError, match=r"webhook\.yaml: strict: expected true or false"):
        read_config(path)
