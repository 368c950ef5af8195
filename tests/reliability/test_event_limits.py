"""The KV event publisher within its byte budgets, and its ports within their connection limits
(issue 33, items 4 and 5), on a ``kvstore serve`` process publishing on real ZeroMQ sockets.

Item 4: with token ids in ``BlockStored`` a count bound was no memory bound (RSS grew 881 MiB
over 300 puts with no subscriber). Every queue of the publisher is now counted in bytes: the
hooks waiting for it, each stream's replay buffer, the replay answers requesters have not read,
and a slow subscriber's ZeroMQ queue (``subscriber_bytes // max_batch_bytes`` batches, no batch
over ``max_batch_bytes``). Item 5: plain connections to the event ports took descriptors outside
the connection gates; now they have their own limits, inside the daemon's descriptor budget.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from kvstore.client import connect
from kvstore.client.spawn import LocalDaemon, start_daemon
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.units import parse_size
from kvstore.wire.kvevents import BlockStored, decoder, msgpack_ints
from tests.reliability.harness import crash_tiers, pick, write_config

EV_NS = Namespace("test/events", KVLayout("bfloat16", 1024, (LayerGroup("full", 1, 1, 1),)))
"""1,024 tokens a block of 4 KiB: a block's token ids (4 KiB, 5 KiB as msgpack) weigh as much
as its payload, as in the review's reproduction."""
BLOCKS_PER_PUT = 64
BUDGETS = {"replay_bytes": "4MiB", "publish_queue_bytes": "4MiB", "max_batch_bytes": "256KiB",
           "subscriber_bytes": "2MiB", "replay_answer_bytes": "4MiB", "mirror_token_bytes": "512KiB"}
"""(The store holds ~320 blocks of ``EV_NS``: their token ids, 4 KiB each, are more than the
mirror may keep.)"""


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _put_with_tokens(c: Any, seed: int) -> None:
    toks = np.random.default_rng(seed).integers(0, 50_000, BLOCKS_PER_PUT * EV_NS.block_tokens)
    hs = hash_blocks(EV_NS, toks)
    assert c.put(EV_NS, hs, np.zeros(BLOCKS_PER_PUT * EV_NS.block_bytes, np.uint8), tokens=toks) == BLOCKS_PER_PUT


def _publisher_stats(d: LocalDaemon) -> dict[str, Any]:
    r = httpx.get(f"{d.url}/v1/events", timeout=30.0)
    r.raise_for_status()
    return r.json()["stats"]


