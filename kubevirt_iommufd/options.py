"""Options more than one subcommand reads: the node configuration, the pci.ids database and the
node to scan (a host root, or a built-in simulated one)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hostdev.config import ConfigError, PluginConfig, default_config, load_config
from hostdev.errors import HostdevError
from hostdev.model import HostInventory
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from sim.host import SCENARIOS, build_tree


def read_config_option(option: str | None) -> PluginConfig:
    """The configuration `--config` names, or the built-in one."""
    if option is None:
        return default_config()
    try:
        return load_config(Path(option))
    except ConfigError as error:
        raise HostdevError(str(error)) from None


def read_pci_ids_option(option: str | None) -> PciIds:
    """The pci.ids `--pci-ids` names: the system's copy without one, ids only with 'none'."""
    if option is None:
        return PciIds.find()
    if option == "none":
        return PciIds(None)
    path = Path(option)
    if not path.is_file():
        raise HostdevError(f"pci.ids file {option!r} not found; pass an existing file or 'none'")
    return PciIds(path)


def scan_node_option(
    root: str, example: str | None, *, reset_methods: bool = False
) -> HostInventory:
    """The host under `root`, or with `--example` the built-in simulated node of that name."""
    if example is None:
        return scan_host(root, reset_methods=reset_methods)
    with tempfile.TemporaryDirectory(prefix="kubevirt-iommufd-example-") as tree:
        return scan_host(build_tree(SCENARIOS[example](), Path(tree)), reset_methods=reset_methods)
