"""route: KV events, the routing helper and the prefill -> decode handoff.

Figures, each with a same-run baseline:

* ``publish_block_events``: block events per second the publisher turns into ``KVEventBatch``
  batches on a PUB socket with a subscriber reading (one hook call per chain of 32 with its
  chain, as the store makes one per put); baseline: the event log (``EventLog.block``) writing the same events, the
  other sink of the same hooks.
* ``datapath_with_publish``: put + get rounds per second through a daemon (TCP, 8 new blocks of
  1 MiB a round as in the other daemon benchmarks, DRAM small enough to evict: each block is
  stored and later removed) with ``[events] publish`` on; baseline: the same rounds on an
  identical daemon with it off, interleaved round by round (the order rotates), in 10 trials:
  value and baseline are those of the trial of median ratio (``wall_ratios``: every trial's),
  the CPU ratios medians of the trials'. Goal: ratio >= 0.99.
  ``events_per_s``: block events it published meanwhile. Wall time on a shared box moves by
  more than 1% between two daemons, so a third one, also off, gives the noise floor
  (``noise_ratio``: off2 / off, which a perfect publisher would match), and the row also
  carries ``cpu_ratio``, the daemon's CPU time per round (every thread,
  ``/proc/PID/task/*/schedstat``) with publishing over without (``cpu_noise_ratio``: the same
  for off2), and ``publisher_cpu_share``, publishing's own CPU time (the pumps', the
  publisher thread's and ZeroMQ's I/O thread's, ``zmq_cpu_share`` alone) over the data
  path's wall time (the daemon is Python: what that thread runs, the data path waits for, at
  most), and ``publisher_cpu_of_daemon``, the same CPU over the publishing daemon's CPU time
  for its rounds (CPU over CPU: what the load of the box inflates on both sides). ``datapath_with_publish_16k``: the same with 32 blocks of 16 KiB, the most events per
  byte.
* ``publisher_mirror_bytes_per_block``: what the daemon's publisher keeps a block (its mirror
  of client names, parents and tiers, the hashes included), traced by ``tracemalloc``;
  baseline: the 16 KiB block itself.
* ``router_lookup_128k``: ``Router.route_hashes`` for a 128K-token prompt (8,192 blocks of 16
  tokens) against an index of 1M blocks on 3 nodes, median; baseline: ``hash_blocks`` of the same
  prompt (what the engine pays to hash it anyway). ``with_hashing_ms``: ``Router.route`` from
  tokens.
* ``router_bytes_per_block``: the index's bytes per block at 1M blocks; baseline: a Python
  ``dict`` of the same 8-byte keys (as ints) to a small int (the obvious router), keys included.
* ``handoff_32k_tcp``: ``kvstore.route.receive`` of a 32K-token request (128 MiB of KV: 128
  blocks of 256 tokens x 1 MiB) from the prefill node's daemon over TCP on loopback, status +
  load + confirm, median; baseline: a raw socket ``sendall`` -> ``recv_into`` of the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvstore.client import connect
from kvstore.client.spawn import LocalDaemon, start_daemon
from kvstore.config import StoreConfig, TierSpec
from kvstore.events import EventLog, EventsConfig, PutChain
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.route import Router, control, offer, receive
from kvstore.server.kvevents import KVEventPublisher
from kvstore.store import KVStore
from kvstore.wire.kvevents import BlockStored
from tools.bench._common import median_trial, result
from tools.bench._daemon import BENCH_NS
from tools.bench.tcp import raw_round, raw_sender

SMALL = Namespace("bench/route-16k", KVLayout("bfloat16", 32, (LayerGroup("full", 2, 2, 32),)))
"""16 KiB a block: many blocks per byte, so the per-block cost of publishing shows."""
TOKENS = Namespace("bench/route-tokens", KVLayout("bfloat16", 256, (LayerGroup("full", 1, 1, 16),)))
"""16 KiB a block of 256 tokens: each ``BlockStored`` carries 1 KiB of token ids a block (5 KiB
as msgpack), the most token bytes per payload byte of the benchmark's namespaces."""
HANDOFF = Namespace("bench/handoff", KVLayout("bfloat16", 256, (LayerGroup("full", 8, 2, 64),)))
"""256 tokens x 4 KiB a token = 1 MiB a block; 32K tokens = 128 MiB."""