def event_rss(tmp_path: Path, puts: int, *, stalled: bool, options: dict[str, Any] | None = None,
              check: Any = None) -> dict[str, Any]:
    """The daemon's RSS growth over ``puts`` puts of 64 blocks with token ids (after 8 to warm
    up), publishing with no subscriber, or (``stalled``) with one subscriber and one replay
    requester that never read (20 requests for everything). ``check(stats)`` runs on the
    publisher's stats every 8 puts. Runs on any tree whose daemon publishes (``options``: more
    ``[events]`` keys)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = write_config(tmp_path / "kvstore.toml", crash_tiers()[:2],
                       events_options={"publish": "tcp://127.0.0.1:0", **(options or {})})
    ctx = zmq.Context()
    with start_daemon(tmp_path / "store", cfg) as d:
        try:
            c = connect(d.url, plane="tcp")
            c.register_namespace(EV_NS)
            for seed in range(8):
                _put_with_tokens(c, 10_000 + seed)
            ev = d.info["events"]
            if stalled:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, 1)  # (its own queue small: the daemon's fills)
                sub.setsockopt(zmq.RCVBUF, 4096)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(ev["publish"])
                req = ctx.socket(zmq.DEALER)
                req.setsockopt(zmq.RCVHWM, 1)
                req.setsockopt(zmq.RCVBUF, 4096)
                req.connect(ev["replay"])
            rss0 = _rss(d.pid)
            peak = rss0
            for i in range(puts):
                _put_with_tokens(c, i)
                if stalled and i % 16 == 0 and i // 16 < 20:
                    req.send_multipart((b"", (0).to_bytes(8, "big")))
                if i % 8 == 7:
                    peak = max(peak, _rss(d.pid))
                    if check is not None:
                        check(_publisher_stats(d))
            stats = _publisher_stats(d)
            rss1 = _rss(d.pid)
            c.close()
            return {"rss_before_mib": round(rss0 / 2**20, 1), "rss_after_mib": round(rss1 / 2**20, 1),
                    "rss_growth_mib": round((rss1 - rss0) / 2**20, 1), "rss_peak_growth_mib": round((peak - rss0) / 2**20, 1),
                    "puts": puts, "token_bytes_published_mib": round(puts * BLOCKS_PER_PUT * EV_NS.block_tokens * 5 / 2**20, 1),
                    "stats": stats}
        finally:
            ctx.destroy(linger=0)


def test_the_publisher_stays_within_its_byte_budgets_with_no_or_stalled_subscribers(tmp_path: Path, figures) -> None:
    """Puts of 64 blocks with 1,024 token ids each (320 KiB of events a put), first with no
    subscriber, then with a subscriber and a replay requester that never read: at every look
    each queue holds at most its budget (a replay buffer or answer queue may hold one item
    larger than its budget alone), no batch is larger than ``max_batch_bytes``, a slow
    subscriber's queue is ``subscriber_bytes // max_batch_bytes`` batches, and the mirror's
    token ids stay within ``mirror_token_bytes``."""
    puts = pick(48, 300)
    budget = {k: parse_size(v, k) for k, v in BUDGETS.items()}
    looks = [0]

    def check(st: dict[str, Any]) -> None:
        looks[0] += 1
        assert st["queued_bytes"] <= budget["publish_queue_bytes"]
        for name, held in st["replay_buffer_bytes"].items():
            assert held <= budget["replay_bytes"], (name, held)
        assert st["replay_answer_bytes"] <= budget["replay_answer_bytes"]
        assert st["mirror_token_bytes"] <= budget["mirror_token_bytes"]
        assert st["subscriber_hwm"] == budget["subscriber_bytes"] // budget["max_batch_bytes"]

    quiet = event_rss(tmp_path / "none", puts, stalled=False, options=BUDGETS, check=check)
    stalled = event_rss(tmp_path / "stalled", puts, stalled=True, options=BUDGETS, check=check)
    for run in (quiet, stalled):
        st = run["stats"]
        assert st["batches"] > 0 and st["block_events"] >= puts * BLOCKS_PER_PUT
        # a put's BlockStored (~320 KiB) went as two batches: far more batches than puts
        assert st["batches"] > puts
        assert st["tokens_dropped"] > 0  # the mirror let go of the oldest blocks' token ids
    assert stalled["stats"]["replays"] >= 1
    # The batches themselves: a subscriber that reads sees none over max_batch_bytes.
    biggest = _biggest_batch(tmp_path / "reader", budget["max_batch_bytes"])
    figures(looks=looks[0], budgets={k: v for k, v in BUDGETS.items()}, largest_batch_bytes=biggest,
            **{f"no_subscriber_{k}": v for k, v in quiet.items() if k != "stats"},
            **{f"stalled_{k}": v for k, v in stalled.items() if k != "stats"},
            stalled_replays=stalled["stats"]["replays"], stalled_replays_dropped=stalled["stats"]["replays_dropped"],
            mirror_tokens_dropped=quiet["stats"]["tokens_dropped"] + stalled["stats"]["tokens_dropped"],
            batches=quiet["stats"]["batches"] + stalled["stats"]["batches"])


def _biggest_batch(tmp_path: Path, cap: int) -> int:
    """The largest batch a reading subscriber receives over 8 puts of 64 blocks with tokens."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = write_config(tmp_path / "kvstore.toml", crash_tiers()[:2],
                       events_options={"publish": "tcp://127.0.0.1:0", **BUDGETS})
    ctx = zmq.Context()
    try:
        with start_daemon(tmp_path / "store", cfg) as d:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(d.info["events"]["publish"])
            c = connect(d.url, plane="tcp")
            c.register_namespace(EV_NS)
            # the subscription has arrived once a heartbeat or batch reaches us
            assert sub.poll(30_000), "no batch within 30 s"
            biggest = seen = 0
            dec = decoder()
            for seed in range(8):
                _put_with_tokens(c, 20_000 + seed)
            deadline = time.monotonic() + 60
            while seen < 8 * BLOCKS_PER_PUT and time.monotonic() < deadline:
                if not sub.poll(1000):
                    continue
                _, _, payload = sub.recv_multipart()
                assert len(payload) <= cap, len(payload)
                biggest = max(biggest, len(payload))
                batch = dec.decode(payload)
                seen += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
            c.close()
            assert biggest > cap // 2  # the puts' events did fill batches to near the cap
            return biggest
    finally:
        ctx.destroy(linger=0)


