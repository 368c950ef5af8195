"""Structured request logs: one JSON object per HTTP request on the ``kvstore.requests`` logger.

Off by default (the logger has no handler and does not propagate); ``kvstore serve
--request-log -`` writes them to stderr, ``--request-log FILE`` appends to FILE. A line:
``{"ts": 1764590000.123, "method": "POST", "path": "/v1/lookup", "route": "/v1/lookup",
"status": 200, "ms": 0.41, "client": "127.0.0.1"}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kvstore.requests")
log.propagate = False  # never mixed into the daemon's own log lines
log.setLevel(logging.INFO)


def enabled() -> bool:
    return bool(log.handlers)


def record(scope: dict[str, Any], route: str, status: int, seconds: float) -> None:
    client = scope.get("client")
    log.info(json.dumps({
        "ts": round(time.time(), 3), "method": scope.get("method"), "path": scope.get("path"),
        "route": route, "status": status, "ms": round(seconds * 1e3, 3),
        "client": client[0] if client else None,
    }))


def configure(target: str | None) -> None:
    """``None`` or ``"off"``: no request log; ``"-"``: stderr; anything else: a file to append to."""
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    if target in (None, "off"):
        return
    handler: logging.Handler = (logging.StreamHandler(sys.stderr) if target == "-"
                                else logging.FileHandler(Path(target), encoding="utf-8"))
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
