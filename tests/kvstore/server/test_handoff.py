"""Prefill -> decode handoff through the store: offer, load by hash over TCP, confirm, deadlines,
and the failure paths (unreachable prefill node, a prefill daemon killed mid-handoff)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.client.control import control
from kvstore.client.spawn import start_daemon
from kvstore.clock import FakeClock
from kvstore.errors import BlockNotFound, MissingPrefixError, QuotaExceededError, UsageError
from kvstore.keys import hash_blocks
from kvstore.route import offer, receive
from kvstore.server.config import Limits
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import SMALL_NS
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS
from tests.kvstore.route.tap import daemons, fake_kv

BT = SMALL_NS.block_tokens
BB = SMALL_NS.block_bytes


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., ThreadedDaemon]]:
    with daemons(tmp_path) as s:
        yield s


def prefill(prompt: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """What a prefill engine computes for ``prompt``: its block hashes and KV."""
    hashes = hash_blocks(SMALL_NS, prompt)
    return hashes, np.concatenate([fake_kv(SMALL_NS, prompt, b) for b in range(len(hashes))])


def decode(url: str, prompt: np.ndarray, rid: str, **how: Any) -> tuple[np.ndarray, object]:
    """A decode engine: load the handoff, recompute whatever did not come."""
    hashes = hash_blocks(SMALL_NS, prompt)
    kv = np.zeros(len(hashes) * BB, dtype=np.uint8)
    got = receive(url, SMALL_NS, hashes, kv, rid, timeout=60.0, **how)  # (a loaded CI box is slow, not down)
    for b in range(got.blocks, len(hashes)):
        kv[b * BB:(b + 1) * BB] = fake_kv(SMALL_NS, prompt, b)
    return kv, got


def pins(url: str) -> list[dict]:
    return control(url, "GET", "/v1/pins")["pins"]


def test_a_handoff_works_both_ways_and_confirm_releases_it(start: Callable[..., ThreadedDaemon]) -> None:
    nodes = [start("p"), start("q")]
    for k, (pre, dec) in enumerate([(nodes[0], nodes[1]), (nodes[1], nodes[0])]):
        prompt = np.arange(6 * BT + 5, dtype=np.int32) + 1000 * k
        hashes, kv = prefill(prompt)
        with connect(pre.url) as c:
            c.register_namespace(SMALL_NS)
            held = offer(c, SMALL_NS, hashes, kv, f"req-{k}", ttl_s=30)
        assert (held["state"], held["blocks"], held["durable"]) == ("ready", 6, False)
        assert [p["blocks"] for p in pins(pre.url)] == [6]
        # The decode node's own daemon has none of it: the KV comes from the prefill node.
        with connect(dec.url) as local:
            local.register_namespace(SMALL_NS)
            assert local.lookup(SMALL_NS, hashes).num_blocks == 0
        got_kv, got = decode(pre.url, prompt, f"req-{k}")
        assert (got.blocks, got.recompute, got.state) == (6, False, "released")
        assert np.array_equal(got_kv, kv)
        assert pins(pre.url) == []  # the hold is gone
        assert control(pre.url, "GET", f"/v1/handoffs/req-{k}")["state"] == "released"
        # A second confirm (a retry after a lost answer) changes nothing.
        assert control(pre.url, "POST", f"/v1/handoffs/req-{k}/confirm")["state"] == "released"


def test_an_unconfirmed_handoff_ends_at_its_deadline(start: Callable[..., ThreadedDaemon]) -> None:
    clock = FakeClock()
    d = start("p", clock=clock)
    volatile = np.arange(3 * BT, dtype=np.int32)
    durable = volatile + 7
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        for rid, prompt, dur in (("v", volatile, False), ("d", durable, True)):
            hashes, kv = prefill(prompt)
            offer(c, SMALL_NS, hashes, kv, rid, ttl_s=10, durable=dur)
    assert sorted(p["until"] is None for p in pins(d.url)) == [False, True]
    clock.advance(11)
    for rid in ("v", "d"):
        st = control(d.url, "GET", f"/v1/handoffs/{rid}")
        assert (st["state"], st["reason"]) == ("expired", "nobody confirmed it before the deadline")
    assert [p for p in pins(d.url) if p["active"]] == []  # the volatile pin taken back, the guarantee over
    _, got = decode(d.url, volatile, "v")
    assert (got.blocks, got.recompute, got.state) == (0, True, "expired")


def test_a_decode_node_that_cannot_reach_the_prefill_node_recomputes(start: Callable[..., ThreadedDaemon]) -> None:
    d = start("p")
    url = d.url
    prompt = np.arange(4 * BT, dtype=np.int32)
    hashes, kv = prefill(prompt)
    with connect(url) as c:
        c.register_namespace(SMALL_NS)
        offer(c, SMALL_NS, hashes, kv, "r1", ttl_s=30)
    d.stop()
    got_kv, got = decode(url, prompt, "r1")
    assert (got.blocks, got.recompute, got.state) == (0, True, "unreachable")
    assert np.array_equal(got_kv, kv)  # recomputed: the same KV


def test_offers_are_checked(start: Callable[..., ThreadedDaemon]) -> None:
    d = start("p")
    hashes, kv = prefill(np.arange(4 * BT, dtype=np.int32))
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hashes[:2], kv[: 2 * BB])
        body = {"ns": SMALL_NS.root.hex(), "hashes": [h.hex() for h in hashes], "request_id": "r", "ttl_s": 5}
        with pytest.raises(MissingPrefixError, match="put the request's KV first"):
            control(d.url, "POST", "/v1/handoffs", body)
        with pytest.raises(UsageError):
            control(d.url, "POST", "/v1/handoffs", {**body, "ttl_s": 7200})
        with pytest.raises(BlockNotFound):
            control(d.url, "GET", "/v1/handoffs/never-offered")
        first = offer(c, SMALL_NS, hashes, kv[2 * BB:], "r", ttl_s=5, start=2)
        assert offer(c, SMALL_NS, hashes, kv[2 * BB:], "r", ttl_s=5, start=2) == first  # a retry
    assert [p["blocks"] for p in pins(d.url)] == [4]  # pinned once


def test_a_killed_prefill_daemon_keeps_durable_handoffs_and_reports_volatile_ones_lost(tmp_path: Path) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(
        '[[tiers]]\nname = "dram"\nkind = "dram"\ncapacity_bytes = "4MiB"\nslab_bytes = "64KiB"\n'
        '[[tiers]]\nname = "nvme"\nkind = "nvme"\ncapacity_bytes = "8MiB"\nslab_bytes = "64KiB"\n'
    )
    root = tmp_path / "store"
    volatile = np.arange(3 * BT, dtype=np.int32)
    durable = volatile + 11
    d = start_daemon(root, cfg)
    try:
        with connect(d.url, plane="tcp") as c:
            c.register_namespace(SMALL_NS)
            for rid, prompt, dur in (("vol", volatile, False), ("dur", durable, True)):
                hashes, kv = prefill(prompt)
                offer(c, SMALL_NS, hashes, kv, rid, ttl_s=600, durable=dur)
    finally:
        d.kill()  # mid-handoff: nobody confirmed; DRAM is gone
    d2 = start_daemon(root, cfg)
    try:
        lost = control(d2.url, "GET", "/v1/handoffs/vol")
        assert lost["state"] == "lost" and "0 of 3 blocks survived" in lost["reason"]
        _, got = decode(d2.url, volatile, "vol")
        assert (got.recompute, got.state) == (True, "lost")
        kept_kv, kept = decode(d2.url, durable, "dur")
        assert (kept.blocks, kept.recompute, kept.state) == (3, False, "released")
        assert np.array_equal(kept_kv, prefill(durable)[1])
        assert "1 handoffs lost in the restart: vol" in d2.log()
    finally:
        d2.stop()


def ucx_bytes_out(url: str) -> float:
    """What the daemon at ``url`` sent over its UCX plane (Prometheus ``/metrics``)."""
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN_OPS}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvstore_bytes_total{") and 'plane="ucx"' in line and 'direction="out"' in line)


def test_a_handoff_over_ucx_works_both_ways(start: Callable[..., ThreadedDaemon]) -> None:
    """The decode side loads over UCX (ucxx's TCP transport on loopback here); the bytes it
    gets are the prefill side's, and the prefill daemon's UCX plane is what sent them."""
    pytest.importorskip("ucxx", reason="ucxx not installed (pip install 'kvstore-llm[ucx]')")
    nodes = [start("p", tenants=TENANTS, ucx=True), start("q", tenants=TENANTS, ucx=True)]
    for k, (pre, dec) in enumerate([(nodes[0], nodes[1]), (nodes[1], nodes[0])]):
        token = (TOKEN_A, TOKEN_B)[k]
        prompt = np.arange(6 * BT + 5, dtype=np.int32) + 1000 * k
        hashes, kv = prefill(prompt)
        with connect(pre.url, token=token) as c:
            c.register_namespace(SMALL_NS)
            offer(c, SMALL_NS, hashes, kv, f"ucx-{k}", ttl_s=30, token=token)
        before = ucx_bytes_out(pre.url)
        got_kv, got = decode(pre.url, prompt, f"ucx-{k}", plane="ucx", token=token)
        assert got.state == "released" and not got.recompute and got.blocks == len(hashes)  # type: ignore[attr-defined]
        assert np.array_equal(got_kv, kv)
        assert ucx_bytes_out(pre.url) - before == len(hashes) * BB
        assert not [p for p in control(pre.url, "GET", "/v1/pins", token=token)["pins"]]
        # The decode node's own daemon never saw the KV: it came from the prefill node.
        assert dec.url != pre.url
    # Unreachable over UCX too: the prefill node is gone, the decode side recomputes.
    url = nodes[0].url
    nodes[0].stop()
    _, got = decode(url, np.arange(2 * BT, dtype=np.int32), "ucx-gone", plane="ucx", token=TOKEN_A)
    assert got.state == "unreachable" and got.recompute and got.blocks == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("durable", [True, False])
@pytest.mark.parametrize("own", ["guarantee", "untimed"])
def test_confirming_a_handoff_removes_its_own_pin_not_the_tenants(
    start: Callable[..., ThreadedDaemon], durable: bool, own: str
) -> None:
    """Issue 33, item 6: the tenant's own pin of the chain (a 1-hour guarantee, or an untimed
    pin) outlives the confirm of a handoff of the same chain; the handoff's pin goes."""
    d = start("p")
    prompt = np.arange(4 * BT, dtype=np.int32) + 77
    hashes, kv = prefill(prompt)
    with connect(d.url) as c:
        c.put(SMALL_NS, hashes, kv)
        c.pin(SMALL_NS, hashes, until=None if own == "untimed" else time.time() + 3600)
        offer(c, SMALL_NS, hashes, kv, "h", ttl_s=30, durable=durable)
        assert len(pins(d.url)) == 2
        control(d.url, "POST", "/v1/handoffs/h/confirm")
        left = pins(d.url)
    assert len(left) == 1, left
    if own == "untimed":
        assert left[0]["until"] is None
    else:
        assert left[0]["until"] > time.time() + 3000  # the hour, not the handoff's 30 s



