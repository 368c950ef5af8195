"""Benchmarks: ``python -m tools.bench NAME --json``. Each module exposes ``add_arguments`` and ``run``."""
