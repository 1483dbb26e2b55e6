"""Options more than one subcommand reads: the node configuration and the pci.ids database."""

from __future__ import annotations

from pathlib import Path

from hostdev.config import ConfigError, PluginConfig, default_config, load_config
from hostdev.errors import HostdevError
from hostdev.pciids import PciIds


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