_TOML = """
{events}
[[tiers]]
name = "dram"
kind = "dram"
capacity_bytes = "{dram}"
slab_bytes = "4MiB"
"""


@contextlib.contextmanager
def _daemon(publish: bool, dram: str) -> Iterator[LocalDaemon]:
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-route-"))
    try:
        cfg = tmp / "kvstore.toml"
        events = '[events]\npublish = "tcp://127.0.0.1:0"\n' if publish else ""
        cfg.write_text(_TOML.format(events=events, dram=dram))
        with start_daemon(tmp / "store", cfg) as d:
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drain(url: str, stop: threading.Event, count: list[int]) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(url)
    while not stop.is_set():
        if sub.poll(50):
            sub.recv_multipart()
            count[0] += 1
    sub.close(0)
    ctx.term()


def publish_capacity(n: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-route-"))
    try:
        cfg = StoreConfig(root=tmp / "s", tiers=(TierSpec("dram", "dram", {"capacity_bytes": "16MiB", "slab_bytes": "1MiB"}),))
        rng = np.random.default_rng(0)
        keys = [bytes(k) for k in rng.integers(0, 256, (n, 16), dtype=np.uint8)]
        with KVStore(cfg) as store:
            store.register_namespace(SMALL)
            pub = KVEventPublisher(store, EventsConfig(publish="tcp://127.0.0.1:0", publish_queue=4 * n))
            stop, got = threading.Event(), [0]
            reader = threading.Thread(target=_drain, args=(pub.endpoints()["publish"], stop, got))
            reader.start()
            time.sleep(0.2)  # the subscription reaches the PUB socket (slow joiner)
            t0 = time.perf_counter()
            for i in range(0, n, 32):
                chain = keys[i:i + 32]
                pub.blocks([("p", 0, chain)], None, PutChain(SMALL, tuple(chain)))  # as a put hands them
            hooks_s = time.perf_counter() - t0
            pub.flush(60.0)
            ours = time.perf_counter() - t0
            stop.set()
            reader.join()
            stats = pub.stats()
            pub.close()
        log_dir = tmp / "log"
        t0 = time.perf_counter()
        with EventLog(log_dir, EventsConfig(enabled=True, queue=4 * n)) as elog:
            for k in keys:
                elog.block("stored", k, tier="dram", size=SMALL.block_bytes)
            elog.flush(60.0)
        base = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"ours": n / ours, "base": n / base, "hook_us": hooks_s / n * 1e6,
            "batches": stats["batches"], "dropped": stats["dropped"], "received": got[0]}


def mirror_bytes(n: int) -> float:
    """Bytes a block the publisher's mirror holds in the daemon (traced allocations of ``n``
    blocks named and placed, their hashes included: the mirror keeps them alive), without
    token ids; ``4 * block_tokens`` more a block when puts carry them."""
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-route-"))
    try:
        cfg = StoreConfig(root=tmp / "s", tiers=(TierSpec("dram", "dram", {"capacity_bytes": "16MiB", "slab_bytes": "1MiB"}),))
        with KVStore(cfg) as store:
            store.register_namespace(SMALL)
            pub = KVEventPublisher(store, EventsConfig(publish="tcp://127.0.0.1:0", publish_queue=4 * n))
            pub.flush(60.0)
            rng = np.random.default_rng(7)
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            for i in range(0, n, 32):
                chain = [bytes(k) for k in rng.integers(0, 256, (min(32, n - i), 16), dtype=np.uint8)]
                pub.blocks([("p", 0, chain)], None, PutChain(SMALL, tuple(chain)))  # as a put hands them
                del chain
            pub.flush(60.0)
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            assert pub.stats()["mirrored"] == n
            pub.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return held / n


