"""What the process benchmarks share: a process's RSS and CPU time, and the node/measure/result
table."""

from __future__ import annotations

import os
from pathlib import Path

Row = tuple[str, str, str]


def peak_rss_mb(pid: int) -> float:
    return _status_mb(pid, "VmHWM")


def rss_mb(pid: int) -> float:
    """What the process holds in memory now."""
    return _status_mb(pid, "VmRSS")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used, all its threads together."""
    # The command (field 2) is in parentheses and may hold spaces: count from after it.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc status")


def print_rows(rows: list[Row]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'node':<{widths[0]}}  {'measure':<{widths[1]}}  result")
    for node, measure, result in rows:
        print(f"{node:<{widths[0]}}  {measure:<{widths[1]}}  {result}")
