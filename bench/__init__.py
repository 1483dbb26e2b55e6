"""Benchmarks; each runs on its own from the repository root: python -m bench.<name>
(`./dev.sh bench` runs them all). Most also run as a script, python bench/<name>.py."""