# ---- item 5: connections to the event ports -------------------------------------------------------


def _event_port_conns(pid: int, ports: set[int]) -> int:
    """Connections the daemon holds whose local port is one of ``ports`` (its descriptors'
    socket inodes against the kernel's TCP table)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) in ports and f[9] in inodes:
                n += 1
    return n


FLOOD = """
import socket, sys, threading
ports, want = [int(p) for p in sys.argv[1:3]], int(sys.argv[3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
held, opened = [], 0
while not stop.is_set():
    alive = []
    for s in held:  # drop those the daemon ended
        try:
            if s.recv(4096) == b"":
                s.close()
                continue
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            continue
        alive.append(s)
    held = alive
    while len(held) < want:  # (connects in flight count as held: a pause leaves them waiting)
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", ports[opened % 2]))
        held.append(s)
        opened += 1
print(opened, flush=True)
"""
"""The flooder: a process of its own that keeps ``want`` plain TCP connections open to two
ports, reopening each one the other end closes (or refuses), never waiting: its connects are
non-blocking, so a pause leaves up to ``want`` of them in flight at once, and it takes a core
of the box while it runs. It prints how many it opened once its stdin closes."""


def _fds(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return 0


def test_a_flood_of_plain_connections_to_the_event_ports_stays_within_its_limit(tmp_path: Path, figures) -> None:
    """A process of its own keeps 300 plain TCP connections open to the publish and replay
    ports (more than the daemon's 256 descriptors), opening a new one as each is closed, as
    fast as it can (it takes a core, so the gate's thread runs starved beside the engines'
    puts). Before, ZeroMQ accepted them all outside every gate: the daemon ran out of
    descriptors and engines could not connect. Now the daemon holds at most ``[events]
    max_connections`` of them (ended over it, the unproven first), stays under its descriptor
    limit at every look (a thread looks every 10 ms), serves engines that connect during the
    flood, and a subscriber that connects during it receives the engines' events."""
    nofile, cap = 256, 32
    cfg = write_config(tmp_path / "kvstore.toml", crash_tiers()[:2], events_options={
        "publish": "tcp://127.0.0.1:0", "max_connections": cap, "max_connections_per_peer": cap})
    rounds = pick(20, 200)
    ctx = zmq.Context()
    with start_daemon(tmp_path / "store", cfg, nofile=nofile) as d:
        ev = d.info["events"]
        ports = {int(ev["publish"].rsplit(":", 1)[1]), int(ev["replay"].rsplit(":", 1)[1])}
        fds0 = _fds(d.pid)
        stop = threading.Event()
        peak_fds = [fds0]
        looks = [0]

        def watch() -> None:
            while not stop.wait(0.01):
                peak_fds[0] = max(peak_fds[0], _fds(d.pid))
                looks[0] += 1

        flooder = subprocess.Popen([sys.executable, "-c", FLOOD, *map(str, sorted(ports)), "300"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            peak_conns = 0
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            received = 0
            served = 0
            for r in range(rounds):
                if r == rounds // 2:
                    sub.connect(ev["publish"])  # a router arriving in the middle of the flood
                try:
                    c = connect(d.url, plane="tcp")  # a new engine connection each round
                    c.register_namespace(EV_NS)
                    _put_with_tokens(c, 30_000 + r)
                    toks = np.random.default_rng(30_000 + r).integers(0, 50_000, BLOCKS_PER_PUT * EV_NS.block_tokens)
                    assert c.lookup(EV_NS, hash_blocks(EV_NS, toks)).num_blocks >= 1
                    c.close()
                except Exception as e:
                    raise AssertionError(f"round {r} of the flood failed: {e}; the daemon's log ends:\n"
                                         f"{d.log()[-4000:]}") from e
                served += 1
                peak_conns = max(peak_conns, _event_port_conns(d.pid, ports))
                while sub.poll(0):
                    sub.recv_multipart()
                    received += 1
            # The flood goes on: once the daemon has ended what is over the limit, it holds at most cap.
            settled = _eventually_value(lambda: _event_port_conns(d.pid, ports), lambda n: n <= cap, 30.0)
            deadline = time.monotonic() + 30
            while received == 0 and time.monotonic() < deadline:
                c = connect(d.url, plane="tcp")
                c.register_namespace(EV_NS)
                _put_with_tokens(c, 40_000 + received)
                c.close()
                if sub.poll(2000):
                    sub.recv_multipart()
                    received += 1
            st = _publisher_stats(d)
        finally:
            stop.set()
            out, _ = flooder.communicate(timeout=60)
            watcher.join(10)
            ctx.destroy(linger=0)
        opened = int(out.split()[-1]) if out.split() else 0
        assert served == rounds
        assert settled <= cap, settled
        assert peak_fds[0] < nofile, peak_fds[0]
        assert received >= 1, "the subscriber that connected during the flood received nothing"
        assert st["connections_refused"] > 0
        figures(rounds=rounds, flood_connections_opened=opened, event_conns_limit=cap,
                event_conns_held_peak=peak_conns, event_conns_held_settled=settled,
                daemon_fds_start=fds0, daemon_fds_peak=peak_fds[0], fd_looks=looks[0], nofile=nofile,
                closed_over_limit=st["connections_refused"], accept_pauses=st["accept_pauses"],
                subscriber_batches=received)


def _eventually_value(read: Any, ok: Any, timeout: float) -> Any:
    """``read()`` until ``ok`` of it (bounded wait for what the daemon does on its own thread)."""
    deadline = time.monotonic() + timeout
    v = read()
    while not ok(v) and time.monotonic() < deadline:
        time.sleep(0.1)
        v = read()
    return v


def test_the_event_log_queue_stays_within_queue_bytes(tmp_path: Path, figures) -> None:
    """The event log (the store's other sink; request records name every hash a request
    asked for, up to ``max_blocks``) queued 65,536 records whatever their size: a burst of big
    lookups could queue gigabytes. Now its queue is counted in bytes too: a burst of 200
    records of 4,096 hashes (256 KiB each as counted) against a 1 MiB budget never holds more,
    and every record is written or counted as dropped."""
    from kvstore.events import EventLog, EventsConfig

    budget = 1 << 20
    hashes = tuple(bytes([i % 256]) * 16 for i in range(4096))
    peak = 0
    with EventLog(tmp_path / "events", EventsConfig(enabled=True, queue_bytes=budget)) as ev:
        for _ in range(200):
            ev.request(ns=b"\x01" * 16, hashes=hashes, hit_blocks=1, block_tokens=16)
            peak = max(peak, ev.stats()["queued_bytes"])
            assert ev.stats()["queued_bytes"] <= budget
        assert ev.flush(60.0)
        st = ev.stats()
    assert st["queued_bytes"] == 0
    assert st["written"] + st["dropped"] == 200, st
    figures(records=200, written=st["written"], dropped=st["dropped"], peak_queued_bytes=peak, queue_bytes=budget)


def test_a_batch_over_max_batch_bytes_goes_as_parts_that_continue_its_chains() -> None:
    """The publisher's split (``kvevents._batches``): a ``BlockStored`` of 1,000 blocks with
    1,024 token ids each and a ``BlockRemoved`` of 20,000 hashes, at a 256 KiB cap, become
    batches whose msgpack is each within the cap, whose ``BlockStored`` parts chain (each part's
    parent is the block before it) with each block's own token ids, in order."""
    import msgspec

    from kvstore.server import kvevents
    from kvstore.wire.kvevents import BlockRemoved, KVEventBatch

    cap = 256 << 10
    rng = np.random.default_rng(7)
    hashes = [bytes(h) for h in rng.integers(0, 256, (1000, 16), dtype=np.uint8)]
    toks = [rng.integers(0, 50_000, 1024).astype("<i4").tobytes() for _ in hashes]
    gone = [bytes(h) for h in rng.integers(0, 256, (20_000, 16), dtype=np.uint8)]
    parent = b"\x01" * 16
    events = [BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(toks),  # type: ignore[arg-type]
                          block_size=1024, lora_id=None, medium="dram", lora_name=None),
              BlockRemoved(block_hashes=list(gone), medium="nvme")]
    enc = msgspec.msgpack.Encoder()
    stored: list[Any] = []
    removed: list[bytes] = []
    batches = 0
    for part in kvevents._batches(events, cap):
        batches += 1
        for e in part:
            if isinstance(e, BlockStored):
                stored.append(e)
                e.token_ids = msgpack_ints(b"".join(e.token_ids))  # type: ignore[arg-type]  # as _encode does
            else:
                removed.extend(e.block_hashes)
        assert len(enc.encode(KVEventBatch(ts=0.0, events=part))) <= cap
    assert batches > 20
    assert [h for e in stored for h in e.block_hashes] == hashes
    assert removed == gone
    prev = parent
    for e in stored:
        assert e.parent_block_hash == prev
        prev = e.block_hashes[-1]
    got = [bytes(np.asarray(t, "<i4").tobytes()) for e in stored for t in np.array_split(
        np.asarray(msgspec.msgpack.decode(enc.encode(e.token_ids)), dtype=np.int64), len(e.block_hashes))]
    assert got == toks


def test_the_byte_budgets_are_validated(tmp_path: Path) -> None:
    """Sizes positive, a subscriber's budget at least one batch, a batch at least 4 KiB,
    connection limits positive counts: refused with a message naming the key."""
    from kvstore.errors import ConfigError
    from kvstore.events import events_config

    for section, key in (({"subscriber_bytes": "512KiB", "max_batch_bytes": "1MiB"}, "subscriber_bytes"),
                         ({"max_batch_bytes": "1KiB"}, "max_batch_bytes"),
                         ({"replay_answer_bytes": 0}, "replay_answer_bytes"),
                         ({"queue_bytes": -1}, "queue_bytes"),
                         ({"publish_queue_bytes": True}, "publish_queue_bytes"),
                         ({"max_connections": 0}, "max_connections"),
                         ({"max_connections_per_peer": -3}, "max_connections_per_peer"),
                         ({"mirror_token_bytes": 0}, "mirror_token_bytes")):
        with pytest.raises(ConfigError, match=key):
            events_config(section)
    from kvstore.server.config import load_server_config

    for key in ("max_handoff_bytes_per_tenant", "handoff_history_bytes"):  # (the handoffs' budgets, [server])
        (tmp_path / "server.toml").write_text(f'[server]\n{key} = "0B"\n')
        with pytest.raises(ConfigError, match=key):
            load_server_config(tmp_path / "server.toml", env={})
    cfg = events_config({"subscriber_bytes": "8MiB", "max_batch_bytes": "256KiB"})
    assert cfg.subscriber_bytes // cfg.max_batch_bytes == 32
