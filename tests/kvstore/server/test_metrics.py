"""Honest metrics and loud layout conflicts, through a real daemon.

One daemon, known traffic (lookups that hit all, part and none of a prompt; loads the same;
two tenants): ``kvctl stats --json``, ``/metrics`` and kvreport's analysis of the daemon's event
log give the same counts and rates, lookups apart from loads, per tier and per tenant. A registration of another layout
of a registered deployment is named in the reply, logged, counted and shown by ``kvctl stats``.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import connect
from kvstore.config import StoreConfig
from kvstore.ctl.cli import main as kvctl
from kvstore.eventread import read_events
from kvstore.events import EventsConfig
from kvstore.report.analyze import analyze
from kvstore.server.config import ServerConfig
from kvstore.server.daemon import ThreadedDaemon
from kvstore.server.metrics import OTHER, Metrics
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS

BT = SMALL_NS.block_tokens
FP16 = replace(SMALL_NS, layout=replace(SMALL_NS.layout, dtype="float16"))


def _daemon(root: Path) -> ThreadedDaemon:
    store = StoreConfig(root=root, tiers=small_tiers(), events=EventsConfig(enabled=True))
    return ThreadedDaemon(store, ServerConfig(http_port=0, data_port=0, ucx_port=0, tenants=TENANTS))


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN_OPS}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _kvctl_stats(url: str, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert kvctl(["--url", url, "--token", TOKEN_OPS, "--json", "stats"]) == 0
    return json.loads(capsys.readouterr().out)


def test_kvctl_metrics_and_kvreport_agree_on_one_daemons_traffic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = chain_for(1, 4, shared_prefix_blocks=2)
    part = chain_for(2, 4, shared_prefix_blocks=2)  # shares its first 2 blocks with ``full``
    none = chain_for(3, 4)
    theirs = chain_for(4, 2)
    d = _daemon(tmp_path / "store")
    with d:
        with connect(d.url, token=TOKEN_A, plane="tcp") as a, connect(d.url, token=TOKEN_B, plane="tcp") as b:
            a.put(SMALL_NS, full, [payload(h) for h in full])
            b.put(SMALL_NS, theirs, [payload(h) for h in theirs])
            assert [a.lookup(SMALL_NS, c).num_blocks for c in (full, part, none, full)] == [4, 2, 0, 4]
            assert b.lookup(SMALL_NS, theirs).num_blocks == 2
            out = np.zeros(4 * BB, np.uint8)
            assert [a.get_into(SMALL_NS, c, out) for c in (full, part, none)] == [4, 2, 0]
            assert b.get_into(SMALL_NS, theirs, out[: 2 * BB]) == 2
        s = _kvctl_stats(d.url, capsys)
        m = _scrape(d.url)
    # 18 blocks looked up, 12 found; 14 loaded, 8 served: two different rates.
    assert (s["lookup_blocks"], s["lookup_hit_blocks"], s["load_blocks"], s["hit_blocks"]) == (18, 12, 14, 8)
    assert (s["lookup_tokens"], s["lookup_hit_tokens"]) == (18 * BT, 12 * BT)
    assert (s["requested_tokens"], s["hit_tokens"]) == (14 * BT, 8 * BT)
    assert s["lookup_hit_rate"] == pytest.approx(12 / 18) and s["block_hit_rate"] == pytest.approx(8 / 14)
    assert s["token_hit_rate"] == pytest.approx(8 / 14)
    assert sum(s["hit_tokens_by_tier"].values()) == 8 * BT

    def g(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert g("kvstore_lookup_blocks_total") == s["lookup_blocks"]
    assert g("kvstore_lookup_hit_blocks_total") == s["lookup_hit_blocks"]
    assert g("kvstore_load_blocks_total") == s["load_blocks"]
    assert g("kvstore_load_hit_blocks_total") == s["hit_blocks"]
    assert g("kvstore_miss_blocks_total", op="lookup") == 6 and g("kvstore_miss_blocks_total", op="load") == 6
    assert g("kvstore_lookup_tokens_total") == s["lookup_tokens"]
    assert g("kvstore_lookup_hit_tokens_total") == s["lookup_hit_tokens"]
    assert g("kvstore_requested_tokens_total") == s["requested_tokens"]
    assert g("kvstore_hit_tokens_total") == s["hit_tokens"]
    assert {t: g("kvstore_tier_hit_tokens_total", tier=t) for t in s["hit_tokens_by_tier"]} == s["hit_tokens_by_tier"]
    assert {t: g("kvstore_hit_blocks_total", tier=t) for t in s["hits_by_tier"]} == s["hits_by_tier"]
    tenant = {(t, op): (g("kvstore_tenant_requested_tokens_total", tenant=t, op=op),
                        g("kvstore_tenant_hit_tokens_total", tenant=t, op=op))
              for t in ("a", "b") for op in ("lookup", "load")}
    assert tenant == {("a", "lookup"): (16 * BT, 10 * BT), ("a", "load"): (12 * BT, 6 * BT),
                      ("b", "lookup"): (2 * BT, 2 * BT), ("b", "load"): (2 * BT, 2 * BT)}
    ns_hits = {k[1]: v for k, v in m.items() if k[0] == "kvstore_namespace_hit_tokens_total"}
    assert sum(v for labels, v in ns_hits.items() if ("op", "load") in labels) == s["hit_tokens"]
    assert any(k[0] == "process_resident_memory_bytes" for k in m)  # the standard process metrics

    # kvreport reads loads from the event log (written out when the daemon stopped).
    r = analyze(read_events(tmp_path / "store" / "events"))
    assert r["requests"] == s["loads"] == 4
    assert (r["prompt_tokens"], r["hit_tokens"]) == (s["requested_tokens"], s["hit_tokens"])
    assert r["token_hit_rate"] == pytest.approx(s["token_hit_rate"])
    assert r["hit_tokens_by_tier"] == s["hit_tokens_by_tier"]
    assert {t: (v["prompt_tokens"], v["hit_tokens"]) for t, v in r["tenants"].items()} == {
        t: tenant[(t, "load")] for t in ("a", "b")}
    lk = r["lookups"]  # and the lookups apart, the daemon's own probes not among them
    assert lk["requests"] == s["lookups"] == r["log"]["lookups"] == 5
    assert (lk["prompt_tokens"], lk["hit_tokens"]) == (s["lookup_tokens"], s["lookup_hit_tokens"])
    assert lk["token_hit_rate"] == pytest.approx(s["lookup_hit_rate"])
    assert {t: (v["prompt_tokens"], v["hit_tokens"]) for t, v in lk["tenants"].items()} == {
        t: tenant[(t, "lookup")] for t in ("a", "b")}


def test_a_conflicting_registration_is_named_in_the_reply_logged_counted_and_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    with _daemon(tmp_path / "store") as d:
        with connect(d.url, token=TOKEN_A, plane="tcp") as a, connect(d.url, token=TOKEN_B, plane="tcp") as b:
            a.register_namespace(SMALL_NS)
            first = chain_for(4, 1)  # a namespace with blocks: an empty one is no conflict
            assert a.put(SMALL_NS, first, [payload(h) for h in first]) == 1
            b.register_namespace(FP16)  # another tenant: another deployment, no conflict
            assert a.layout_conflicts == [] and b.layout_conflicts == []
            with caplog.at_level(logging.WARNING):
                a.register_namespace(FP16)
            [w] = a.layout_conflicts
            assert w["namespaces"] == [FP16.root.hex(), SMALL_NS.root.hex()]  # the tenant's own ids
            assert [x.split(":")[0] for x in w["differences"]] == ["layout.dtype"]
            assert a.stats()["layout_conflicts"] == [w]
            logged = [r for r in caplog.records if "layout conflict" in r.getMessage()]
            assert {r.name for r in logged} == {"kvstore.client", "kvstore.store"}  # the client's and the daemon's
            for ns in (SMALL_NS, FP16):  # both stay usable
                c = chain_for(5, 2)
                assert a.put(ns, c, [payload(h, ns.block_bytes) for h in c]) == 2
        s = _kvctl_stats(d.url, capsys)
        assert s["layout_conflicts"] == 1 and len(s["layout_conflict_warnings"]) == 1
        assert _scrape(d.url)[("kvstore_layout_conflicts_total", ())] == 1
        assert kvctl(["--url", d.url, "--token", TOKEN_OPS, "stats"]) == 0
        assert "layout conflicts 1" in capsys.readouterr().out


def test_namespace_and_tenant_labels_are_capped_and_overflow_into_other() -> None:
    traffic = [{"ns": f"{i:032x}", "block_tokens": 16, "lookup_blocks": 1, "lookup_hit_blocks": 1,
                "load_blocks": 2, "hit_blocks": 1} for i in range(5)]
    stats = {"lookup_blocks": 5, "lookup_hit_blocks": 5, "load_blocks": 10, "hit_blocks": 5, "hits_by_tier": {},
             "lookup_tokens": 80, "lookup_hit_tokens": 80, "requested_tokens": 160, "hit_tokens": 80,
             "hit_tokens_by_tier": {}, "namespace_traffic": traffic, "evictions": 0, "expirations": 0, "skipped_writes": 0, "skipped_bytes": 0,
             "corrupt_blocks": 0, "tier_errors": 0, "tiers": [], "demotions": 0, "promotions": 0,
             "put_blocks": 0, "layout_conflicts": 0, "blocks": 0}
    owners = {f"{i:032x}": f"t{i}" for i in range(5)}
    m = Metrics(lambda: stats, lambda: owners, max_namespace_labels=2, max_tenant_labels=3)
    for _ in range(2):  # the same labels at every scrape
        fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
        ns = {(s.labels["ns"], s.labels["tenant"]): s.value
              for s in fams["kvstore_namespace_hit_tokens"].samples if s.labels["op"] == "load"}
        assert ns == {(f"{0:032x}", "t0"): 16, (f"{1:032x}", "t1"): 16, (OTHER, OTHER): 48}
        tenants = {s.labels["tenant"]: s.value for s in fams["kvstore_tenant_requested_tokens"].samples
                   if s.labels["op"] == "lookup"}
        assert tenants == {"t0": 16, "t1": 16, "t2": 16, OTHER: 32}
