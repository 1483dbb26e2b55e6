"""The device plugin's node labels in its NFD feature file, kept current on a simulated node."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from dp_kit import GPUS, H100, Plugin
from hostdev.config import DeviceMode, NodeLabelsConfig, default_config
from hostdev.labels.feature_file import FeatureFile
from hostdev.labels.node_patch import NodeLabeler
from hostdev.labels.publisher import LabelPublisher, feature_file_path
from kubevirt_iommufd.cli import main
from sim.apiserver import running_apiserver
from sim.host import unbind_driver

COUNT = "kubevirt-iommufd.io/iommufd-devices.nvidia.com_GH100H100_SXM5_80GB"
# Well under the 30 s periodic re-scan: a change seen this fast came from the watch.
EVENT_LATENCY = 5.0


def read_labels(path: Path) -> dict[str, str] | None:
    """The file as NFD's local source reads it: `key[=value]` lines, `#` lines skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    labels: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            assert not line.startswith("# +"), "an NFD directive"
            continue
        key, _, value = line.partition("=")
        labels[key] = value or "true"
    return labels


def wait_for(path: Path, predicate: Callable[[dict[str, str] | None], bool]) -> float:
    """Seconds until the file says what `predicate` wants; fails after EVENT_LATENCY."""
    started = time.monotonic()
    while not predicate(read_labels(path)):
        elapsed = time.monotonic() - started
        assert elapsed < EVENT_LATENCY, f"the feature file still says {read_labels(path)}"
        time.sleep(0.005)
    return time.monotonic() - started


def count_is(count: int) -> Callable[[dict[str, str] | None], bool]:
    return lambda labels: (labels or {}).get(COUNT) == str(count)


def test_feature_file_holds_the_labels_and_goes_on_a_clean_stop(
    start_plugin: Callable[..., Plugin], tmp_path: Path
) -> None:
    path = tmp_path / "features.d" / "kubevirt-iommufd-plugin"
    plugin = start_plugin(labels=LabelPublisher(FeatureFile(path, "plugin")))
    plugin.kubelet.wait_registered(H100)
    assert path.read_text() == (
        "# kubevirt-iommufd plugin: written on every change, removed when it stops\n"
        "kubevirt-iommufd.io/iommufd=true\n"
        "kubevirt-iommufd.io/vfio-cdev=true\n"
        "kubevirt-iommufd.io/kernel=6.12\n"
        f"{COUNT}=8\n"
    )
    assert path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    plugin.stop()
    assert not path.exists()


def test_unbinding_the_last_cdev_device_turns_iommufd_false(
    start_plugin: Callable[..., Plugin], tmp_path: Path
) -> None:
    path = tmp_path / "kubevirt-iommufd-plugin"
    plugin = start_plugin(labels=LabelPublisher(FeatureFile(path, "plugin")))
    wait_for(path, count_is(8))
    latencies = []
    for left, gpu in reversed(list(enumerate(GPUS))):
        unbind_driver(plugin.root, gpu)
        latencies.append(wait_for(path, count_is(left)))
    labels = read_labels(path)
    assert labels is not None
    # The GPUs stay advertised (Unhealthy), so the resource keeps its count label, at 0.
    assert labels["kubevirt-iommufd.io/iommufd"] == "false"
    assert labels[COUNT] == "0"
    print(f"label latency per unbind: max {max(latencies) * 1000:.1f} ms")


def test_dev_iommu_gone_turns_iommufd_false_and_back(
    start_plugin: Callable[..., Plugin], tmp_path: Path
) -> None:
    path = tmp_path / "kubevirt-iommufd-plugin"
    plugin = start_plugin(labels=LabelPublisher(FeatureFile(path, "plugin")))
    wait_for(path, lambda labels: (labels or {}).get("kubevirt-iommufd.io/iommufd") == "true")
    (plugin.root / "dev/iommu").unlink()
    wait_for(path, lambda labels: (labels or {}).get("kubevirt-iommufd.io/iommufd") == "false")
    assert read_labels(path) == {
        "kubevirt-iommufd.io/iommufd": "false",
        "kubevirt-iommufd.io/vfio-cdev": "true",
        "kubevirt-iommufd.io/kernel": "6.12",
        COUNT: "0",
    }
    (plugin.root / "dev/iommu").touch()
    wait_for(path, count_is(8))


