"""KV events for cache-aware routers: the daemon's block changes in vLLM's wire format over ZeroMQ.

``[events] publish = "tcp://127.0.0.1:5557"`` (off by default) starts a :class:`KVEventPublisher`:
a sink of the store's block hooks (``StoreEvents.sinks``) that turns every block stored,
promoted or demoted (``BlockStored`` with the tier as ``medium``), every copy or block that
leaves (``BlockRemoved``) and its own start (``AllBlocksCleared``: "forget what this node said
before") into :class:`kvstore.route.wire.KVEventBatch` batches on a PUB socket, one
sequence number per batch, with vLLM's replay protocol on a ROUTER socket (``replay``, default
``publish``'s port + 1). Routers that speak vLLM's events (Dynamo, llm-d, SGLang's router, and
:mod:`kvstore.route`) read it as they read an engine's.

Names. The store keys a configured tenant's blocks by ``xxh3_128(tenant key || client hash)``,
which no router can compute, so the publisher keeps a mirror ``stored key -> (client hash,
parent's client hash, namespace, tiers)`` and publishes client hashes. The service tells it the
client names of each put (:meth:`KVEventPublisher.names`, before the put's blocks are placed);
the anonymous tenant's keys are client hashes already. After a restart the anonymous tenant's
blocks are announced at start; a keyed tenant's recovered blocks once a put names them again.

Streams and tenants. With no ``[[tenants]]`` one stream carries everything. With tenants the
``publish`` endpoint carries every tenant (topic = tenant name; ZeroMQ PLAIN authentication
with an admin tenant's name and token), and each tenant has its own stream on free ports of
the same host (PLAIN with its own name and token), so a subscriber sees only the tenants it
may see; ``GET /v1/events`` tells a tenant its endpoints. The topic frame is
``"<tenant>@<epoch>"`` (epoch: this publisher's start, hex): a subscriber that sees it change
knows the daemon restarted and resynchronises. On the stream of every tenant each hash carries
:func:`kvstore.route.wire.tenant_mask` of its tenant XORed into its first 8 bytes (the same
prompt of two tenants is two blocks there, and a replayed batch, which has no topic, still says
whose it is); a tenant's own stream carries its hashes as its clients compute them.

Never in the way of the data path: the hooks only ``put_nowait`` into a bounded queue (full:
dropped and counted; the mirror is then rebuilt from the store and every stream is sent
``AllBlocksCleared`` and a snapshot, so a drop costs a resync, never a wrong route). One thread
encodes, publishes (PUB drops at its high-water mark rather than wait for a slow subscriber),
answers replays and sends an empty batch after a second of quiet, so a subscriber that lost
the last batch notices the gap.

A replay request for a sequence number the buffer no longer holds is answered with a snapshot:
``AllBlocksCleared`` and every block the stream may see, all tagged with the last sequence
number sent, then the end marker.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvstore.events import EventsConfig
from kvstore.keys import Namespace
from kvstore.route.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    masked,
    seq_bytes,
    tenant_mask,
)
from kvstore.store import KVStore

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
POLL_MS = 5
"""The thread's wake-up period: the most an event waits in the queue (a hook never wakes it:
that would cost the data path a system call per block)."""
SNAPSHOT_CHUNK = 4096
"""Blocks per batch of a snapshot (and of the announcement at start)."""
REBUILD_EVERY_S = 5.0
_STOP = ("stop",)


class _Rec:
    """The mirror's entry of one stored block."""

    __slots__ = ("client", "parent", "ns", "mask")

    def __init__(self, client: bytes | None, parent: bytes | None, ns: int, mask: int) -> None:
        self.client = client  # None: a keyed tenant's block recovered at start, not named yet
        self.parent = parent
        self.ns = ns
        self.mask = mask


@dataclass(frozen=True, slots=True)
class _NsInfo:
    tenant: int  # index into the publisher's tenant names
    block_size: int
    lora: str | None


@dataclass(slots=True)
class _Stream:
    """One PUB + ROUTER pair: its own sequence numbers and replay buffer."""

    name: str
    tenant: int | None  # None: every tenant
    pub: zmq.Socket[bytes]
    replay: zmq.Socket[bytes]
    publish_url: str
    replay_url: str
    buffer: deque[tuple[int, bytes]]
    seq: int = -1
    pending: dict[int, list[Any]] = field(default_factory=dict)  # tenant -> events of this cycle


