"""Discovery benchmark: time to scan 64, 512 and 4,096 PCI functions, and peak memory.

Each size runs in its own process, so its peak RSS is its own: the process builds a simulated
node (sim.host.scale) in a temporary directory, scans it once to warm the page cache, then
times five scans and reports the median. Target: 4,096 functions in under 150 ms, growing
linearly. Run: `python bench/inventory.py` (or `./dev.sh bench`).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (64, 512, 4096)
RUNS = 5
TARGET_MS = 150.0


def measure(count: int) -> dict[str, float]:
    from hostdev.scan import scan_host
    from sim.host import build_tree, scale

    with tempfile.TemporaryDirectory(prefix="bench-inventory-") as tree:
        root = build_tree(scale(count), Path(tree))
        scan_host(root)
        timings = []
        for _ in range(RUNS):
            start = time.perf_counter()
            inventory = scan_host(root)
            timings.append(time.perf_counter() - start)
        assert len(inventory.functions) == count
    return {
        "median_ms": statistics.median(timings) * 1000,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(int(sys.argv[2]))))
        return 0
    print(f"{'functions':>9}  {'median ms':>9}  {'µs/function':>11}  {'peak RSS MB':>11}")
    results = {}
    for count in SIZES:
        child = subprocess.run(
            [sys.executable, __file__, "--child", str(count)],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(child.stdout)
        results[count] = result
        per_function = result["median_ms"] * 1000 / count
        print(
            f"{count:>9}  {result['median_ms']:>9.1f}  {per_function:>11.1f}"
            f"  {result['peak_rss_mb']:>11.1f}"
        )
    largest = results[SIZES[-1]]["median_ms"]
    verdict = "meets" if largest < TARGET_MS else "MISSES"
    print(f"4,096 functions: {largest:.1f} ms, {verdict} the {TARGET_MS:.0f} ms target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
