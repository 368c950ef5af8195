"""Fixtures of the tools' tests (the replay and its research references in the lab)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.traces import write_requests


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """Four chains under one root, re-requested: hits, misses and evictions at 4 blocks."""
    reqs = [(0, [0, 1, 2]), (10, [0, 3, 4]), (20, [0, 1, 2, 5]), (30, [0, 6]), (40, [0, 3, 4]), (50, [0, 1, 7])]
    return write_requests(tmp_path / "small_trace.jsonl", reqs)
