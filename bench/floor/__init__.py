"""The floors `bench.lean` measures our daemons against: the least a Python kubelet plugin of
each kind does, as processes of their own (`python -m bench.floor.dra`, `… .plugin`). They are
not benchmarks themselves, so `./dev.sh bench` (which runs bench/*.py) leaves them alone."""
