"""What the process benchmarks share: a process's peak RSS, and the node/measure/result table."""

from __future__ import annotations

from pathlib import Path

Row = tuple[str, str, str]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def print_rows(rows: list[Row]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'node':<{widths[0]}}  {'measure':<{widths[1]}}  result")
    for node, measure, result in rows:
        print(f"{node:<{widths[0]}}  {measure:<{widths[1]}}  {result}")