def _endpoint(url: str) -> tuple[str, int]:
    m = re.match(r"^tcp://([^:/]+):(\d+)$", url)
    if m is None:
        raise ValueError(f"not a tcp://HOST:PORT endpoint: {url!r}")
    return m.group(1), int(m.group(2))


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> str:
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{host}")
    else:
        sock.bind(f"tcp://{host}:{port}")
    return f"tcp://{host}:{port}"


class KVEventPublisher:
    """Publishes the store's block events; see the module docstring. Thread-safe hooks."""

    def __init__(
        self,
        store: KVStore,
        config: EventsConfig,
        tenants: Sequence[tuple[str, str, str, bool]] = (),
        *,
        hwm: int = 100_000,
    ) -> None:
        """``tenants``: ``(name, salt, token, admin)`` of each configured tenant (none: the
        anonymous tenant, one stream without authentication)."""
        if config.publish is None:
            raise ValueError("KVEventPublisher needs [events] publish")
        self.store = store
        self.config = config
        self._tiers = [t.name for t in store.tiers]
        self._tier_bit = {n: 1 << k for k, n in enumerate(self._tiers)}
        self._epoch = f"{time.time_ns():x}"
        # A deque, not a queue.Queue: append and popleft are atomic under the GIL and take no
        # lock, which is what a hook called under the store's lock for every block can afford.
        self._q: deque[tuple[Any, ...]] = deque()
        self._cap = config.publish_queue
        self._counts = {"dropped": 0, "batches": 0, "events": 0, "replays": 0, "snapshots": 0,
                        "unnamed": 0, "rebuilds": 0}
        self._lost = threading.Event()
        self._recs: dict[bytes, _Rec] = {}
        self._ns_index: dict[bytes, int] = {}
        self._ns: list[_NsInfo] = []
        self._tenant_names = [t[0] for t in tenants] or [""]
        self._salts = {t[1]: i for i, t in enumerate(tenants)}
        self._keyed = bool(tenants)
        self._masks = [tenant_mask(n) for n in self._tenant_names] if self._keyed else [0]
        self._snapshot_pending = False
        self._drop_lock = threading.Lock()
        self._last_send = self._last_rebuild = 0.0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: Any = None
        self.streams: list[_Stream] = []
        host, port = _endpoint(config.publish)
        rport = _endpoint(config.replay)[1] if config.replay else (port + 1 if port else 0)
        try:
            if self._keyed:
                from zmq.auth.thread import ThreadAuthenticator

                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.allow(host)
                admins = {t[0]: t[2] for t in tenants if t[3]}
                self._auth.configure_plain(domain="kvstore-all", passwords=admins)
                self.streams.append(self._stream("all", None, host, port, rport, hwm, "kvstore-all"))
                for i, (name, _, token, _) in enumerate(tenants):
                    self._auth.configure_plain(domain=f"kvstore-{name}", passwords={name: token})
                    self.streams.append(self._stream(name, i, host, 0, 0, hwm, f"kvstore-{name}"))
            else:
                self.streams.append(self._stream("all", None, host, port, rport, hwm, None))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(
                f"[events] publish: cannot bind {config.publish} (replay port {rport}): {e}; pick free "
                "ports or port 0 for any"
            ) from e
        self._load()
        store.events.sinks.append(self)
        self._thread = threading.Thread(target=self._run, name="kvstore-kvevents", daemon=True)
        self._thread.start()

    def _stream(self, name: str, tenant: int | None, host: str, port: int, rport: int, hwm: int,
                domain: str | None) -> _Stream:
        pub = self._ctx.socket(zmq.PUB)
        rep = self._ctx.socket(zmq.ROUTER)
        for s in (pub, rep):
            s.setsockopt(zmq.LINGER, 0)
            if domain is not None:
                s.setsockopt(zmq.PLAIN_SERVER, 1)
                s.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        pub.set_hwm(hwm)
        purl = _bind(pub, host, port)
        rurl = _bind(rep, host, rport)
        return _Stream(name, tenant, pub, rep, purl, rurl, deque(maxlen=self.config.replay_batches))

    # ---- discovery ----------------------------------------------------------------------------

    def endpoints(self, tenant: str | None = None) -> dict[str, Any]:
        """What a subscriber connects to: the stream of ``tenant``, or every tenant's (None)."""
        for s in self.streams:
            if (tenant is None and s.tenant is None) or (
                s.tenant is not None and self._tenant_names[s.tenant] == tenant
            ):
                return {"publish": s.publish_url, "replay": s.replay_url, "epoch": self._epoch,
                        "tenant": tenant, "auth": "plain" if self._keyed else None,
                        "format": "vllm.KVEventBatch/msgpack"}
        raise KeyError(tenant)

    def stats(self) -> dict[str, Any]:
        return {**self._counts, "queued": len(self._q), "blocks": len(self._recs),
                "streams": {s.name: s.seq for s in self.streams}}

    # ---- hooks (any thread, the store's lock held) ----------------------------------------------

    def _put(self, item: tuple[Any, ...]) -> None:
        if len(self._q) < self._cap:
            self._q.append(item)
        else:
            with self._drop_lock:
                self._counts["dropped"] += 1
            self._lost.set()

    def placed(self, key: bytes, k: int, prior_mask: int, depth: int | None) -> None:
        self._put(("p", key, k))

    def dropped(self, key: bytes, mask: int) -> None:
        self._put(("d", key, mask))

    def copy_dropped(self, key: bytes, k: int) -> None:
        self._put(("c", key, k))

    def names(self, ns: Namespace, hashes: Sequence[bytes], keys: Sequence[bytes], start: int) -> None:
        """The client hashes of a put's chain (``keys``: what the store is given), called before
        the put: its ``placed`` events then publish under these names."""
        if self._keyed or start < len(hashes):
            self._put(("n", ns, tuple(hashes), tuple(keys)))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything hooked before this call is published (tests, shutdown)."""
        done = threading.Event()
        self._q.append(("f", done))  # a marker is never dropped
        return done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.append(_STOP)
            self._thread.join(10.0)
        with contextlib.suppress(ValueError):
            self.store.events.sinks.remove(self)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in self.streams:
            s.pub.close(0)
            s.replay.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ---- the mirror -----------------------------------------------------------------------------

    def _ns_of(self, ns: Namespace) -> int:
        digest = bytes(ns.root)
        i = self._ns_index.get(digest)
        if i is None:
            tenant = self._salts.get(ns.tenant_salt, 0)
            i = self._ns_index[digest] = len(self._ns)
            self._ns.append(_NsInfo(tenant, ns.block_tokens, ns.lora_id or None))
        return i

    def _load(self) -> None:
        """The mirror from the store's index (start, and after dropped events); queues
        ``AllBlocksCleared`` and the announcement of every named block for every stream."""
        by_digest = {bytes(ns.root): ns for ns, _ in self.store.namespaces()}
        old = self._recs
        recs: dict[bytes, _Rec] = {}
        rows = sorted(self.store.iter_blocks(), key=lambda r: r["depth"])
        for row in rows:
            key = bytes.fromhex(row["hash"])
            ns = by_digest.get(bytes.fromhex(row["namespace"]))
            mask = 0
            for t in row["tiers"]:
                mask |= self._tier_bit.get(t, 0)
            if ns is None or not mask:
                continue
            prev = old.get(key)
            if prev is not None:
                client, parent = prev.client, prev.parent
            elif self._keyed:
                client = parent = None
            else:
                client = key
                parent = bytes.fromhex(row["parent"]) if row["parent"] else None
            recs[key] = _Rec(client, parent, self._ns_of(ns), mask)
        self._recs = recs
        self._counts["rebuilds"] += 1
        self._snapshot_pending = True

    def _apply(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        recs = self._recs
        if kind == "p":
            _, key, k = item
            rec = recs.get(key)
            if rec is None:
                self._counts["unnamed"] += 1
                return
            rec.mask |= 1 << k
            if rec.client is not None:
                self._stored(rec, k)
        elif kind == "c":
            _, key, k = item
            rec = recs.get(key)
            if rec is None or not rec.mask & (1 << k):
                return
            rec.mask &= ~(1 << k)
            if rec.client is not None:
                self._removed(rec, k)
            if not rec.mask:
                del recs[key]
        elif kind == "d":
            _, key, mask = item
            rec = recs.pop(key, None)
            if rec is None or rec.client is None:
                return
            mask |= rec.mask
            for k in range(len(self._tiers)):
                if mask & (1 << k):
                    self._removed(rec, k)
        elif kind == "n":
            _, ns, hashes, keys = item
            nsi = self._ns_of(ns)
            parent = None
            for client, key in zip(hashes, keys, strict=True):
                rec = recs.get(key)
                if rec is None:
                    recs[key] = _Rec(client, parent, nsi, 0)
                elif rec.client is None:  # recovered at start: now it has a name to publish
                    rec.client, rec.parent = client, parent
                    for k in range(len(self._tiers)):
                        if rec.mask & (1 << k):
                            self._stored(rec, k)
                parent = client

    # ---- events into the streams' batches ---------------------------------------------------------

    def _targets(self, tenant: int) -> Iterator[tuple[list[Any], int]]:
        """The event lists of this cycle that a block of ``tenant`` goes into, each with the
        mask its hashes carry (a stream of several tenants keeps them apart)."""
        for s in self.streams:
            if s.tenant is None:
                yield s.pending.setdefault(tenant, []), self._masks[tenant]
            elif s.tenant == tenant:
                yield s.pending.setdefault(tenant, []), 0

    def _stored(self, rec: _Rec, k: int) -> None:
        info = self._ns[rec.ns]
        medium = self._tiers[k]
        if not self._keyed:  # one stream, hashes as they are: the common case, kept short
            events = self.streams[0].pending.setdefault(0, [])
            last = events[-1] if events else None
            if (type(last) is BlockStored and last.block_hashes[-1] == rec.parent and last.medium == medium
                    and last.block_size == info.block_size and last.lora_name == info.lora):
                last.block_hashes.append(rec.client)
                return
        for events, m in self._targets(info.tenant):
            h = masked(rec.client, m)  # type: ignore[arg-type]
            parent = masked(rec.parent, m) if rec.parent is not None else None
            last = events[-1] if events else None
            if (type(last) is BlockStored and last.medium == medium and last.block_size == info.block_size
                    and last.lora_name == info.lora and last.block_hashes[-1] == parent):
                last.block_hashes.append(h)
            else:
                events.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=[],
                                          block_size=info.block_size, lora_id=None, medium=medium,
                                          lora_name=info.lora))

    def _removed(self, rec: _Rec, k: int) -> None:
        medium = self._tiers[k]
        for events, m in self._targets(self._ns[rec.ns].tenant):
            h = masked(rec.client, m)  # type: ignore[arg-type]
            last = events[-1] if events else None
            if type(last) is BlockRemoved and last.medium == medium:
                last.block_hashes.append(h)
            else:
                events.append(BlockRemoved(block_hashes=[h], medium=medium))

    def _snapshot(self, stream: _Stream) -> Iterator[tuple[int, list[Any]]]:
        """(tenant, events) chunks: AllBlocksCleared, then every named block the stream may see."""
        tenants = range(len(self._tenant_names)) if stream.tenant is None else [stream.tenant]
        for t in tenants:
            yield t, [AllBlocksCleared()]
        saved = stream.pending
        for t in tenants:
            stream.pending = {}
            n = 0
            for rec in self._recs.values():
                if rec.client is None or self._ns[rec.ns].tenant != t:
                    continue
                for k in range(len(self._tiers)):
                    if rec.mask & (1 << k):
                        self._stored_into(stream, rec, k)
                n += 1
                if n >= SNAPSHOT_CHUNK:
                    yield t, stream.pending.pop(t, [])
                    n = 0
            if stream.pending.get(t):
                yield t, stream.pending.pop(t)
        stream.pending = saved

    def _stored_into(self, stream: _Stream, rec: _Rec, k: int) -> None:
        streams, self.streams = self.streams, [stream]
        try:
            self._stored(rec, k)
        finally:
            self.streams = streams

    # ---- the thread -------------------------------------------------------------------------------

    def _topic(self, tenant: int) -> bytes:
        return f"{self._tenant_names[tenant]}@{self._epoch}".encode()

    def _send(self, stream: _Stream, tenant: int, events: list[Any], enc: msgspec.msgpack.Encoder) -> None:
        stream.seq += 1
        payload = enc.encode(KVEventBatch(ts=time.time(), events=events))
        with contextlib.suppress(zmq.Again):
            stream.pub.send_multipart((self._topic(tenant), seq_bytes(stream.seq), payload), flags=zmq.NOBLOCK)
        stream.buffer.append((stream.seq, payload))
        self._counts["batches"] += 1
        self._counts["events"] += len(events)

    def _publish_snapshots(self, enc: msgspec.msgpack.Encoder) -> None:
        for s in self.streams:
            s.pending = {}
            for t, events in self._snapshot(s):
                self._send(s, t, events, enc)

    def _serve_replay(self, s: _Stream, enc: msgspec.msgpack.Encoder) -> None:
        frames = s.replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: a replay request of %d frames (expected 3) ignored", len(frames))
            return
        client, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        self._counts["replays"] += 1
        if s.buffer and s.buffer[0][0] <= start:
            for seq, payload in s.buffer:
                if seq >= start:
                    s.replay.send_multipart((client, b"", seq_bytes(seq), payload))
        elif start <= s.seq:  # what was asked for is gone: the state instead, as of s.seq
            # One batch, so that a subscriber that applies a seq once (vLLM's example) takes it all.
            self._counts["snapshots"] += 1
            events = [e for _, chunk in self._snapshot(s) for e in chunk]
            payload = enc.encode(KVEventBatch(ts=time.time(), events=events))
            s.replay.send_multipart((client, b"", seq_bytes(s.seq), payload))
        s.replay.send_multipart((client, b"", END_SEQ, b""))

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        for s in self.streams:
            poller.register(s.replay, zmq.POLLIN)
        replays = {s.replay: s for s in self.streams}
        self._last_send = time.monotonic()
        self._last_rebuild = 0.0
        stop = False
        while not stop:
            if self._snapshot_pending:
                self._snapshot_pending = False
                self._publish_snapshots(enc)
                self._last_send = time.monotonic()
            try:
                ready = poller.poll(POLL_MS)  # a replay request wakes the thread at once
                stop = self._drain([], enc)
                # A replay covers every hook that ran before it was asked for: what was queued
                # is published first (the router's refresh() relies on it).
                for sock, _ in ready:
                    self._serve_replay(replays[sock], enc)
            except zmq.ZMQError as e:
                log.warning("kv events: replay failed: %s", e)

    def _drain(self, items: list[tuple[Any, ...]], enc: msgspec.msgpack.Encoder) -> bool:
        """Apply what is queued (after ``items``) and publish it; True on the stop marker."""
        q = self._q
        with contextlib.suppress(IndexError):
            while len(items) < 8192:
                items.append(q.popleft())
        waiters = []
        stop = False
        for item in items:
            if item[0] == "f":
                waiters.append(item[1])
            elif item[0] == "stop":
                stop = True
            else:
                self._apply(item)
        now = time.monotonic()
        if self._lost.is_set() and now - self._last_rebuild >= REBUILD_EVERY_S:
            # Hooks were dropped: the mirror may be wrong. Rebuild it from the store and tell
            # every subscriber the state afresh (what it has may be wrong too).
            self._lost.clear()
            self._last_rebuild = now
            for s in self.streams:
                s.pending = {}
            self._load()
            self._publish_snapshots(enc)
            self._snapshot_pending = False
        sent = False
        for s in self.streams:
            for t, events in s.pending.items():
                if events:
                    self._send(s, t, events, enc)
                    sent = True
            s.pending = {}
        if sent:
            self._last_send = now
        elif now - self._last_send >= HEARTBEAT_S:
            for s in self.streams:  # an empty batch: the sequence moves, a gap shows
                self._send(s, 0 if s.tenant is None else s.tenant, [], enc)
            self._last_send = now
        for w in waiters:
            w.set()
        return stop
