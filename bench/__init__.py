"""Benchmarks; each module runs on its own: python bench/<name>.py."""
