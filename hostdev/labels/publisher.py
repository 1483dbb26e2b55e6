"""Where a component's node labels go: the NFD feature file (by default) and, with `--label-node`,
the Node itself. The device plugin and the DRA driver both publish through this, with the same
flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hostdev.labels.feature_file import FeatureFile

if TYPE_CHECKING:
    from hostdev.config import PluginConfig
    from hostdev.labels.node_patch import NodeLabeler


class LabelPublisher:
    """Hands every new set of labels to each destination; `close()` (a clean stop) takes them
    back, so a node where the component no longer runs stops advertising what it offered."""

    def __init__(
        self, feature_file: FeatureFile | None = None, node: NodeLabeler | None = None
    ) -> None:
        self.feature_file = feature_file
        self.node = node
        self._labels: dict[str, str] | None = None

    @property
    def labels(self) -> dict[str, str] | None:
        """The labels last published; None before the first."""
        return None if self._labels is None else dict(self._labels)

    def publish(self, labels: Mapping[str, str]) -> None:
        self._labels = dict(labels)
        if self.feature_file is not None:
            self.feature_file.write(labels)
        if self.node is not None:
            self.node.publish(labels)

    def close(self) -> None:
        if self.feature_file is not None:
            self.feature_file.remove()
        if self.node is not None:
            self.node.close()


def add_label_arguments(parser: argparse.ArgumentParser, component: str) -> None:
    """The flags both components take for their node labels."""
    parser.add_argument(
        "--feature-file",
        metavar="FILE|none",
        help="the Node Feature Discovery feature file the node labels are written to, or none"
        f" (default: kubevirt-iommufd-{component} in nodeLabels.featuresDir of the config,"
        " /etc/kubernetes/node-feature-discovery/features.d unless set; none when --root is"
        " not /)",
    )
    parser.add_argument(
        "--label-node",
        action="store_true",
        help="also set the labels on this node's Node object through the API server (needs"
        " RBAC to get and patch nodes); only keys under kubevirt-iommufd.io/ are touched",
    )


def feature_file_path(
    option: str | None, config: PluginConfig, root: Path, component: str
) -> Path | None:
    """The feature file to write, from `--feature-file` or the configuration. A simulated node
    (`--root` other than /) gets one only when asked by name: its labels are not this host's."""
    if option is not None:
        return None if option == "none" else Path(option)
    directory = config.node_labels.features_dir
    if directory is None or root != Path("/"):
        return None
    return directory / f"kubevirt-iommufd-{component}"


def build_label_publisher(
    path: Path | None, component: str, node: NodeLabeler | None = None
) -> LabelPublisher:
    return LabelPublisher(FeatureFile(path, component) if path is not None else None, node)
