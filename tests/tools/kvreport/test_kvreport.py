"""kvreport: the analysis on a log with known answers, the CLI, and the page in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.clock import FakeClock
from kvstore.events import EventLog, read_events
from kvstore.keys import KVLayout, LayerGroup, Namespace
from tests.conftest import SMALL_NS
from tools.kvreport import sample
from tools.kvreport.analyze import ReportConfig, analyze
from tools.kvreport.cli import main

OTHER = Namespace(SMALL_NS.model_id, KVLayout("bfloat16", 32, (LayerGroup("full", 1, 1, 64),)))
H = 3600.0


def _log(path: Path) -> Path:
    """A log with one of each outcome (16-token blocks in SMALL_NS, 32 in OTHER)."""
    clock = FakeClock(1_735_689_600.0)
    t0 = clock()
    with EventLog(path, clock=clock, tiers=["dram", "nvme"]) as log:
        log.namespace(SMALL_NS, tenant="x")
        log.namespace(OTHER, tenant="y")
        ns, other = SMALL_NS.root, OTHER.root
        log.request(ns=ns, hashes=[1, 2, 3], hit_blocks=0, block_tokens=16, tenant="x", t=t0)
        for k in (1, 2, 3):
            log.block("stored", k, tier="dram", t=t0)
        log.request(ns=ns, hashes=[1, 2, 3, 4], hit_blocks=3, block_tokens=16, hit_tiers={"dram": 2, "nvme": 1},
                    tenant="x", t=t0 + 10)                       # 3 hits, 1 never seen
        log.block("evicted", 3, tier="nvme", reason="capacity:lru", t=t0 + 20)
        log.request(ns=ns, hashes=[1, 2, 3], hit_blocks=2, block_tokens=16, hit_tiers={"dram": 2},
                    tenant="x", t=t0 + 30)                       # block 3 lost to eviction
        log.block("expired", 2, t=t0 + 2 * H)
        log.request(ns=ns, hashes=[1, 2], hit_blocks=1, block_tokens=16, hit_tiers={"dram": 1},
                    tenant="x", t=t0 + 2 * H)                    # block 2 lost to expiry, idle ~2 h
        log.request(ns=ns, hashes=[50], hit_blocks=0, block_tokens=16, tenant="x", t=t0 + 2 * H + 1)
        log.request(ns=other, hashes=[100, 101], hit_blocks=0, block_tokens=32, tenant="y",
                    t=t0 + 2 * H + 2)                            # a sibling layout had traffic: mismatch
    return path


def test_the_numbers_of_a_known_log(tmp_path: Path) -> None:
    r = analyze(read_events(_log(tmp_path)), ReportConfig(prefill_tps=16.0, gpu_price=3600.0))
    assert r["requests"] == 6 and r["prompt_tokens"] == 16 * 13 + 64
    assert r["hit_tokens"] == 16 * 6 and r["hit_tokens_by_tier"] == {"dram": 80, "nvme": 16}
    assert r["ideal"]["hit_tokens"] == 16 * 8                    # + the evicted and the expired block
    assert r["misses"]["lost"] == {"evicted": 16, "expired": 16}
    assert r["misses"]["namespace_mismatch"] == 64
    assert r["misses"]["never_seen"] == 16 * 5                   # 1,2,3 first; 4; 50
    assert r["request_hit_rate"] == pytest.approx(3 / 6)
    assert r["slow_tier"] == {"fastest_tier": "dram", "tokens": 16, "share_of_hits": pytest.approx(16 / 96)}
    assert r["ages"]["tokens"]["< 1 h"] == 80 and r["ages"]["tokens"]["1-24 h"] == 16
    assert r["ages"]["share_older_than"]["1h"] == pytest.approx(16 / 96)
    # A 1-hour TTL would have kept every hit but the one idle for two hours; 24 h also the expired one.
    assert r["retention"]["at"]["1h"] == pytest.approx(80 / r["prompt_tokens"])
    assert r["retention"]["at"]["24h"] == pytest.approx(112 / r["prompt_tokens"])
    assert r["savings"] == {"tokens": 96, "gpu_seconds": 6.0, "money": 6.0}
    x, y = r["tenants"]["x"], r["tenants"]["y"]
    assert x["usage"] == {"prompt_cache_hit_tokens": 96, "prompt_cache_miss_tokens": 16 * 13 - 96}
    assert y["usage"] == {"prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": 64}
    assert sum(r["timeseries"]["hit_tokens"]) == 96


def test_the_cli_writes_html_and_json_and_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _log(tmp_path / "events")
    out = tmp_path / "r.html"
    assert main([str(log), "-o", str(out)]) == 0
    assert "token hit rate" in capsys.readouterr().out
    page = out.read_text()
    assert page.count('<svg class="plot"') >= 6 and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    assert main([str(log), "--json", "--prefill-tps", "16", "--gpu-price", "3600"]) == 0
    assert json.loads(capsys.readouterr().out)["savings"]["money"] == 6.0
    assert main([str(log), "--json", "--since", "2025-01-01T01:00"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 3
    assert main([str(tmp_path / "nope")]) == 4
    assert main([str(log), "--until", "2024-01-01"]) == 4


def test_a_sample_run_through_a_real_store(tmp_path: Path) -> None:
    out = sample.run(tmp_path / "store", days=0.25, seed=1, rate_per_hour=120)
    r = analyze(read_events(out["events"]))
    # The report's hits are the store's: every hit block is 16 tokens in the sample's namespaces...
    # ...except the misconfigured 32-token ones, which start on day 2 (not in a quarter day).
    assert r["hit_tokens"] == 16 * out["blocks_served"]
    assert r["prompt_tokens"] == 16 * out["blocks_asked"]
    assert r["ideal"]["token_hit_rate"] >= r["token_hit_rate"] > 0
    assert set(r["tenants"]) == {"team-a", "team-b"}


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed: apt-get install chromium (CI installs it)")
    page = tmp_path / "report.html"
    assert main([str(_log(tmp_path / "events")), "-o", str(page)]) == 0
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    plots = re.findall(r'<svg class="plot".*?</svg>', dom, flags=re.S)
    assert len(plots) >= 6
    for svg in plots:  # every plot drew something: a series path or bar
        assert re.search(r'class="series"', svg), svg[:200]
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, "--hide-scrollbars", "--window-size=860,2400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
