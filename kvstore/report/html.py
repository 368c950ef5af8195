"""The report as one self-contained HTML page: inline CSS and SVG, no script, no network."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape
from typing import Any

from kvstore.report import svg

REASONS = {
    "evicted": "evicted by the policy (capacity)",
    "expired": "expired (TTL too short)",
    "deleted": "deleted by an operator",
    "corrupt": "corrupt copy dropped",
    "not_stored": "seen, but never stored",
    "other": "other (tier unreachable, records dropped)",
    "unknown": "lost, reason unknown (no block events)",
}
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:820px;color:#111827}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e5e7eb;padding-bottom:4px}
.sub{color:#6b7280}.cards{display:flex;flex-wrap:wrap;gap:10px;margin:16px 0}
.card{border:1px solid #e5e7eb;border-radius:8px;padding:8px 12px;min-width:150px}
.card b{display:block;font-size:20px}.card span{color:#6b7280;font-size:12px}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #f3f4f6;text-align:right}
td:first-child,th:first-child{text-align:left}th{color:#374151;font-weight:600}
svg.plot{display:block;margin:10px 0;max-width:100%;height:auto}
svg .t{font-size:13px;font-weight:600;fill:#111827}svg .a{font-size:11px;fill:#4b5563}
svg .g{stroke:#f3f4f6}svg .ax{stroke:#9ca3af}svg .m{stroke:#9ca3af;stroke-dasharray:4 3}
.note{color:#6b7280;font-size:12px}
"""


# Tiers and tenants get colours of their own (none is red, which marks lost hits and
# evictions), so that no tenant is mistaken for a tier.
TIER_PALETTE = ("#2563eb", "#16a34a", "#f59e0b", "#0d9488", "#92400e", "#1e3a8a", "#4d7c0f", "#9ca3af")
TENANT_PALETTE = ("#7c3aed", "#0891b2", "#db2777", "#65a30d", "#b45309", "#4338ca", "#0f766e", "#be123c")


def _values(series: list[tuple[str, list[float | None]]]) -> list[float]:
    return [v for _, ys in series for v in ys if v is not None]


def _p(v: float) -> str:
    return f"{100 * v:.1f}%"


def _n(v: float) -> str:
    return f"{v:,.0f}"


def _bytes(v: float) -> str:
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= div:
            return f"{v / div:,.1f} {unit}"
    return f"{v:,.0f} B"


def _money(cur: str, v: float) -> str:
    if 0 < v < 0.01:
        return f"< {cur}0.01"
    return f"{cur}{v:,.2f}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _lookups(lk: dict[str, Any], r: dict[str, Any]) -> str:
    """Lookups (an engine asking what is cached, served nothing) beside loads: two rates that
    differ when engines look up prompts they then do not load, or load without a lookup."""
    out = ["<h2 id='lookups'>Lookups and loads</h2>"]
    if not lk["requests"]:
        return out[0] + ("<p class='note'>No lookup records in this log: the engines loaded without asking first "
                         "(or their lookups went to another daemon). The rest of the report is about loads.</p>")
    rows = [["lookups (asked what is cached)", _n(lk["requests"]), _n(lk["prompt_tokens"]), _n(lk["hit_tokens"]),
             _p(lk["token_hit_rate"]), _p(lk["request_hit_rate"])],
            ["loads (served blocks)", _n(r["requests"]), _n(r["prompt_tokens"]), _n(r["hit_tokens"]),
             _p(r["token_hit_rate"]), _p(r["request_hit_rate"])]]
    rows += [[f"lookups of tenant {name}", _n(t["requests"]), _n(t["prompt_tokens"]), _n(t["hit_tokens"]),
              _p(t["token_hit_rate"]), _p(t["request_hit_rate"])] for name, t in lk["tenants"].items()]
    out.append(_table(["", "requests", "prompt tokens", "hit tokens", "token hit rate", "requests with a hit"], rows))
    out.append("<p class='note'>A lookup counts what was cached when an engine asked; a load what the store then "
               "served. The same figures: <code>kvctl stats</code> (lookup and load hit rates) and <code>/metrics</code> "
               "(<code>kvstore_lookup_*</code>, <code>kvstore_hit_*</code>).</p>")
    return "".join(out)