def _cpu_s(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far (nanosecond schedstat, not 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def _zmq_cpu_s(pid: int) -> float:
    """CPU time of ``pid``'s ZeroMQ threads (``ZMQbg/...``: the I/O thread that sends what
    the publisher queued, and the reaper), which publishing's own figure counts too."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().startswith("ZMQbg"):
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def datapath(rounds: int, ns: Namespace, per: int, dram: str, trials: int, *, tokens: bool = False) -> dict[str, Any]:
    """Rounds on three identical daemons, interleaved (the order rotates every round): ``on``
    publishes, ``off`` and ``off2`` do not; ``off2`` / ``off`` is the noise floor of every
    ratio. The rounds are cut into ``trials`` trials, each with its own ratios (wall time
    and the daemons' CPU time per round), so that a neighbour's burst moves a trial, not
    the median. ``tokens``: every put carries its blocks' token ids (``put(tokens=)``)."""
    rng = np.random.default_rng(1)
    with _daemon(True, dram) as on, _daemon(False, dram) as off, _daemon(False, dram) as off2, \
            connect(on.url, plane="tcp") as c_on, connect(off.url, plane="tcp") as c_off, \
            connect(off2.url, plane="tcp") as c_off2:
        clients = {"on": c_on, "off": c_off, "off2": c_off2}
        pids = {"on": on.pid, "off": off.pid, "off2": off2.pid}
        for c in clients.values():
            c.register_namespace(ns)
        dst = np.empty(per * ns.block_bytes, np.uint8)
        names = list(clients)
        # A subscriber reads the stream, as a router would (the daemon's ZeroMQ I/O thread
        # then sends each batch: its CPU is in the daemon's figure).
        stop, got = threading.Event(), [0]
        reader = threading.Thread(target=_drain, args=(on.info["events"]["publish"], stop, got), daemon=True)
        reader.start()

        def one_round(r: int, times: dict[str, float], cpu: dict[str, float]) -> None:
            hashes = [bytes(h) for h in rng.integers(0, 256, (per, 16), dtype=np.uint8)]
            blocks = rng.integers(0, 256, per * ns.block_bytes, dtype=np.uint8)
            toks = rng.integers(0, 50_000, per * ns.block_tokens) if tokens else None
            for name in names[r % 3:] + names[:r % 3]:
                c = clients[name]
                c0 = _cpu_s(pids[name])
                t0 = time.perf_counter()
                c.put(ns, hashes, blocks, tokens=toks)
                c.get_into(ns, hashes, dst)
                t1 = time.perf_counter()
                times[name] += t1 - t0
                cpu[name] += _cpu_s(pids[name]) - c0

        for r in range(5):  # warm-up rounds
            one_round(r, dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0))
        per_trial = max(1, rounds // trials)
        out: list[dict[str, Any]] = []
        for t in range(trials):
            times, cpu = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
            before = control(on.url, "GET", "/v1/events")["stats"]
            z0 = _zmq_cpu_s(on.pid)
            for r in range(per_trial):
                one_round(t * per_trial + r, times, cpu)
            zmq_s = _zmq_cpu_s(on.pid) - z0
            after = control(on.url, "GET", "/v1/events")["stats"]
            out.append({"times": times, "cpu": cpu, "pub_cpu": after["cpu_s"] - before["cpu_s"] + zmq_s, "zmq_cpu": zmq_s,
                        "thread_cpu": after["thread_cpu_s"] - before["thread_cpu_s"],
                        "events": after["block_events"] - before["block_events"],
                        "wakeups": after["wakeups"] - before["wakeups"],
                        "batches": after["batches"] - before["batches"], "rounds": per_trial})
        stats = control(on.url, "GET", "/v1/events")["stats"]
        stop.set()
        reader.join()

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    def total(key: str, name: str | None = None) -> float:
        return sum(tr[key][name] if name else tr[key] for tr in out)

    value, baseline, wall_ratios = median_trial([(tr["rounds"] / tr["times"]["on"], tr["rounds"] / tr["times"]["off"])
                                                 for tr in out])
    return {"on": value, "off": baseline, "wall_ratios": wall_ratios,
            "noise_ratio": med([tr["times"]["off"] / tr["times"]["off2"] for tr in out]),
            "cpu_ratio": med([tr["cpu"]["on"] / tr["cpu"]["off"] for tr in out]),
            "cpu_noise": med([tr["cpu"]["off2"] / tr["cpu"]["off"] for tr in out]),
            "cpu_ratios": [round(tr["cpu"]["on"] / tr["cpu"]["off"], 4) for tr in out],
            "publisher_cpu_share": total("pub_cpu") / total("times", "on"),
            "publisher_cpu_share_max": max(tr["pub_cpu"] / tr["times"]["on"] for tr in out),
            "publisher_cpu_of_daemon": total("pub_cpu") / total("cpu", "on"),
            "zmq_cpu_share": total("zmq_cpu") / total("times", "on"),
            "thread_cpu_share": total("thread_cpu") / total("times", "on"),
            "events": total("events"), "dropped": stats["dropped"], "wakeups": total("wakeups"),
            "seconds": total("times", "on"), "received": got[0], "batches": total("batches"), "trials": len(out)}


def router_lookup(total_blocks: int, repeat: int) -> dict[str, Any]:
    ns = Namespace("bench/router", KVLayout("bfloat16", 16, (LayerGroup("full", 1, 1, 64),)))
    tokens = np.random.default_rng(2).integers(0, 32_000, 128 * 1024).astype(np.int32)
    prompt = hash_blocks(ns, tokens)
    router = Router(down_after_s=float("inf"))  # its nodes are fed here, not by streams
    rng = np.random.default_rng(3)
    # Feed the index as three nodes' streams would: the prompt's chain on node 1, random chains.
    nodes = [router.add_events_node(f"n{i}") for i in range(3)]
    nodes[1]([BlockStored(block_hashes=prompt, parent_block_hash=None, token_ids=[], block_size=16,
                          lora_id=None, medium="dram", lora_name=None)])
    left = total_blocks - len(prompt)
    while left > 0:
        k = min(left, 8192)
        hs = [bytes(h) for h in rng.integers(0, 256, (k, 16), dtype=np.uint8)]
        nodes[int(rng.integers(0, 3))]([BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[],
                                                    block_size=16, lora_id=None, medium="nvme", lora_name=None)])
        left -= k
    r = router.route_hashes(prompt)
    assert (r.node, r.blocks) == ("n1", len(prompt)), r
    lookups, hashing, full = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        router.route_hashes(prompt)
        t1 = time.perf_counter()
        hash_blocks(ns, tokens)
        t2 = time.perf_counter()
        router.route(ns, tokens)
        t3 = time.perf_counter()
        lookups.append(t1 - t0)
        hashing.append(t2 - t1)
        full.append(t3 - t2)
    stats = router.stats()
    keys = np.random.default_rng(4).integers(1, 2**63, stats["blocks"], dtype=np.uint64)
    tracemalloc.start()
    naive = dict.fromkeys((int(k) for k in keys), 1)  # int keys and the table
    dict_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del naive
    router.close()
    return {"lookup_ms": statistics.median(lookups) * 1e3, "hash_ms": statistics.median(hashing) * 1e3,
            "full_ms": statistics.median(full) * 1e3, "blocks": stats["blocks"],
            "bytes_per_block": stats["index_bytes"] / stats["blocks"], "dict_bytes_per_block": dict_bytes / stats["blocks"]}


def handoff(rounds: int) -> dict[str, Any]:
    tokens = np.random.default_rng(5).integers(0, 32_000, 32 * 1024).astype(np.int32)
    hashes = hash_blocks(HANDOFF, tokens)
    kv = np.random.default_rng(6).integers(0, 256, len(hashes) * HANDOFF.block_bytes, dtype=np.uint8)
    nbytes = kv.nbytes
    with raw_sender(nbytes) as raw, _daemon(False, "512MiB") as d, connect(d.url, plane="tcp") as prefill:
        prefill.register_namespace(HANDOFF)
        dst = np.zeros_like(kv)
        view = memoryview(np.zeros_like(kv))  # the raw transfer's own buffer
        ours, base, offers = [], [], []
        for r in range(rounds):
            t0 = time.perf_counter()
            offer(prefill, HANDOFF, hashes, kv, f"bench-{r}", ttl_s=60)
            t1 = time.perf_counter()
            got = receive(d.url, HANDOFF, hashes, dst, f"bench-{r}")
            t2 = time.perf_counter()
            assert got.state == "released" and got.blocks == len(hashes), got
            raw_round(raw, view)
            t3 = time.perf_counter()
            offers.append(t1 - t0)
            ours.append(t2 - t1)
            base.append(t3 - t2)
        receive_kv = dst
    assert np.array_equal(receive_kv, kv)
    return {"ours_ms": statistics.median(ours) * 1e3, "raw_ms": statistics.median(base) * 1e3,
            "offer_ms": statistics.median(offers) * 1e3, "bytes": nbytes}


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    quick = args.quick
    p = publish_capacity(20_000 if quick else 200_000)
    yield result("route", "publish_block_events", p["ours"], "events/s", p["base"],
                 baseline_is="the event log writing the same events", hook_us=round(p["hook_us"], 3),
                 batches=p["batches"], dropped=p["dropped"])
    for metric, rounds, ns, per, dram, what in (
        ("datapath_with_publish", 10 if quick else 300, BENCH_NS, 8, "128MiB",
         "put + get of 8 new 1 MiB blocks over TCP (the daemon benchmarks' block)"),
        ("datapath_with_publish_16k", 20 if quick else 600, SMALL, 32, "32MiB",
         "put + get of 32 new 16 KiB blocks over TCP (the worst case: events per byte)"),
        ("datapath_with_publish_tokens", 20 if quick else 600, TOKENS, 32, "32MiB",
         "put with token ids + get of 32 new 16 KiB blocks of 256 tokens over TCP (token bytes in every BlockStored)"),
    ):
        dp = datapath(rounds, ns, per, dram, 2 if quick else 10, tokens=ns is TOKENS)
        yield result("route", metric, dp["on"], "rounds/s", dp["off"],
                     baseline_is="the same rounds on an identical daemon with publishing off, interleaved; "
                                 "value and baseline: the trial of median ratio",
                     goal_ratio=0.99, wall_ratios=dp["wall_ratios"], noise_ratio=round(dp["noise_ratio"], 4),
                     cpu_ratio=round(dp["cpu_ratio"], 4), cpu_noise_ratio=round(dp["cpu_noise"], 4),
                     cpu_ratios=dp["cpu_ratios"], publisher_cpu_share=round(dp["publisher_cpu_share"], 5),
                     publisher_cpu_share_max=round(dp["publisher_cpu_share_max"], 5),
                     publisher_cpu_of_daemon=round(dp["publisher_cpu_of_daemon"], 5),
                     zmq_cpu_share=round(dp["zmq_cpu_share"], 5), thread_cpu_share=round(dp["thread_cpu_share"], 5),
                     events_per_s=round(dp["events"] / dp["seconds"]), wakeups=dp["wakeups"],
                     dropped=dp["dropped"], batches=dp["batches"], received=dp["received"], trials=dp["trials"],
                     round=what)
    yield result("route", "publisher_mirror_bytes_per_block", mirror_bytes(20_000 if quick else 200_000), "B",
                 SMALL.block_bytes, baseline_is="the block's own payload (16 KiB, the smallest bench block)")
    lk = router_lookup(100_000 if quick else 1_000_000, 20 if quick else 200)
    yield result("route", "router_lookup_128k", lk["lookup_ms"], "ms", lk["hash_ms"],
                 baseline_is="hash_blocks of the same 128K tokens", with_hashing_ms=round(lk["full_ms"], 4),
                 index_blocks=lk["blocks"])
    yield result("route", "router_bytes_per_block", lk["bytes_per_block"], "B", lk["dict_bytes_per_block"],
                 baseline_is="a Python dict of the same keys", index_blocks=lk["blocks"])
    h = handoff(2 if quick else 5)
    yield result("route", "handoff_32k_tcp", h["ours_ms"], "ms", h["raw_ms"],
                 baseline_is="raw socket sendall -> recv_into of the same bytes", bytes=h["bytes"],
                 offer_ms=round(h["offer_ms"], 2))
