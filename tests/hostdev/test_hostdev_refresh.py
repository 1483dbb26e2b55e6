"""`refresh_host` of the functions an event names equals a full scan after the same change, on
every simulated host, through a seeded walk of binds, unbinds, removals and vanishing nodes;
and on 4,096 functions it reads only what it was asked to."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from hostdev.bdf import Bdf
from hostdev.model import HostInventory, is_vfio_driver
from hostdev.scan import refresh_host, scan_host
from sim.host import (
    SCENARIOS,
    BuildHost,
    bind_driver,
    remove_function,
    scale,
    unbind_driver,
)

STEPS = 12


def change_something(root: Path, inventory: HostInventory, pick: random.Random) -> set[Bdf]:
    """One change a node sees, made to the tree; the functions its events would name (none
    for a node coming or going: the node listings are read on every refresh)."""
    function = pick.choice(inventory.functions)
    bdf = str(function.bdf)
    kind = pick.choice(["unbind", "bind", "remove", "cdev-node", "group-node"])
    if kind == "unbind" and function.driver is not None:
        unbind_driver(root, bdf)
    elif kind == "bind":
        if function.driver is not None:
            unbind_driver(root, bdf)
        bind_driver(root, bdf, pick.choice(["vfio-pci", "nvidia", "pci-stub"]))
    elif kind == "remove" and not any(function.bdf in f.upstream for f in inventory.functions):
        # Functions only: the simulated tree does not take a bridge's children down with it.
        remove_function(root, bdf)
    elif kind == "cdev-node" and function.vfio_cdev is not None:
        (root / "dev/vfio/devices" / function.vfio_cdev).unlink(missing_ok=True)
        return set()
    elif kind == "group-node" and function.iommu_group is not None:
        (root / "dev/vfio" / str(function.iommu_group)).unlink(missing_ok=True)
        return set()
    return {function.bdf}


@pytest.mark.parametrize("scenario", [n for n in SCENARIOS if n != "scale"])
def test_refresh_of_named_functions_equals_a_full_scan(
    build_host: BuildHost, scenario: str
) -> None:
    root = build_host(SCENARIOS[scenario]())
    pick = random.Random(scenario)  # noqa: S311 - a repeatable walk
    inventory = scan_host(root)
    for _ in range(STEPS):
        if not inventory.functions:
            break
        named = change_something(root, inventory, pick)
        # Refreshed from the last refresh, not from a scan: errors would pile up.
        inventory = refresh_host(root, inventory, named)
        assert inventory == scan_host(root)
        assert [f.bdf for f in inventory.functions] == sorted(f.bdf for f in inventory.functions)
        assert all(inventory.function(f.bdf) is f for f in inventory.functions)
        assert all(inventory.group(g.number) is g for g in inventory.groups)


def test_refresh_on_4096_functions_equals_a_full_scan_and_shares_the_rest(
    build_host: BuildHost,
) -> None:
    root = build_host(scale(4096))
    before = scan_host(root)
    pick = random.Random(4096)  # noqa: S311 - a repeatable walk
    inventory = before
    named: set[Bdf] = set()
    for _ in range(4):
        named |= change_something(root, inventory, pick)
        inventory = refresh_host(root, inventory, named)
    assert inventory == scan_host(root)
    untouched_groups = {f.iommu_group for f in before.functions if f.bdf in named}
    shared = [
        f
        for f in before.functions
        if f.iommu_group not in untouched_groups and inventory.function(f.bdf) is f
    ]
    # Everything outside the changed groups is the previous reading's own objects, except
    # functions whose cdev node went away (a new object with only that flag changed).
    gone_nodes = {
        f.bdf
        for f in before.functions
        if f.vfio_cdev is not None and not (root / "dev/vfio/devices" / f.vfio_cdev).exists()
    }
    assert len(shared) >= len(before.functions) - 8 * len(named) - len(gone_nodes)


def test_refresh_reads_only_the_named_functions(
    build_host: BuildHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host-wide listing of VFIO devices (a readlink each) is a full scan's; a refresh
    reads the named functions' own entries."""
    root = build_host(scale(4096))
    before = scan_host(root)
    target = before.functions[100]
    unbind_driver(root, str(target.bdf))
    readlinks: list[str] = []
    real_readlink = os.readlink

    def readlink(path: str, *, dir_fd: int | None = None) -> str:
        readlinks.append(str(path))
        return real_readlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "readlink", readlink)
    refreshed = refresh_host(root, before, [target.bdf])
    monkeypatch.undo()
    assert refreshed == scan_host(root)
    function = refreshed.function(target.bdf)
    assert function is not None and not is_vfio_driver(function.driver)
    assert len(readlinks) < 20, readlinks