def _admission(a: dict[str, Any]) -> str:
    """Admission to the last tier: the writes it skipped and the bytes they would have taken."""
    out = ["<h2 id='admission'>Admission to the last tier</h2>"]
    if not a["logged"]:
        return out[0] + ("<p class='note'>No admission counters in this log: its usage records come from a "
                         "daemon that did not log them (they are written once per maintenance pass).</p>")
    rule = a["admission"] or "?"
    per_h = a["skipped_writes"] * 3600 / a["seconds"] if a["seconds"] > 0 else 0.0
    out.append(_table(["admission rule", "writes skipped", "bytes kept out", "skipped per hour"],
                      [[rule, _n(a["skipped_writes"]), _bytes(a["skipped_bytes"]), f"{per_h:,.1f}"]]))
    what = ("every demotion into the last tier is written" if rule == "all" else
            "demotions of blocks unlikely to return are skipped within a hit-loss budget")
    out.append(f"<p class='note'><code>[store] admission = \"{escape(rule)}\"</code>: {what}. Counted between the "
               f"first and last usage record of the log ({a['seconds'] / 3600:,.1f} h); the same counters: "
               "<code>kvstore_skipped_writes_total</code>, <code>kvstore_skipped_bytes_total</code>.</p>")
    return "".join(out)


P99_SAMPLES = 100
"""Fewer samples than this: no p99 is shown (it would be the largest sample, not a tail)."""


def _latency_row(name: str, q: dict[str, Any]) -> list[str]:
    n = int(q.get("n", 0))
    if n == 0:
        return [name, "0", "-", "-"]
    p50 = f"{q['p50'] * 1e3:.3f}" + (" (one sample)" if n == 1 else "")
    return [name, _n(n), p50, f"{q['p99'] * 1e3:.3f}" if n >= P99_SAMPLES else "-"]


def gpu_time(seconds: float) -> str:
    """GPU time in the unit that shows it (0.004 GPU-hours is 14.4 GPU-seconds, not "0.00")."""
    if seconds < 60:
        return f"{seconds:,.1f} GPU-s"
    if seconds < 3600:
        return f"{seconds / 60:,.1f} GPU-min"
    return f"{seconds / 3600:,.2f} GPU-h"


