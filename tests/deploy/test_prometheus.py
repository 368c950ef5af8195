"""A real Prometheus (Debian's ``prometheus``) scrapes a daemon's /metrics with an admin
tenant's token, and every query of deploy/grafana-dashboard.json returns data against it:
hit rate by tier and tenant, bytes by tier, evictions, lookup latency, load and save
throughput, errors. The traffic is made to produce each (two tenants, loads from every tier,
evictions from the last tier, refused requests)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.config import StoreConfig
from kvstore.server.config import ServerConfig
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
WAIT_S = 120.0  # a hang, not a timing: Prometheus starts and scrapes within seconds


def _prometheus() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing in CI: .ci/run installs it (apt-get install prometheus)")
        pytest.skip("prometheus is not installed: apt-get install prometheus (CI installs it)")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    r = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert r["status"] == "success", r
    return list(r["data"]["result"])


def _scrapes(base: str) -> int:
    """Samples Prometheus holds of the daemon's up metric (one per scrape that succeeded)."""
    try:
        res = _query(base, 'count_over_time(up{job="kvstore"}[10m])')
    except (urllib.error.URLError, ConnectionError):
        return 0
    return int(float(res[0]["value"][1])) if res else 0


def _wait_scrapes(base: str, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while _scrapes(base) < n:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"Prometheus did not scrape the daemon:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


@pytest.fixture
def scraped(tmp_path: Path) -> Iterator[tuple[str, ThreadedDaemon, subprocess.Popen[bytes], Path]]:
    exe = _prometheus()
    store = StoreConfig(root=tmp_path / "store", tiers=small_tiers(dram_blocks=8, nvme_blocks=8, object_blocks=16))
    with ThreadedDaemon(store, ServerConfig(http_port=0, data_port=0, ucx_port=0, tenants=TENANTS)) as d:
        port = _free_port()
        (tmp_path / "token").write_text(TOKEN_OPS)
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: kvstore\n"
            f"    authorization:\n      credentials_file: {tmp_path / 'token'}\n"
            f"    static_configs:\n      - targets: ['{d.url.removeprefix('http://')}']\n")
        log = tmp_path / "prometheus.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [exe, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
        try:
            yield f"http://127.0.0.1:{port}", d, proc, log
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def _traffic(d: ThreadedDaemon) -> None:
    out = np.zeros(16 * BB, np.uint8)
    with connect(d.url, token=TOKEN_A, plane="tcp") as a, connect(d.url, token=TOKEN_B, plane="tcp") as b:
        chains = [chain_for(seed, 4) for seed in range(10)]  # 40 blocks through 32 of room: evictions
        for c in chains:
            a.put(SMALL_NS, c, [payload(h) for h in c])
        theirs = chain_for(99, 2)
        b.put(SMALL_NS, theirs, [payload(h) for h in theirs])
        for c in chains:  # loads from every tier the blocks landed in
            a.lookup(SMALL_NS, c)
            a.get_into(SMALL_NS, c, out[: 4 * BB])
        b.lookup(SMALL_NS, theirs)
        b.get_into(SMALL_NS, theirs, out[: 2 * BB])
    req = urllib.request.Request(f"{d.url}/v1/info", headers={"Authorization": "Bearer not-a-known-token-at-all"})
    with pytest.raises(urllib.error.HTTPError):  # an error the dashboard must show
        urllib.request.urlopen(req, timeout=30)


def test_every_dashboard_query_returns_data(scraped: tuple[str, ThreadedDaemon, subprocess.Popen[bytes], Path]) -> None:
    base, d, proc, log = scraped
    _wait_scrapes(base, 2, proc, log)  # a baseline before the traffic
    _traffic(d)
    before = _scrapes(base)
    _wait_scrapes(base, before + 3, proc, log)
    targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
    assert [t["health"] for t in targets] == ["up"], targets  # scraped with the admin's token
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    empty = []
    for title, expr in exprs:
        result = _query(base, expr.replace("$__rate_interval", "1m"))
        if not result:
            empty.append((title, expr))
    assert empty == [], empty
    tiers = {r["metric"]["tier"] for r in _query(base, "sum by (tier) (kvstore_tier_used_bytes)")}
    assert tiers == {"dram", "nvme", "object"}
    tenants = {r["metric"]["tenant"] for r in _query(
        base, 'sum by (tenant) (kvstore_tenant_hit_tokens_total{op="load"})')}
    assert tenants >= {"a", "b"}
    assert float(_query(base, "sum(kvstore_evictions_total)")[0]["value"][1]) > 0
    refused = _query(base, 'sum(kvstore_requests_total{outcome="401"})')
    assert refused and float(refused[0]["value"][1]) >= 1
