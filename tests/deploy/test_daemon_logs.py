"""The daemon writes structured request logs only when asked (--request-log), one JSON object per
request, and says when it has stopped."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.client import connect
from kvstore.client.spawn import start_daemon


def test_request_log_and_shutdown_message(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    d = start_daemon(tmp_path / "store", args=["--request-log", str(log)])
    with connect(d.url) as c:
        assert c.health()["status"] == "ok"
        c.stats()
    assert d.stop() == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    routes = [(r["method"], r["route"], r["status"]) for r in rows]
    assert ("GET", "/healthz", 200) in routes and ("GET", "/v1/stats", 200) in routes
    assert all(r["ms"] >= 0 and r["client"] == "127.0.0.1" and r["ts"] > 0 for r in rows)
    assert "kvstore daemon stopped" in d.log()


def test_request_log_is_off_by_default(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "store")
    with connect(d.url) as c:
        c.health()
    assert d.stop() == 0
    err = d.log()
    assert '"route"' not in err and "kvstore daemon stopped" in err