def render(r: dict[str, Any], title: str = "kvstore cache report", sources: list[str] | None = None) -> str:
    span, cfg, ts = r["span"], r["config"], r["timeseries"]
    cur = cfg["currency"]
    start = datetime.fromtimestamp(span["start"], UTC).strftime("%Y-%m-%d %H:%M UTC")
    end = datetime.fromtimestamp(span["end"], UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>{escape(title)}</h1><div class='sub'>{start} to {end} &middot; {r['log']['requests']:,} requests"
           + (f" &middot; from {escape(', '.join(sources))}" if sources else "") + "</div>"]
    lk = r["lookups"]
    cards = [("token hit rate (loads)", _p(r["token_hit_rate"])), ("unlimited cache would hit", _p(r["ideal"]["token_hit_rate"])),
             ("lookup token hit rate", _p(lk["token_hit_rate"]) if lk["requests"] else "no lookups"),
             ("requests with a hit", _p(r["request_hit_rate"])), ("prompt tokens", _n(r["prompt_tokens"])),
             ("GPU time saved", gpu_time(r["savings"]["gpu_seconds"])),
             ("saved", _money(cur, r["savings"]["money"]))]
    out.append("<div class='cards'>" + "".join(f"<div class='card'><b>{v}</b><span>{k}</span></div>" for k, v in cards) + "</div>")

    # One colour per tier and per tenant, the same in every chart.
    tier_color = svg.Colors([*r["log"]["tiers"], *ts["hit_tokens_by_tier"], *r["hit_tokens_by_tier"]], palette=TIER_PALETTE)
    tenant_color = svg.Colors(sorted(r["tenants"]), palette=TENANT_PALETTE)
    bucket = f"per {svg.duration(span['bucket_s'])}"

    out.append("<h2 id='hit-rate'>Hit rate over time</h2>")
    rates = [("tokens", ts["token_hit_rate"]), ("requests", ts["request_hit_rate"]), ("ideal (tokens)", ts["ideal_token_hit_rate"])]
    out.append(svg.line_chart("Hit rate: tokens, requests, and the unlimited-cache ideal", ts["t"], rates,
                              yrange=svg.band(_values(rates)), ylabel=f"hit rate (% {bucket})",
                              colors=["#111827", "#94a3b8", "#111827"], dashed=["ideal (tokens)"]))
    tiers = ts["hit_tokens_by_tier"]
    out.append(svg.stacked_area("Hit tokens by the tier that served them", ts["t"], list(tiers.items()),
                                ylabel=f"hit tokens {bucket}", colors=[tier_color(k) for k in tiers]))
    tenants = list(ts["tenant_token_hit_rate"].items())
    out.append(svg.line_chart("Token hit rate by tenant", ts["t"], tenants, yrange=svg.band(_values(tenants)),
                              ylabel="token hit rate", colors=[tenant_color(k) for k, _ in tenants]))
    out.append(f"<p class='note'>One point {bucket}; a gap is a time without requests (no data, not a 0% hit "
               "rate), a dot a time with requests on both sides idle. Y axes show the band the data lies in.</p>")

    out.append(_lookups(lk, r))

    out.append("<h2 id='tiers'>Tier fill and blocks leaving the store</h2>")
    fill = ts.get("tier_fill") or {}
    if fill:
        out.append(svg.line_chart("Tier fill: bytes used of each tier's capacity", ts["t"], list(fill.items()),
                                  yrange=(0.0, 1.05), ylabel="used / capacity", colors=[tier_color(k) for k in fill]))
    else:
        out.append("<p class='note'>No tier fill: this log has no usage records (the daemon writes one per "
                   "maintenance pass; an in-process store when its owner calls <code>store.events.usage(store."
                   "stats()['tiers'])</code>).</p>")
    leaving = ts.get("leaving_blocks_per_hour") or {}
    if leaving:
        out.append(svg.line_chart("Blocks leaving the store: evicted for capacity, expired", ts["t"],
                                  list(leaving.items()), yfmt=svg.num, ylabel=f"blocks per hour ({bucket})",
                                  colors=["#dc2626", "#f59e0b"]))

    out.append(_admission(r["admission"]))

    out.append("<h2 id='ideal'>Achieved vs ideal: where the prompt tokens went</h2>")
    total = r["prompt_tokens"]
    bars: list[tuple[str, float, str | None]] = [(f"hit: {k}", v, tier_color(k)) for k, v in r["hit_tokens_by_tier"].items()]
    bars += [(f"lost: {REASONS.get(k, k)}", v, "#dc2626") for k, v in r["misses"]["lost"].items()]
    bars += [("miss: namespace mismatch", r["misses"]["namespace_mismatch"], "#f97316"),
             ("miss: never seen before", r["misses"]["never_seen"], "#9ca3af")]
    out.append(svg.bar_chart("Prompt tokens: served, lost (an unlimited cache would have hit), missed", bars, total=total))
    ideal = r["ideal"]
    out.append(f"<p>The store served <b>{_p(r['token_hit_rate'])}</b> of prompt tokens; an unlimited cache that "
               f"never forgets would have served <b>{_p(ideal['token_hit_rate'])}</b> of the same requests. "
               f"Served from a slower tier than {escape(str(r['slow_tier']['fastest_tier']))}: "
               f"{_n(r['slow_tier']['tokens'])} tokens ({_p(r['slow_tier']['share_of_hits'])} of hits).</p>")
    out.append("<p class='note'>Lost hits are attributed to why the first missing block of the request was gone. "
               "Namespace mismatch: misses in a namespace while another namespace of the same model with a different "
               f"layout had traffic. Hits of blocks stored before the log began: {_n(ideal['before_log_tokens'])} tokens.</p>")

    out.append("<h2 id='ages'>What retention buys: the age of hits</h2>")
    ages = r["ages"]
    out.append(svg.bar_chart("Hit tokens by the age of the block that served them", [(k, v, "#64748b") for k, v in ages["tokens"].items()],
                             total=r["hit_tokens"]))
    older = ages["share_older_than"]
    out.append(f"<p>Share of hit tokens served by blocks older than 1 h: <b>{_p(older['1h'])}</b>, "
               f"24 h: <b>{_p(older['24h'])}</b>, 72 h: <b>{_p(older['72h'])}</b>.</p>")
    ret = r["retention"]
    if ret["ttl_hours"]:
        out.append(svg.line_chart("Token hit rate a TTL would reach (capacity aside)", ret["ttl_hours"],
                                  [("token hit rate", ret["token_hit_rate"])], time_axis=False, xlabel="TTL (hours)",
                                  ylabel="token hit rate", yrange=svg.band(ret["token_hit_rate"]), colors=["#111827"],
                                  marks=[(1, "1 h"), (24, "24 h"), (72, "72 h")]))
        at = ret["at"]
        out.append(f"<p>With a TTL of 1 h the store could have served {_p(at['1h'])} of prompt tokens, 24 h {_p(at['24h'])}, "
                   f"72 h {_p(at['72h'])}: a hit refreshes a block's TTL, so what matters is how long a block sat idle "
                   "before its next use (hits, and hits lost to expiry).</p>")

    out.append("<h2 id='savings'>Tokens, GPU time and money saved</h2>")
    rows = [["all", _n(r["savings"]["tokens"]), f"{r['savings']['gpu_seconds']:,.1f}", _money(cur, r["savings"]["money"])]]
    rows += [[name, _n(t["savings"]["tokens"]), f"{t['savings']['gpu_seconds']:,.1f}", _money(cur, t["savings"]["money"])]
             for name, t in r["tenants"].items()]
    out.append(_table(["tenant", "prefill tokens saved", "GPU-seconds", "money"], rows))
    out.append(f"<p class='note'>At {cfg['prefill_tps']:,.0f} prefill tokens/s per GPU and {_money(cur, cfg['gpu_price'])} "
               "per GPU-hour (kvreport --prefill-tps, --gpu-price).</p>")

    out.append("<h2 id='usage'>Usage per tenant (DeepSeek API fields)</h2>")
    out.append(_table(["tenant", "requests", "prompt_cache_hit_tokens", "prompt_cache_miss_tokens", "hit rate", "ideal"],
                      [[name, _n(t["requests"]), _n(t["usage"]["prompt_cache_hit_tokens"]),
                        _n(t["usage"]["prompt_cache_miss_tokens"]), _p(t["token_hit_rate"]), _p(t["ideal_token_hit_rate"])]
                       for name, t in r["tenants"].items()]))

    lat = r["latency"]
    if lat["lookup_s"]:
        by_tier = lat["load_s_per_block_by_tier"]
        tiers = [*r["log"]["tiers"], *(k for k in by_tier if k not in r["log"]["tiers"])]
        rows = [_latency_row("lookup (per request)", lat["lookup_s"])]
        rows += [_latency_row(f"load per block from {k}", by_tier.get(k, {})) for k in tiers]
        out.append("<h2 id='latency'>Lookup and load time</h2>"
                   + _table(["", "samples", "p50 ms", "p99 ms"], rows)
                   + f"<p class='note'>A load is timed per tier only when one tier served all its hits; a p99 "
                   f"needs at least {P99_SAMPLES} samples, a single sample is a value, not a median.</p>")
    out.append(f"<p class='note'>kvreport, from {r['log']['requests']:,} request and {r['log']['block_events']:,} block records; "
               "the same numbers: kvreport --json.</p></body></html>")
    return "\n".join(out)
