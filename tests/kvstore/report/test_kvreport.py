"""kvreport: the analysis on a log with known answers, the CLI, and the page in headless Chromium."""

from __future__ import annotations

import html
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.clock import FakeClock
from kvstore.eventread import read_events
from kvstore.events import EventLog
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.report import sample, svg
from kvstore.report.analyze import ReportConfig, analyze
from kvstore.report.cli import main
from kvstore.report.html import REASONS, render
from tests.conftest import SMALL_NS

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
        log.request(ns=ns, hashes=[1, 2, 3, 4], hit_blocks=3, block_tokens=16, hit_tiers={"dram": 3},
                    tenant="x", op="lookup", t=t0 + 9)           # a lookup: 3 of 4 cached
        log.request(ns=ns, hashes=[60, 61], hit_blocks=0, block_tokens=16, tenant="x", op="lookup", t=t0 + 11)
        # Admission counters since the store opened: +2 writes, then a restart (from zero), +3.
        admitted = {"skipped_writes": 5, "skipped_bytes": 5 * 4096, "admission": {"admission": "reuse"}}
        log.usage([{"name": "dram", "used_bytes": 3 * 4096, "capacity_bytes": 4 * 4096, "blocks": 3},
                   {"name": "nvme", "used_bytes": 0, "capacity_bytes": 8 * 4096, "blocks": 0}], t=t0 + 15, store=admitted)
        log.usage([], t=t0 + H, store={**admitted, "skipped_writes": 7, "skipped_bytes": 7 * 4096})
        log.usage([{"name": "dram", "used_bytes": 4096, "capacity_bytes": 4 * 4096, "blocks": 1},
                   {"name": "nvme", "used_bytes": 4096, "capacity_bytes": 8 * 4096, "blocks": 1}], t=t0 + 2 * H,
                  store={**admitted, "skipped_writes": 3, "skipped_bytes": 3 * 4096})
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
    ts = r["timeseries"]
    assert sum(ts["hit_tokens"]) == 96
    # Idle buckets are gaps (None), not 0%: requests came at t0..t0+30 s and at t0+2 h only.
    busy = [i for i, n in enumerate(ts["requests"]) if n]
    assert busy == [0, len(ts["t"]) - 1] and all(v is None for v in ts["token_hit_rate"][1:-1])
    assert ts["token_hit_rate"][0] == pytest.approx(5 / 10)
    # Tier fill from the usage records; blocks leaving the store per hour, by why.
    assert ts["tier_fill"]["dram"][0] == 0.75 and ts["tier_fill"]["dram"][-1] == 0.25
    assert ts["tier_fill"]["nvme"][-1] == 0.125 and ts["tier_fill"]["dram"][1] is None
    per_hour = 3600 / r["span"]["bucket_s"]
    assert ts["leaving_blocks_per_hour"]["evicted"][0] == per_hour and sum(ts["leaving_blocks_per_hour"]["evicted"]) == per_hour
    assert ts["leaving_blocks_per_hour"]["expired"][-1] == per_hour
    # Lookups apart from loads; admission from the usage records' store counters.
    lk = r["lookups"]
    assert (lk["requests"], lk["prompt_tokens"], lk["hit_tokens"]) == (2, 16 * 6, 16 * 3)
    assert lk["token_hit_rate"] == pytest.approx(0.5) and lk["tenants"]["x"]["requests"] == 2
    assert r["admission"] == {"logged": True, "admission": "reuse", "skipped_writes": 5, "skipped_bytes": 5 * 4096,
                              "seconds": 2 * H - 15}


def test_the_page_shows_the_lookup_hit_rate_and_admission(tmp_path: Path) -> None:
    page = render(analyze(read_events(_log(tmp_path / "events"))))
    text = re.sub(r"<[^>]+>", " ", page)
    assert re.search(r"50\.0%\s+lookup token hit rate", text)  # the card
    lookups = text[text.index("Lookups and loads"):text.index("Tier fill and blocks")]
    assert re.search(r"lookups \(asked what is cached\)\s+2\s+96\s+48\s+50\.0%\s+50\.0%", lookups)
    assert re.search(r"loads \(served blocks\)\s+6\s+272\s+96\s+35\.3%", lookups)
    admission = text[text.index("Admission to the last tier"):text.index("Achieved vs ideal")]
    assert re.search(r"reuse\s+5\s+20\.0 KiB\s+2\.5", admission)  # 5 writes in 2 h less 15 s