def test_legacy_device_mode_offers_no_iommufd(
    start_plugin: Callable[..., Plugin], tmp_path: Path
) -> None:
    path = tmp_path / "kubevirt-iommufd-plugin"
    config = replace(default_config(), device_mode=DeviceMode.LEGACY)
    start_plugin(config=config, labels=LabelPublisher(FeatureFile(path, "plugin")))
    wait_for(path, lambda labels: labels is not None)
    assert read_labels(path) == {
        "kubevirt-iommufd.io/iommufd": "false",
        "kubevirt-iommufd.io/vfio-cdev": "true",
        "kubevirt-iommufd.io/kernel": "6.12",
        COUNT: "0",
    }


def test_an_unwritable_feature_file_leaves_the_plugin_serving(
    start_plugin: Callable[..., Plugin], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    publisher = LabelPublisher(FeatureFile(blocker / "kubevirt-iommufd-plugin", "plugin"))
    plugin = start_plugin(labels=publisher)
    plugin.kubelet.wait_registered(H100)
    assert "cannot write the NFD feature file" in caplog.text
    unbind_driver(plugin.root, GPUS[0])
    deadline = time.monotonic() + EVENT_LATENCY
    while plugin.kubelet.health(H100)[GPUS[0]] != "Unhealthy":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert publisher.labels is not None and publisher.labels[COUNT] == "7"


@pytest.mark.parametrize(
    ("option", "features_dir", "root", "expected"),
    [
        (None, Path("/etc/nfd"), Path("/"), Path("/etc/nfd/kubevirt-iommufd-plugin")),
        (None, None, Path("/"), None),
        (None, Path("/etc/nfd"), Path("/srv/simulated"), None),
        ("/run/f", Path("/etc/nfd"), Path("/srv/simulated"), Path("/run/f")),
        ("none", Path("/etc/nfd"), Path("/"), None),
    ],
    ids=["config-dir", "config-none", "simulated-root", "flag-path", "flag-none"],
)
def test_which_feature_file(
    option: str | None, features_dir: Path | None, root: Path, expected: Path | None
) -> None:
    config = replace(default_config(), node_labels=NodeLabelsConfig(features_dir))
    assert feature_file_path(option, config, root, "plugin") == expected


def test_label_node_follows_the_devices_and_leaves_other_labels(
    start_plugin: Callable[..., Plugin],
) -> None:
    theirs = {"kubernetes.io/hostname": "gpu-1", "kubevirt-iommufd.io/passthrough": "true"}
    with running_apiserver() as api, api.api_client() as client:
        api.put_node("gpu-1", theirs)
        labeler = NodeLabeler(client, "gpu-1", retry_first=0.05)
        labeler.start()
        plugin = start_plugin(labels=LabelPublisher(node=labeler))

        def on_node() -> dict[str, str]:
            node = api.read("Node", "gpu-1")
            assert node is not None
            labels: dict[str, str] = node["metadata"]["labels"]
            return labels

        assert api.wait_until(lambda: on_node().get(COUNT) == "8")
        assert on_node()["kubevirt-iommufd.io/iommufd"] == "true"
        for gpu in GPUS:
            unbind_driver(plugin.root, gpu)
        assert api.wait_until(lambda: on_node().get(COUNT) == "0", EVENT_LATENCY)
        assert on_node()["kubevirt-iommufd.io/iommufd"] == "false"
        plugin.stop()
        # Ours go on a clean stop; the passthrough label is the operator's, not a published one.
        assert on_node() == theirs


def test_label_node_needs_a_node_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    code = main(["plugin", "--root", str(tmp_path), "--label-node"])
    assert code == 2
    assert capsys.readouterr().err == (
        "kubevirt-iommufd plugin: --label-node needs the node's name: pass --node-name or set"
        " NODE_NAME\n"
    )
