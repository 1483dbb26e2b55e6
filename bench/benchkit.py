"""What the process benchmarks share: the device plugin started as on a node, a process's peak
RSS, percentiles, and the node/measure/result table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

Row = tuple[str, str, str]


def spawn_plugin(work: Path, root: Path, kubelet_dir: Path) -> subprocess.Popen[bytes]:
    """`kubevirt-iommufd plugin` on the simulated `root`, in iommufd device mode, logging errors
    only; with no pci.ids, so each GPU resource is named by its device id (nvidia.com/2330)."""
    config = work / "config.yaml"
    config.write_text(
        f"deviceMode: iommufd\npciIds: {work / 'none'}\n"
        f"iommufd: {{socketDir: {work / 'fds'}, socketOwner: {{uid: 0, gid: 0}}}}\n"
    )
    return subprocess.Popen(
        [
            sys.executable, "-m", "kubevirt_iommufd", "plugin", "--root", str(root),
            "--kubelet-dir", str(kubelet_dir), "--config", str(config), "--log-level", "error",
        ],
    )  # fmt: skip


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def print_rows(rows: list[Row], first: str = "node") -> None:
    """The rows as a table under `first` (what the first column names), measure, result."""
    widths = [max(len(r[i]) for r in [(first, "measure", ""), *rows]) for i in range(3)]
    print(f"{first:<{widths[0]}}  {'measure':<{widths[1]}}  result")
    for node, measure, result in rows:
        print(f"{node:<{widths[0]}}  {measure:<{widths[1]}}  {result}")


def percentile(values: list[float], fraction: float) -> float:
    """The value `fraction` of the way up the sorted values (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def p50_p99(seconds: list[float]) -> str:
    """p50 / p99 in milliseconds, or "-" when nothing was measured."""
    if not seconds:
        return "-"
    return f"{percentile(seconds, 0.5) * 1000:.1f} / {percentile(seconds, 0.99) * 1000:.1f} ms"
