"""Small Mooncake-format traces for the replay's tests (``small``: the fixture in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path


def write_requests(path: Path, reqs: list[tuple[int, list[int]]]) -> Path:
    """A trace file of ``(timestamp, hash_ids)`` requests, 512-token blocks."""
    with path.open("w") as f:
        for t, ids in reqs:
            f.write(json.dumps({"timestamp": t, "input_length": 512 * len(ids) - 100, "output_length": 5, "hash_ids": ids}) + "\n")
    return path
