"""overlap: cached TTFT against the same suffix with its KV already in GPU memory (see ttft)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from tools.bench.ttft import measure


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    yield from measure(args, "overlap")