def _metric(url: str, name: str) -> float:
    """One sample of the daemon's ``/metrics`` (``name`` with its labels, as printed)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_handoff_records_stay_within_their_byte_budgets(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """Issue 33, memory: handoff records were bounded in count only (open ones by the pins'
    limit, finished ones by 10,000), each naming up to ``max_blocks`` keys. Now a tenant's open
    ones stay within ``max_handoff_bytes_per_tenant`` (an offer past it is refused, holding
    nothing) and finished ones within ``handoff_history_bytes`` (the oldest forgotten), both
    counted in ``/metrics``."""
    lim = Limits(max_body_bytes=64 * 1024, max_blocks=256, max_payload_bytes=64 * 4096,
                 max_handoff_bytes_per_tenant=4096, handoff_history_bytes=8192)
    d = start_daemon(limits=lim)
    hashes, kv = prefill(np.arange(20 * BT, dtype=np.int32) + 5)
    ns = SMALL_NS.root.hex()

    def offer_of(rid: str, n: int) -> dict[str, Any]:
        body = {"ns": ns, "hashes": [h.hex() for h in hashes[:n]], "request_id": rid, "ttl_s": 60}
        return control(d.url, "POST", "/v1/handoffs", body)

    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hashes, kv)
    assert offer_of("a", 20)["state"] == "ready"  # ~2,400 bytes: 20 keys
    with pytest.raises(QuotaExceededError, match="max_handoff_bytes_per_tenant"):
        offer_of("b", 20)
    assert len(pins(d.url)) == 1  # the refused offer holds nothing
    assert offer_of("c", 5)["state"] == "ready"
    assert _metric(d.url, "kvstore_handoffs_refused_total") == 1
    assert 0 < _metric(d.url, 'kvstore_handoffs_held_bytes{state="open"}') <= 4096
    for rid in ("a", "c"):
        control(d.url, "POST", f"/v1/handoffs/{rid}/confirm")
    assert offer_of("b", 20)["state"] == "ready"  # room again
    control(d.url, "POST", "/v1/handoffs/b/confirm")
    for i in range(30):  # finished records: ~650 bytes each, their keys let go
        offer_of(f"h{i}", 1)
        control(d.url, "POST", f"/v1/handoffs/h{i}/confirm")
        assert _metric(d.url, 'kvstore_handoffs_held_bytes{state="finished"}') <= 8192
    assert _metric(d.url, 'kvstore_handoffs_held_bytes{state="open"}') == 0
    kept = [rid for rid in ("a", "c", "b", *(f"h{i}" for i in range(30)))
            if _status(d.url, rid) is not None]
    assert kept == [f"h{i}" for i in range(30 - len(kept), 30)]  # the newest, in order
    assert _metric(d.url, "kvstore_handoffs_forgotten_total") == 33 - len(kept)
    assert control(d.url, "GET", "/v1/handoffs/h29")["blocks"] == 1  # a finished record's count stays


def _status(url: str, rid: str) -> dict[str, Any] | None:
    try:
        return control(url, "GET", f"/v1/handoffs/{rid}")
    except BlockNotFound:
        return None