def test_a_log_without_lookups_or_admission_counters_says_so(tmp_path: Path) -> None:
    with EventLog(tmp_path / "events", clock=FakeClock(1_735_689_600.0), tiers=["dram"]) as log:
        log.namespace(SMALL_NS, tenant="x")
        log.request(ns=SMALL_NS.root, hashes=[1], hit_blocks=0, block_tokens=16, tenant="x")
        log.usage([{"name": "dram", "used_bytes": 0, "capacity_bytes": 4096, "blocks": 0}])  # an older daemon's
    r = analyze(read_events(tmp_path / "events"))
    assert r["admission"]["logged"] is False and r["lookups"]["requests"] == 0
    page = render(r)
    assert "No lookup records in this log" in page and "No admission counters in this log" in page


def test_the_daemons_usage_record_carries_the_admission_counters(tmp_path: Path) -> None:
    from kvstore.config import EventsConfig, StoreConfig, TierSpec
    from kvstore.server.daemon import _log_usage
    from kvstore.store import KVStore

    tiers = (TierSpec("dram", "null", {"capacity_blocks": 2}), TierSpec("object", "null", {"capacity_blocks": 100}))
    cfg = StoreConfig(root=tmp_path / "store", tiers=tiers, admission="reuse", persist_on_close=False,
                      events=EventsConfig(enabled=True))
    with KVStore(cfg, clock=FakeClock(1_000.0)) as store:
        _log_usage(store)
        store.events.flush()
    [rec] = [r for r in read_events(tmp_path / "store" / "events") if r["type"] == "usage"]
    assert rec["store"] == {"skipped_writes": 0, "skipped_bytes": 0, "admission": "reuse"}


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


_LAYOUT_PROBE = """
const plots = [...document.querySelectorAll('svg.plot')].map(svg => {
  const series = [...svg.querySelectorAll('.series')];
  const drawn = series.filter(e => { const b = e.getBBox(); return b.width > 0 || b.height > 0; });
  const legend = {}, swatches = {};
  svg.querySelectorAll('.swatch').forEach(r => {
    const s = getComputedStyle(r);
    legend[r.dataset.name] = r.tagName === 'line' ? s.stroke : s.fill;
    swatches[r.dataset.name] = [r.tagName, legend[r.dataset.name], s.strokeDasharray];
  });
  const sb = svg.getBoundingClientRect();  // a text drawn past its chart is clipped on screen
  const clipped = [...svg.querySelectorAll('text')].filter(t => {
    const b = t.getBoundingClientRect();  // after transforms (the rotated y-axis titles)
    return b.left < sb.left - 0.5 || b.right > sb.right + 0.5 || b.top < sb.top - 0.5 || b.bottom > sb.bottom + 0.5;
  }).map(t => t.textContent);
  return {title: svg.querySelector('title').textContent, series: series.length, drawn: drawn.length,
          dots: svg.querySelectorAll('circle.series').length, legend, swatches, clipped,
          width: svg.getBoundingClientRect().width};
});
const pre = document.createElement('pre');
pre.id = 'layout';
pre.textContent = JSON.stringify(plots);
document.body.appendChild(pre);
"""


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
    # The report has no script; a copy gets one that asks the laid-out page what it drew.
    probe = tmp_path / "probe.html"
    # Plus a bar of every reason a hit can be lost: the longest labels the page can carry.
    every_reason = svg.bar_chart("every reason", [(f"lost: {v}", 1.0, "#dc2626") for v in REASONS.values()], total=7.0)
    probe.write_text(page.read_text().replace("</body>", f"{every_reason}<script>{_LAYOUT_PROBE}</script></body>"))
    dom = subprocess.run([browser, *flags, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    m = re.search(r'<pre id="layout">(.*?)</pre>', dom, flags=re.S)
    assert m, dom[-500:]
    plots = json.loads(html.unescape(m.group(1)))
    assert len(plots) >= 8
    for p in plots:  # every series of every chart is on screen: a line, a dot, an area or a bar
        assert p["series"] and p["drawn"] == p["series"], p
        assert p["width"] > 600, p
        assert p["clipped"] == [], p  # every label, legend and axis text inside its chart
    rates = next(p for p in plots if p["title"].startswith("Hit rate: tokens"))
    # "tokens" and the dashed "ideal (tokens)" share a colour: their swatches are drawn apart.
    assert rates["swatches"]["tokens"] != rates["swatches"]["ideal (tokens)"], rates["swatches"]
    assert any(p["title"] == "every reason" for p in plots)
    tenants = next(p for p in plots if p["title"] == "Token hit rate by tenant")
    assert tenants["dots"] >= 1  # tenant y's one busy bucket, which a path alone would not draw
    fill = next(p for p in plots if p["title"].startswith("Tier fill"))
    by_tier = next(p for p in plots if p["title"].startswith("Hit tokens by the tier"))
    assert set(fill["legend"].items()) >= {("dram", by_tier["legend"]["dram"])}  # one colour per tier
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, "--hide-scrollbars", "--window-size=860,2400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# ---- charts that do not mislead ------------------------------------------------------------------


def test_isolated_points_are_dots_and_gaps_are_gaps() -> None:
    chart = svg.line_chart("t", [0.0, 1.0, 2.0, 3.0, 4.0], [("a", [0.5, None, 0.7, 0.8, None])], time_axis=False)
    paths = re.findall(r'<path d="([^"]*)"[^>]*class="series"', chart)
    assert len(paths) == 1 and paths[0].count("M") == 1 and paths[0].count("L") == 1  # 0.7 -> 0.8 only
    assert chart.count("<circle") == 1  # 0.5 has no neighbour
    assert "<circle" not in svg.line_chart("t", [0.0, 1.0], [("a", [0.2, 0.3])], time_axis=False)


def test_y_range_is_the_band_of_the_data() -> None:
    lo, hi = svg.band([0.91, 0.93, 0.97])
    assert 0.8 <= lo < 0.91 and 0.97 < hi <= 1.0
    lo0, hi0 = svg.band([0.0, 0.3])
    assert lo0 == 0.0 and 0.3 < hi0 <= 0.5
    assert svg.band([]) == (0.0, 1.0)
    chart = svg.line_chart("t", [0.0, 1.0], [("a", [0.91, 0.97])], yrange=(lo, hi), time_axis=False)
    assert ">0%<" not in chart and ">90%<" in chart


def test_one_colour_per_tier_and_tenant_across_charts_with_axis_titles(tmp_path: Path) -> None:
    r = analyze(read_events(_log(tmp_path / "events")))
    page = render(r)
    plots = re.findall(r'<svg class="plot".*?</svg>', page, flags=re.S)
    legend: dict[str, set[str]] = {}
    for p in plots:
        for color, name in re.findall(r'(?:fill|stroke)="([^"]+)"[^>]*class="swatch" data-name="([^"]+)"', p):
            legend.setdefault(name, set()).add(color)
        for name, color in re.findall(r'class="a" text-anchor="end">hit: ([^<]+)</text><rect [^>]*fill="([^"]+)"', p):
            legend.setdefault(name, set()).add(color)
    assert {"dram", "nvme", "x", "y"} <= set(legend)
    assert all(len(c) == 1 for c in legend.values()), legend  # the same colour wherever it appears
    assert len({next(iter(legend[n])) for n in ("dram", "nvme", "x", "y")}) == 4  # and all apart
    time_charts = [p for p in plots if "time (UTC)" in p]
    assert len(time_charts) >= 5  # hit rate, by tier, by tenant, tier fill, leaving
    assert all('transform="rotate(-90' in p for p in time_charts)  # every one has a y-axis title
    assert "Tier fill" in page and "Blocks leaving the store" in page


def test_sample_reports_its_progress(tmp_path: Path) -> None:
    seen: list[tuple[float, int]] = []
    sample.run(tmp_path / "store", days=0.05, seed=2, rate_per_hour=120, progress=lambda f, n: seen.append((f, n)))
    fracs = [f for f, _ in seen]
    assert fracs == sorted(fracs) and fracs[-1] == 1.0 and seen[-1][1] == len(seen) - 1
    out = io.StringIO()
    bar = sample.progress_bar(out, width=10)
    bar(0.5, 7)
    bar(1.0, 9)
    assert "[#####.....]" in out.getvalue() and out.getvalue().endswith("9 requests\n")


def test_gpu_time_money_and_latency_samples_agree(tmp_path: Path) -> None:
    """A small saving is shown in a unit that shows it (never "0.00 GPU-hours" beside "$0.01"),
    the latency table gives each row's sample count, shows no p99 of a few samples and no
    median of one, and has a row for every tier of the log."""
    r = analyze(read_events(_log(tmp_path / "events")), ReportConfig(prefill_tps=25_000.0, gpu_price=3.0))
    page = render(r)
    gpu_s = r["savings"]["gpu_seconds"]
    assert 0 < gpu_s < 60 and f"{gpu_s:,.1f} GPU-s" in page and "0.00</b>" not in page
    table = page[page.index("id='latency'"):]
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td></tr>", table)
    by_name = {name: (n, p50, p99) for name, n, p50, p99 in rows}
    assert by_name["lookup (per request)"][0] == "6" and by_name["lookup (per request)"][2] == "-"
    assert set(by_name) >= {"load per block from dram", "load per block from nvme"}
    for n, p50, p99 in by_name.values():
        assert p99 == "-"  # fewer than 100 samples each
        assert (n == "1") == p50.endswith("(one sample)") and (n == "0") == (p50 == "-")
