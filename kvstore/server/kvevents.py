"""KV events for cache-aware routers: the daemon's block changes in vLLM's wire format over ZeroMQ.

``[events] publish = "tcp://127.0.0.1:5557"`` (off by default) starts a :class:`KVEventPublisher`:
a sink of the store's block hooks (``StoreEvents.sinks``) that turns every block stored,
promoted or demoted (``BlockStored`` with the tier as ``medium``), every copy or block that
leaves (``BlockRemoved``) and its own start (``AllBlocksCleared``: "forget what this node said
before") into :class:`kvstore.wire.kvevents.KVEventBatch` batches on a PUB socket, one
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
:func:`kvstore.wire.kvevents.tenant_mask` of its tenant XORed into its first 8 bytes (the same
prompt of two tenants is two blocks there, and a replayed batch, which has no topic, still says
whose it is); a tenant's own stream carries its hashes as its clients compute them.

Never in the way of the data path: the store calls the sink once per locked part of an
operation (a load, a maintenance pass; a put has two, room then copies:
:meth:`kvstore.events.StoreEvents.batch`), never once per block, with the operation's
changes as runs of one kind and tier (:data:`kvstore.events.BlockRun`: a hook appends a key,
no tuple a block) and a put's copies with the chain it stored (:class:`kvstore.events.PutChain`,
which names every new block's parent, so the anonymous tenant needs no :meth:`names`), and
that call only appends them to a bounded queue (full: dropped and counted; the mirror is then
rebuilt from the store and every stream is sent ``AllBlocksCleared`` and a snapshot, so a
drop costs a resync, never a wrong route). A put's run and an eviction's go into the mirror in
bulk (:meth:`KVEventPublisher._apply_put`, :meth:`KVEventPublisher._apply_gone`).
Publishing is batched across operations: a pump (:meth:`KVEventPublisher.pump`, which the
service calls after each put and load outside the store's lock) publishes on the request's
own thread once the oldest change is ``[events] publish_period`` (0.25 s) old or
:data:`PUMP_BATCH` changes wait, and the thread publishes what no pump took two periods after
it (the first change after a lull at once: the pump wakes it). The thread also serves replay
requests, the heartbeat (an empty batch after a second of quiet, so a subscriber that lost
the last batch notices the gap), flushes and rebuilds.
PUB drops at its high-water mark rather than wait for a slow subscriber.

Bounds, all in bytes (``docs/reliability.md``, "Every queue of the daemon and its bound"): the
hooks waiting (``publish_queue_bytes``), each stream's replay buffer (``replay_bytes``), the replay
answers no requester has read yet (``replay_answer_bytes``, all of them together: zero-copy frames
tracked until ZeroMQ lets go), a slow subscriber's queue (``subscriber_bytes // max_batch_bytes``
batches, no batch over ``max_batch_bytes``: :func:`_batches` splits the rest), the mirror's token
ids (``mirror_token_bytes``, :meth:`KVEventPublisher._trim_tokens`). Connections to the
event ports, which ZeroMQ accepts by itself, are under ``max_connections`` and
``max_connections_per_peer`` (:class:`kvstore.server.limits.ZmqPortGate`: each socket's monitor
names the connections, one over a limit is ended, and a flood that outruns it pauses the ports'
accepts). What is dropped is counted
(:meth:`KVEventPublisher.collector`) and logged once per burst.

Token ids. A put that carries the token ids of its blocks (``KVStore.put(tokens=)``, the
client's ``put(tokens=)``; 4 bytes a token on the wire) gets them in its ``BlockStored``, as
vLLM's engines send them (Dynamo's router hashes tokens itself); the mirror keeps them
(``4 * block_tokens`` bytes a block, up to ``[events] mirror_token_bytes`` in all, the newest
kept) so promotions, demotions, snapshots and replays carry them too. A block put without
tokens, recovered at a restart, or whose token ids the mirror let go of, has
``token_ids == []`` in those; a ``BlockStored`` never mixes the two.

A replay request for a sequence number the buffer no longer holds is answered with a snapshot:
``AllBlocksCleared`` and every block the stream may see, all tagged with the last sequence
number sent, then the end marker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, countOf, itemgetter
from typing import Any, cast

import msgspec
import zmq

from kvstore.events import BlockRun, EventsConfig, PutChain, PutTokens, block_changes
from kvstore.keys import Namespace
from kvstore.server.limits import ZmqPortGate
from kvstore.store import KVStore
from kvstore.wire.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    masked,
    msgpack_ints,
    seq_bytes,
    tenant_mask,
)

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
PUMP_BATCH = 512
"""Block changes waiting from which a :meth:`KVEventPublisher.pump` publishes them (else once
the oldest is ``[events] publish_period`` old, 0.25 s). What publishing costs is mostly fixed
per publication (the first touch of the publisher's code and data, the encode and send: a few
hundred us of CPU on the loaded 2-core box after the data path ran, more on the publisher's
thread, which wakes cold): publishing after every put of 32 blocks of 16 KiB cost ~5 us a block
event, ~500 changes at a time ~2 us."""
_FAST_MIN = 4
"""Changes in an operation from which :meth:`KVEventPublisher._apply_uniform` is tried."""
_keys = itemgetter(2)
_client, _parent, _ns, _mask, _tokens = (attrgetter(a) for a in ("client", "parent", "ns", "mask", "tokens"))
SNAPSHOT_CHUNK = 4096
"""Blocks per batch of a snapshot (and of the announcement at start)."""
REBUILD_EVERY_S = 5.0
REPLAY_HWM = 1024
"""Replay answer messages queued for one requester; past it, the rest of that answer is dropped
(a requester that reads nothing holds at most this many, each a batch of the bounded buffer)."""
MAX_REQUEST_BYTES = 4096
"""The largest message a peer may send to an event port (a subscription, a replay request);
ZeroMQ disconnects a peer that sends more."""
HANDSHAKE_MS = 5000
"""A connection to an event port that has not finished ZeroMQ's handshake by then is closed
(ZeroMQ's default, 30 s, let idle plain connections hold descriptors 6x longer)."""


class _Rec(msgspec.Struct, gc=False):
    """The mirror's entry of one stored block. A struct the garbage collector does not track
    (it holds bytes, ints and a shared :class:`_NsInfo`, never a cycle) and that is built in
    C: a put makes one per new block, and a tracked object per block made the collector walk
    the daemon's heap every few puts."""

    client: bytes | None  # None: a keyed tenant's block recovered at start, not named yet
    parent: bytes | None
    ns: _NsInfo
    mask: int
    tokens: bytes | None = None  # its token ids (int32), when a put carried them


@dataclass(frozen=True, slots=True)
class _NsInfo:
    tenant: int  # index into the publisher's tenant names
    block_size: int
    lora: str | None
    fan: list[tuple[_Stream, int]]
    """The streams its blocks go to, each with the mask its hashes carry there."""


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
    buffer_bytes: int = 0
    """Payload bytes in ``buffer`` (kept under ``[events] replay_bytes``)."""
    pending: dict[int, list[Any]] = field(default_factory=dict)  # tenant -> events of this cycle


HOOK_BYTES = 64
"""What a queued block change is counted at (its key's share of the operation's lists)."""
TOKEN_ENTRY_BYTES = 41
"""What the mirror's token ids of a block cost besides the ids: their ``bytes`` object's header
(33) and their slot in the publisher's order of kept token ids (8)."""


def _item_bytes(item: tuple[Any, ...], n: int) -> int:
    """The bytes a hook queue entry of ``n`` block changes is counted at: :data:`HOOK_BYTES` a
    change, and a put's token ids (held until the publisher takes them)."""
    tokens = item[2] if item[0] == "b" else None
    return HOOK_BYTES * n + (tokens.tokens.nbytes if tokens is not None else 0)


def _event_bytes(e: Any) -> int:
    """At least the bytes of event ``e``'s msgpack (a hash 18, a token id 5, the fields'
    names and values 160 and its strings), computed before its tokens are encoded."""
    if type(e) is AllBlocksCleared:
        return 32
    n = 160 + 18 * len(e.block_hashes) + len(e.medium or "")
    if type(e) is BlockStored:
        n += len(e.lora_name or "") + 5 * sum(map(len, cast("list[bytes]", e.token_ids))) // 4 + 5
    return n


def _split(e: Any, cap: int) -> list[Any]:
    """Event ``e`` as events of at most ``cap`` bytes each (by :func:`_event_bytes`; a single
    block's event larger than ``cap`` goes alone): a ``BlockStored``'s parts continue its chain
    (each part's parent is the block before it), a ``BlockRemoved``'s are runs of its hashes."""
    hs = e.block_hashes
    per = max(1, _event_bytes(e) // len(hs)) if hs else 1
    step = max(1, (cap - 200 - len(getattr(e, "lora_name", None) or "") - len(e.medium or "")) // per)
    if type(e) is BlockRemoved:
        return [BlockRemoved(block_hashes=hs[i:i + step], medium=e.medium) for i in range(0, len(hs), step)]
    toks = e.token_ids
    return [BlockStored(block_hashes=hs[i:i + step], parent_block_hash=hs[i - 1] if i else e.parent_block_hash,
                        token_ids=toks[i:i + step] if toks else [], block_size=e.block_size, lora_id=e.lora_id,
                        medium=e.medium, lora_name=e.lora_name) for i in range(0, len(hs), step)]


def _batches(events: list[Any], cap: int) -> Iterator[list[Any]]:
    """``events`` as consecutive batches of at most ``cap`` bytes each (by :func:`_event_bytes`,
    16 for the batch itself; an event larger than a batch split by :func:`_split`), in order."""
    sizes = list(map(_event_bytes, events))
    if sum(sizes) + 16 <= cap:
        yield events
        return
    part: list[Any] = []
    size = 16
    for e, n in zip(events, sizes, strict=True):
        for piece, m in ([(e, n)] if n + 16 <= cap else [(p, _event_bytes(p)) for p in _split(e, cap - 16)]):
            if part and size + m > cap:
                yield part
                part, size = [], 16
            part.append(piece)
            size += m
    if part:
        yield part


def _token_slices(tokens: PutTokens) -> tuple[bytes, int, dict[bytes, int]]:
    """A put's token ids as one bytes, the bytes a block takes, and where each key's begin:
    a block's are ``tb[i:i + step]``, one slice each, no numpy call per block."""
    tb = tokens.tokens.astype("<i4", copy=False).tobytes()
    step = 4 * tokens.block_tokens
    return tb, step, dict(zip(tokens.keys, range(0, len(tb), step), strict=True))


def _endpoint(url: str) -> tuple[str, int]:
    m = re.match(r"^tcp://([^:/]+):(\d+)$", url)
    if m is None:
        raise ValueError(f"not a tcp://HOST:PORT endpoint: {url!r}")
    return m.group(1), int(m.group(2))


class KVEventPublisher:
    """Publishes the store's block events; see the module docstring. Thread-safe hooks."""

    def __init__(
        self,
        store: KVStore,
        config: EventsConfig,
        tenants: Sequence[tuple[str, str, str, bool]] = (),
        *,
        hwm: int | None = None,
    ) -> None:
        """``tenants``: ``(name, salt, token, admin)`` of each configured tenant (none: the
        anonymous tenant, one stream without authentication). ``hwm``: batches queued for one
        subscriber (default ``subscriber_bytes // max_batch_bytes``)."""
        if config.publish is None:
            raise ValueError("KVEventPublisher needs [events] publish")
        self.store = store
        self.config = config
        self._tiers = [t.name for t in store.tiers]
        self._tier_bit = {n: 1 << k for k, n in enumerate(self._tiers)}
        self._bits = [tuple(k for k in range(len(self._tiers)) if m & (1 << k)) for m in range(1 << len(self._tiers))]
        """The tier positions of each mask, fastest first."""
        self._epoch = f"{time.time_ns():x}"
        # One entry per store operation (a list of block changes) or put naming; ``_queued``
        # counts the blocks they hold against ``publish_queue``.
        self._q: deque[tuple[Any, ...]] = deque()
        self._cap = config.publish_queue
        self._cap_bytes = config.publish_queue_bytes
        self._queued = 0
        self._queued_bytes = 0
        """What the queued entries hold, by :func:`_item_bytes` (kept under ``publish_queue_bytes``)."""
        self._warned: dict[str, float] = {}
        self._qlock = threading.Lock()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._asleep = False
        self._sleep_until = 0.0  # when the sleeping thread wakes by itself (monotonic)
        self._first_t = 0.0  # when the oldest waiting change was queued
        self._lull = False  # the first change after a lull woke the thread: it publishes at once
        self._busy_until = 0.0  # changes came lately: the thread looks every 2 periods
        self._period = config.publish_period_s
        self._flushes = 0  # flush markers queued: the thread publishes at once
        self._stopping = threading.Event()
        self._drain_lock = threading.Lock()
        """Held by whoever applies and publishes (the thread, or a :meth:`pump`)."""
        self._pump_enc = msgspec.msgpack.Encoder()
        self._cpu_s = 0.0
        self._pump_cpu_s = 0.0
        self._counts = {"dropped": 0, "batches": 0, "events": 0, "block_events": 0, "replays": 0, "replays_dropped": 0, "snapshots": 0,
                        "unnamed": 0, "rebuilds": 0, "wakeups": 0, "tokens_dropped": 0}
        self._lost = threading.Event()
        self._recs: dict[bytes, _Rec] = {}
        self._tok_recs: deque[_Rec] = deque()
        """The records holding token ids, in the order they got them (:meth:`_trim_tokens`); a
        record of a block that left the store stays here, its token ids counted, until trimmed."""
        self._tok_bytes = 0
        """What their token ids cost (ids and :data:`TOKEN_ENTRY_BYTES`), under ``mirror_token_bytes``."""
        self._ns_index: dict[bytes, _NsInfo] = {}
        self._tenant_names = [t[0] for t in tenants] or [""]
        self._salts = {t[1]: i for i, t in enumerate(tenants)}
        self._keyed = bool(tenants)
        self._masks = [tenant_mask(n) for n in self._tenant_names] if self._keyed else [0]
        if hwm is None:
            hwm = max(1, config.subscriber_bytes // config.max_batch_bytes)
        self.hwm = hwm
        self._answers: deque[tuple[zmq.MessageTracker, int]] = deque()
        """Replay answer messages handed to ZeroMQ, each with its tracker and bytes, oldest first."""
        self._answer_bytes = 0
        """Bytes of ``_answers`` whose tracker is not done (under ``replay_answer_bytes``)."""
        self._fan: list[list[tuple[_Stream, int]]] = []
        """Per tenant: the streams its blocks go to, each with the mask its hashes carry there."""
        self._snapshot_pending = False
        self._last_send = self._last_rebuild = 0.0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.gate = ZmqPortGate(config.max_connections, config.max_connections_per_peer, HANDSHAKE_MS / 1000,
                                "kv event port")
        """Connections to the event ports (:class:`kvstore.server.limits.ZmqPortGate`)."""
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
            os.close(self._wake)
            raise OSError(
                f"[events] publish: cannot bind {config.publish} (replay port {rport}): {e}; pick free "
                "ports or port 0 for any"
            ) from e
        self._fan = [
            [(st, self._masks[t] if st.tenant is None else 0) for st in self.streams if st.tenant in (None, t)]
            for t in range(len(self._tenant_names))
        ]
        self._load()
        store.events.sinks.append(self)
        self._thread = threading.Thread(target=self._run, name="kvstore-kvevents", daemon=True)
        self._thread.start()
        self.gate.start()

    def _stream(self, name: str, tenant: int | None, host: str, port: int, rport: int, hwm: int,
                domain: str | None) -> _Stream:
        pub = self._ctx.socket(zmq.PUB)
        rep = self._ctx.socket(zmq.ROUTER)
        for s in (pub, rep):
            s.setsockopt(zmq.LINGER, 0)
            if domain is not None:
                s.setsockopt(zmq.PLAIN_SERVER, 1)
                s.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        pub.setsockopt(zmq.SNDHWM, hwm)
        rep.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        for s in (pub, rep):  # what a peer may send: subscriptions, replay requests
            s.setsockopt(zmq.RCVHWM, 64)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        rep.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises (zmq.Again), never blocks
        for sock in (pub, rep):  # a connection that never finishes its handshake goes
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        purl = f"tcp://{host}:{self.gate.bind(pub, host, port)}"
        rurl = f"tcp://{host}:{self.gate.bind(rep, host, rport)}"
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
        """Counters; ``events``: events published, ``block_events``: block hashes they carried,
        ``cpu_s``: the CPU time publishing took (the thread's, ``thread_cpu_s``, and the pumps'),
        what it costs the daemon besides the hooks."""
        return {**self._counts, "queued": self._queued, "queued_bytes": self._queued_bytes,
                "replay_buffer_bytes": {s.name: s.buffer_bytes for s in self.streams},
                "replay_answer_bytes": self._answer_bytes, "subscriber_hwm": self.hwm,
                "connections": self.gate.total, "connections_refused": self.gate.refused,
                "accept_pauses": self.gate.pauses, "mirrored": len(self._recs),
                "mirror_token_bytes": self._tok_bytes,
                "cpu_s": self._cpu_s + self._pump_cpu_s, "thread_cpu_s": self._cpu_s,
                "streams": {s.name: s.seq for s in self.streams}}

    def collector(self) -> Any:
        """A Prometheus collector of what the publisher dropped and holds (``/metrics``):
        ``kvstore_kv_events_dropped_total{what}`` (``hooks``: block changes past the hook
        queue's bounds, each costing subscribers a snapshot; ``replay_answers``: answers past
        ``replay_answer_bytes`` or a requester's full queue; ``mirror_tokens``: blocks' token
        ids the mirror let go of past ``mirror_token_bytes``, a block's that had left the store
        included; ``connections``: event port connections closed over the limits) and
        ``kvstore_kv_events_queued_bytes{queue}``."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from prometheus_client.registry import Collector

        pub = self

        class _Collector(Collector):
            def collect(self) -> Iterator[Any]:
                c = pub._counts
                dropped = CounterMetricFamily("kvstore_kv_events_dropped", "What the KV event publisher dropped",
                                              labels=["what"])
                for what, key in (("hooks", "dropped"), ("replay_answers", "replays_dropped"),
                                  ("mirror_tokens", "tokens_dropped")):
                    dropped.add_metric([what], c[key])
                dropped.add_metric(["connections"], pub.gate.refused)
                yield dropped
                held = GaugeMetricFamily("kvstore_kv_events_queued_bytes", "Bytes the KV event publisher holds "
                                         "in its queues (hooks, replay buffers, unread replay answers) "
                                         "and its mirror's token ids", labels=["queue"])
                held.add_metric(["hooks"], pub._queued_bytes)
                held.add_metric(["replay_buffer"], sum(s.buffer_bytes for s in pub.streams))
                held.add_metric(["replay_answers"], pub._answer_bytes)
                held.add_metric(["mirror_tokens"], pub._tok_bytes)
                yield held

        return _Collector()

    # ---- hooks (any thread; blocks() with the store's lock held) ---------------------------------

    def _put(self, item: tuple[Any, ...], n: int, *, wake: bool = True) -> None:
        size = _item_bytes(item, n)
        with self._qlock:
            if self._queued + n > self._cap or self._queued_bytes + size > self._cap_bytes:
                self._counts["dropped"] += n
                self._lost.set()  # (the nudge below brings the rebuild as soon as it may run)
                wake = True
                self._warn("dropped", "kv events: block hooks dropped (the queue holds %d changes, %d bytes; limits "
                           "publish_queue %d, publish_queue_bytes %d); subscribers get a snapshot", self._queued,
                           self._queued_bytes, self._cap, self._cap_bytes)
            else:
                if not self._queued:
                    self._first_t = time.monotonic()
                    self._busy_until = self._first_t + HEARTBEAT_S
                self._queued += n
                self._queued_bytes += size
                self._q.append(item)
        if wake:
            self._nudge()

    def _warn(self, what: str, msg: str, *args: Any) -> None:
        """``msg`` once per burst of ``what`` (one line per 10 s at most), with the count so far."""
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 10.0:
            self._warned[what] = now
            log.warning(msg + "; %d so far", *args, self._counts[what])

    def _nudge(self) -> None:
        # The thread sets _asleep, then looks at the queue once more before it sleeps; we
        # append, then look at _asleep: one of the two sees the other (the GIL orders them).
        if self._asleep:
            self._asleep = False
            os.eventfd_write(self._wake, 1)

    def blocks(self, runs: list[BlockRun], tokens: PutTokens | None, chain: PutChain | None = None) -> None:
        """The changes of one store operation (see :class:`kvstore.events.BlockSink`): one
        queue entry holding the store's own lists (and a put's chain), nothing done a block.
        No wake-up here (this runs under the store's lock): the service's :meth:`pump` after
        the operation wakes the thread if it sleeps past its period; a maintenance pass's
        expiry, which no pump follows, goes with the next period or heartbeat, within a
        second."""
        self._put(("b", runs, tokens, chain), sum(map(len, map(_keys, runs))), wake=False)

    def pump(self) -> None:
        """The service calls it after each put and load, outside the store's lock. Once the
        oldest waiting change is ``[events] publish_period`` old, or :data:`PUMP_BATCH` changes
        wait, it publishes them on the caller's thread: there its caches are warm with them,
        and a publication costs a few hundred µs of CPU less than the thread's, which wakes
        cold. Younger changes wait for a later pump, or for the thread's backstop (two
        periods); the first change after a lull wakes the thread, which publishes it at once.
        Never waits: while the thread publishes, it is left to it."""
        if not self._q:
            return
        if self._queued < PUMP_BATCH and time.monotonic() - self._first_t < self._period:
            if self._asleep and self._sleep_until > self._first_t + 2 * self._period:
                self._lull = True
                self._nudge()
            return
        if self._drain_lock.acquire(blocking=False):
            try:
                c0 = time.thread_time()
                self._drain(self._pump_enc)
                self._pump_cpu_s += time.thread_time() - c0
            finally:
                self._drain_lock.release()

    def names(self, ns: Namespace, hashes: Sequence[bytes], keys: Sequence[bytes], start: int) -> None:
        """The client hashes of a put's chain (``keys``: what the store is given), called before
        the put: its ``placed`` events then publish under these names. Nothing for the
        anonymous tenant, whose keys are the client hashes: the store hands the publisher the
        chain with the put's new copies (:class:`kvstore.events.PutChain`)."""
        if self._keyed:
            names = tuple(hashes)
            self._put(("n", ns, names, names if keys is hashes else tuple(keys), start), len(hashes), wake=False)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything hooked before this call is published (tests, shutdown)."""
        done = threading.Event()
        with self._qlock:
            self._flushes += 1
        self._q.append(("f", done))  # a marker is never dropped
        self._nudge()
        return done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self._stopping.set()
            self._asleep = True
            self._nudge()
            self._thread.join(10.0)
        with contextlib.suppress(ValueError):
            self.store.events.sinks.remove(self)
        self._close_sockets()
        os.close(self._wake)

    def _close_sockets(self) -> None:
        self.gate.close()
        for s in self.streams:
            s.pub.close(0)
            s.replay.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ---- the mirror -----------------------------------------------------------------------------

    def _ns_of(self, ns: Namespace) -> _NsInfo:
        digest = bytes(ns.root)
        info = self._ns_index.get(digest)
        if info is None:
            tenant = self._salts.get(ns.tenant_salt, 0)
            info = self._ns_index[digest] = _NsInfo(tenant, ns.block_tokens, ns.lora_id or None, self._fan[tenant])
        return info

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
        self._tok_recs.clear()  # (the old records go, their token ids with them)
        self._tok_bytes = 0
        self._counts["rebuilds"] += 1
        self._snapshot_pending = True

    def _apply(self, item: tuple[Any, ...]) -> None:
        """One queue entry: a store operation's changes, or a put's names."""
        if item[0] == "b":
            self._apply_changes(item[1], item[2], item[3])
            return
        _, ns, hashes, keys, start = item
        recs, info = self._recs, self._ns_of(ns)
        new = keys[start:]
        if not self._keyed and recs.keys().isdisjoint(new):
            # A put of new blocks (the usual case): their records in C, none looked up one by one.
            # The anonymous tenant's earlier blocks have their names already (client = key).
            parents = [hashes[start - 1] if start else None, *hashes[start:-1]]
            recs.update(zip(new, map(_Rec, hashes[start:], parents, repeat(info), repeat(0)), strict=True))
            return
        parent = None
        get, rec_ = recs.get, _Rec
        for client, key in zip(hashes, keys, strict=True):
            rec = get(key)
            if rec is None:
                recs[key] = rec_(client, parent, info, 0)
            elif rec.client is None:  # recovered at start: now it has a name to publish
                rec.client, rec.parent = client, parent
                for k in range(len(self._tiers)):
                    if rec.mask & (1 << k):
                        self._stored([rec], k, info.fan)
            parent = client

    def _apply_changes(self, runs: list[BlockRun], tokens: PutTokens | None, chain: PutChain | None) -> None:
        """A store operation's changes into the mirror and the pending events. The common
        shapes go in bulk (:meth:`_apply_put`, :meth:`_apply_gone`, :meth:`_apply_uniform`);
        the rest block by block: consecutive copies of one chain on one tier become one run
        (one list extend per stream), as do consecutive removals from one tier, so the loop
        below does a dictionary look-up and a few comparisons per change, no more."""
        if len(runs) == 1:
            kind, k, keys = runs[0]
            if not self._keyed:
                if kind == "p":
                    if chain is not None and self._apply_put(keys, k, tokens, chain):
                        return
                elif self._apply_gone(kind, k, keys):
                    return
            if len(keys) >= _FAST_MIN and self._apply_uniform(kind, k, keys, tokens):
                return
        changes = block_changes(runs)
        recs = self._recs
        get = recs.get
        born: dict[bytes, int] | None = None  # the chain's positions, for copies no record names yet
        at: dict[bytes, int] | None = None
        tb = b""
        step = 0
        if tokens is not None:
            tb, step, at = _token_slices(tokens)
        run: list[_Rec] = []  # stored: one chain, one tier, one namespace, tokens or none
        run_k = -1
        tail: _Rec | None = None  # run[-1]
        gone: list[_Rec] = []  # removed from one tier
        gone_k = -1
        for kind, key, k in changes:
            rec = get(key)
            if rec is None and kind == "p" and chain is not None and not self._keyed:
                # A new block of the anonymous tenant: its name is its key, its parent the
                # chain's block before it.
                if born is None:
                    born = {h: i for i, h in enumerate(chain.hashes)}
                i = born.get(key)
                if i is not None:
                    rec = recs[key] = _Rec(key, chain.hashes[i - 1] if i else None, self._ns_of(chain.ns), 0)
            if rec is None:
                if kind == "p":
                    self._counts["unnamed"] += 1
                continue
            if kind == "p":
                rec.mask |= 1 << k
                if at is not None and rec.tokens is None and (i := at.get(key)) is not None:
                    rec.tokens = tb[i:i + step]
                    self._tok_recs.append(rec)
                    self._tok_bytes += step + TOKEN_ENTRY_BYTES
                if rec.client is None:
                    continue
                if gone:
                    self._removed(gone, gone_k)
                    gone = []
                if tail is not None and (k != run_k or rec.parent != tail.client or rec.ns is not tail.ns
                                         or (rec.tokens is None) is not (tail.tokens is None)):
                    self._stored(run, run_k, tail.ns.fan)
                    run = []
                run.append(rec)
                tail, run_k = rec, k
                continue
            if kind == "c":
                if not rec.mask & (1 << k):
                    continue
                rec.mask &= ~(1 << k)
                if not rec.mask:
                    del recs[key]
                ks: tuple[int, ...] = (k,)
            else:  # "d": k is the mask of the tiers that held it
                del recs[key]
                ks = self._bits[k | rec.mask]
            if rec.client is None:
                continue
            if tail is not None:
                self._stored(run, run_k, tail.ns.fan)
                run, tail = [], None
            if len(ks) == 1 and ks[0] == gone_k:
                gone.append(rec)
                continue
            for t in ks:
                if gone and t != gone_k:
                    self._removed(gone, gone_k)
                    gone = []
                gone.append(rec)
                gone_k = t
        if tail is not None:
            self._stored(run, run_k, tail.ns.fan)
        if gone:
            self._removed(gone, gone_k)

    def _apply_put(self, keys: list[bytes], k: int, tokens: PutTokens | None, chain: PutChain) -> bool:
        """The anonymous tenant's usual put: new blocks, one run of the chain, on tier ``k``.
        No record is looked up (the chain names every parent); the records are made in C,
        one statement for the batch. False, with nothing changed, for any other shape."""
        n = len(keys)
        recs = self._recs
        if not recs.keys().isdisjoint(keys):
            return False  # some were cached before (a copy on another tier): block by block
        hashes = chain.hashes
        j = len(hashes) - n  # the new blocks: the chain's suffix, or its leading part when cut short
        if j < 0:
            return False
        if hashes[j] != keys[0]:
            try:
                j = hashes.index(keys[0])
            except ValueError:
                return False
        if list(hashes[j:j + n]) != keys:
            return False
        info = self._ns_of(chain.ns)
        parent = hashes[j - 1] if j else None
        parents = [parent, *keys[:-1]]
        bit = 1 << k
        if tokens is None:
            toks: Any = repeat(None)
        else:
            step = 4 * tokens.block_tokens
            at = j - (len(hashes) - len(tokens.keys))  # tokens holds those of hashes[start:]
            if at < 0:
                return False
            tb = tokens.tokens.astype("<i4", copy=False).tobytes()
            toks = [tb[o:o + step] for o in range(at * step, (at + n) * step, step)]
        new = list(map(_Rec, keys, parents, repeat(info), repeat(bit), toks))
        recs.update(zip(keys, new, strict=True))
        self._stored_hashes(keys, parent, None if tokens is None else toks, k, info)
        if tokens is not None:
            self._tok_recs.extend(new)
            self._tok_bytes += n * (step + TOKEN_ENTRY_BYTES)
        return True

    def _apply_gone(self, kind: str, k: int, keys: list[bytes]) -> bool:
        """The anonymous tenant's removals in bulk: blocks that left the store, or lost their
        last copy, all from one tier (the evictions that made room for a put). False, with
        nothing changed, for any other shape."""
        mask = k if kind == "d" else 1 << k  # ("d": k is the mask of the tiers that held it)
        if not mask or mask & (mask - 1):
            return False  # held on several tiers: one BlockRemoved per medium, block by block
        recs = self._recs
        rs = list(map(recs.pop, keys, repeat(None)))
        if None in rs or countOf(map(_mask, rs), mask) != len(keys):
            recs.update((key, r) for key, r in zip(keys, rs, strict=True) if r is not None)  # (as it was)
            return False
        self._removed_hashes(keys, mask.bit_length() - 1, self._fan[0], 0)
        return True

    def _apply_uniform(self, kind: str, k: int, keys: list[bytes], tokens: PutTokens | None) -> bool:
        """The common operations in bulk: one run, every change of one kind on one tier (a
        put's new copies, one chain; the removals that made room for it; a load's
        promotions). The checks and the look-ups run in C (``map``, set and list
        comparisons); what stays in Python is one statement a block. False, with nothing
        changed, when the batch is not of that shape: :meth:`_apply_changes` then takes it
        block by block."""
        recs = self._recs
        rs = cast("list[_Rec]", list(map(recs.get, keys)))  # (None in rs returns next)
        if None in rs:
            return False
        clients = list(map(_client, rs))
        if self._keyed and None in clients:  # (the anonymous tenant's blocks all have names)
            return False
        if kind == "p":
            ns = rs[0].ns
            if list(map(_parent, rs[1:])) != clients[:-1] or len(set(map(id, map(_ns, rs)))) != 1:
                return False  # not one chain of one namespace
            bit = 1 << k
            if tokens is None:
                if list(map(_tokens, rs)).count(None) != len(rs):
                    return False  # some carry tokens: BlockStored never mixes the two
                for r in rs:
                    r.mask |= bit
            else:
                tb, step, at = _token_slices(tokens)
                offs = cast("list[int]", list(map(at.get, keys)))  # (None in offs returns next)
                if None in offs:
                    return False
                fresh = [r for r in rs if r.tokens is None]
                for r, i in zip(rs, offs, strict=True):  # (the same hash has the same tokens: overwriting is fine)
                    r.mask |= bit
                    r.tokens = tb[i:i + step]
                self._tok_recs.extend(fresh)
                self._tok_bytes += len(fresh) * (step + TOKEN_ENTRY_BYTES)
            self._stored(rs, k, ns.fan)
            return True
        masks = set(map(_mask, rs))
        if kind == "d":  # k: the tiers that held it
            masks.add(k)
        else:  # "c": k is the tier that lost its copy; bulk only when it was each one's last
            masks.add(1 << k)
        if len(masks) != 1:
            return False
        mask = masks.pop()
        if mask & (mask - 1):
            return False  # held on several tiers: one BlockRemoved per medium, block by block
        deque(map(recs.__delitem__, keys), maxlen=0)  # (del of each, in C)
        self._removed(rs, mask.bit_length() - 1)
        return True

    def _trim_tokens(self) -> None:
        """Let go of the oldest token ids until the mirror's are under ``mirror_token_bytes``
        (between operations, so no run of :meth:`_stored` ever mixes blocks with and without).
        A record of a block that left the store is let go of here too: its token ids were
        counted until now."""
        q, cap, dropped = self._tok_recs, self.config.mirror_token_bytes, 0
        while self._tok_bytes > cap and q:
            r = q.popleft()
            if r.tokens is not None:
                self._tok_bytes -= len(r.tokens) + TOKEN_ENTRY_BYTES
                r.tokens = None
                dropped += 1
        self._counts["tokens_dropped"] += dropped
        self._warn("tokens_dropped", "kv events: the mirror let go of the token ids of its %d oldest blocks "
                   "(mirror_token_bytes %d); their later events (promotions, demotions, snapshots) carry none",
                   dropped, cap)

    # ---- events into the streams' batches ---------------------------------------------------------

    def _stored(self, run: list[_Rec], k: int, fan: list[tuple[_Stream, int]]) -> None:
        """A run of copies on tier ``k`` (one chain of one namespace, each block after the one
        before it, all with tokens or none) into the pending events of each stream of ``fan``:
        it extends the last ``BlockStored`` when it continues that one's chain."""
        first = run[0]
        toks = list(map(_tokens, run)) if first.tokens is not None else None
        self._stored_hashes(list(map(_client, run)), first.parent, toks, k, first.ns, fan)

    def _stored_hashes(self, hashes: list[bytes], parent0: bytes | None, toks: list[bytes] | None, k: int,
                       info: _NsInfo, fan: list[tuple[_Stream, int]] | None = None) -> None:
        """:meth:`_stored` of the run's client hashes, its first block's parent and its token
        ids (one int32 ``bytes`` a block, or None); ``fan``: the namespace's streams unless
        given."""
        medium, tenant = self._tiers[k], info.tenant
        for s, m in info.fan if fan is None else fan:
            events = s.pending.get(tenant)
            if events is None:
                events = s.pending[tenant] = []
            hs: list[bytes | int] = [masked(h, m) for h in hashes] if m else list(hashes)
            parent = masked(parent0, m) if m and parent0 is not None else parent0
            last = events[-1] if events else None
            if (type(last) is BlockStored and last.block_hashes[-1] == parent and last.medium == medium
                    and last.block_size == info.block_size and last.lora_name == info.lora
                    and (toks is None) == (not last.token_ids)):
                last.block_hashes.extend(hs)
                if toks is not None:
                    last.token_ids.extend(toks)  # type: ignore[arg-type]  # bytes until _encode
            else:
                events.append(BlockStored(block_hashes=hs, parent_block_hash=parent,
                                          token_ids=[] if toks is None else list(toks),  # type: ignore[arg-type]  # bytes until _encode
                                          block_size=info.block_size, lora_id=None, medium=medium,
                                          lora_name=info.lora))

    def _removed(self, gone: list[_Rec], k: int) -> None:
        """Copies that left tier ``k`` into the pending ``BlockRemoved`` of each stream."""
        by_tenant: dict[int, tuple[list[tuple[_Stream, int]], list[bytes]]] = {}
        if not self._keyed:  # one tenant
            by_tenant[0] = (gone[0].ns.fan, list(map(_client, gone)))
            gone = []
        for r in gone:
            group = by_tenant.get(r.ns.tenant)
            if group is None:
                group = by_tenant[r.ns.tenant] = (r.ns.fan, [])
            group[1].append(r.client)  # type: ignore[arg-type]  # named: the callers checked
        for tenant, (fan, hashes) in by_tenant.items():
            self._removed_hashes(hashes, k, fan, tenant)

    def _removed_hashes(self, hashes: list[bytes], k: int, fan: list[tuple[_Stream, int]], tenant: int) -> None:
        """Client hashes of one tenant that left tier ``k`` into the pending ``BlockRemoved``
        of each stream of ``fan``."""
        medium = self._tiers[k]
        for s, m in fan:
            events = s.pending.get(tenant)
            if events is None:
                events = s.pending[tenant] = []
            hs: list[bytes | int] = [masked(h, m) for h in hashes] if m else list(hashes)
            last = events[-1] if events else None
            if type(last) is BlockRemoved and last.medium == medium:
                last.block_hashes.extend(hs)
            else:
                events.append(BlockRemoved(block_hashes=hs, medium=medium))

    def _snapshot(self, stream: _Stream) -> Iterator[tuple[int, list[Any]]]:
        """(tenant, events) chunks: AllBlocksCleared, then every named block the stream may see."""
        tenants = range(len(self._tenant_names)) if stream.tenant is None else [stream.tenant]
        for t in tenants:
            yield t, [AllBlocksCleared()]
        saved = stream.pending
        for t in tenants:
            fan = [(stream, self._masks[t] if stream.tenant is None else 0)]
            stream.pending = {}
            n = 0
            for rec in self._recs.values():
                if rec.client is None or rec.ns.tenant != t:
                    continue
                for k in range(len(self._tiers)):
                    if rec.mask & (1 << k):
                        self._stored([rec], k, fan)
                n += 1
                if n >= SNAPSHOT_CHUNK:
                    yield t, stream.pending.pop(t, [])
                    n = 0
            if stream.pending.get(t):
                yield t, stream.pending.pop(t)
        stream.pending = saved

    # ---- the thread -------------------------------------------------------------------------------

    def _topic(self, tenant: int) -> bytes:
        return f"{self._tenant_names[tenant]}@{self._epoch}".encode()

    def _encode(self, events: list[Any], enc: msgspec.msgpack.Encoder) -> bytes:
        """The batch's msgpack; a ``BlockStored``'s tokens, kept as one int32 ``bytes`` per
        block while it grows, become its ``token_ids`` here."""
        n = 0
        for e in events:
            if type(e) is AllBlocksCleared:
                continue
            n += len(e.block_hashes)
            if type(e) is BlockStored and e.token_ids:
                e.token_ids = msgpack_ints(b"".join(e.token_ids))  # type: ignore[arg-type, assignment]  # bytes, then Raw
        self._counts["block_events"] += n
        return enc.encode(KVEventBatch(ts=time.time(), events=events))

    def _send(self, stream: _Stream, tenant: int, events: list[Any], enc: msgspec.msgpack.Encoder) -> None:
        """Publish ``events`` as one batch, or as several of at most ``max_batch_bytes`` each."""
        for part in _batches(events, self.config.max_batch_bytes):
            self._send_batch(stream, tenant, part, enc)

    def _send_batch(self, stream: _Stream, tenant: int, events: list[Any], enc: msgspec.msgpack.Encoder) -> None:
        stream.seq += 1
        payload = self._encode(events, enc)
        with contextlib.suppress(zmq.Again):
            stream.pub.send_multipart((self._topic(tenant), seq_bytes(stream.seq), payload), flags=zmq.NOBLOCK)
        buf = stream.buffer
        if len(buf) == buf.maxlen:  # (the append below pushes the oldest out)
            stream.buffer_bytes -= len(buf[0][1])
        buf.append((stream.seq, payload))
        stream.buffer_bytes += len(payload)
        while stream.buffer_bytes > self.config.replay_bytes and len(buf) > 1:
            stream.buffer_bytes -= len(buf.popleft()[1])
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
        # Answers never wait and never copy: a queued batch is the buffer's own bytes (a
        # zero-copy frame), tracked until ZeroMQ lets go of it. A requester that does not read
        # fills its own queue (REPLAY_HWM messages), and the answers of all requesters together
        # stay within replay_answer_bytes; past either, the rest of that answer is dropped.
        try:
            if s.buffer and s.buffer[0][0] <= start:
                for seq, payload in list(s.buffer):
                    if seq >= start:
                        self._answer(s, client, seq_bytes(seq), payload)
            elif start <= s.seq:  # what was asked for is gone: the state instead, as of s.seq
                # One batch, so that a subscriber that applies a seq once (vLLM's example) takes it all.
                self._counts["snapshots"] += 1
                events = [e for _, chunk in self._snapshot(s) for e in chunk]
                self._answer(s, client, seq_bytes(s.seq), self._encode(events, enc))
            s.replay.send_multipart((client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):  # its queue is full, or it is gone: it asks again
            self._counts["replays_dropped"] += 1
            self._warn("replays_dropped", "kv events: a replay answer dropped (%d bytes of answers unread, limit "
                       "replay_answer_bytes %d; or its requester's queue full or gone)", self._answer_bytes,
                       self.config.replay_answer_bytes)

    def _answer(self, s: _Stream, client: bytes, seq: bytes, payload: bytes) -> None:
        """One replay answer message to ``client``, without a copy; zmq.Again when it does not
        fit ``replay_answer_bytes`` (one always fits while no other is queued)."""
        answers = self._answers
        while answers and answers[0][0].done:
            self._answer_bytes -= answers.popleft()[1]
        if answers and self._answer_bytes + len(payload) > self.config.replay_answer_bytes:
            # (trackers finish out of order across requesters: look past the oldest once)
            kept = [a for a in answers if not a[0].done]
            answers.clear()
            answers.extend(kept)
            self._answer_bytes = sum(n for _, n in kept)
            if kept and self._answer_bytes + len(payload) > self.config.replay_answer_bytes:
                raise zmq.Again()
        frame = zmq.Frame(payload, copy=False, track=True)
        s.replay.send_multipart((client, b"", seq, frame), flags=zmq.NOBLOCK, copy=False)
        assert frame.tracker is not None
        answers.append((frame.tracker, len(payload)))
        self._answer_bytes += len(payload)

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        # Asleep until a replay request, a flush, a drop, close or the first change after a lull
        # (the eventfd), the heartbeat, or the backstop of changes no pump published.
        poller = zmq.Poller()
        for s in self.streams:
            poller.register(s.replay, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        replays = {s.replay: s for s in self.streams}
        self._last_send = time.monotonic()
        self._last_rebuild = 0.0
        cpu0 = time.thread_time()
        while not self._stopping.is_set():
            try:
                with self._drain_lock:
                    if self._snapshot_pending:
                        self._snapshot_pending = False
                        self._publish_snapshots(enc)
                        self._last_send = time.monotonic()
                    if self._due(time.monotonic()):
                        self._lull = False
                        self._drain(enc)
                self._cpu_s = time.thread_time() - cpu0
                ready = poller.poll(self._sleep_ms())
                self._asleep = False
                for sock, _ in ready:
                    if sock == self._wake:
                        self._counts["wakeups"] += 1
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(self._wake)
                        continue
                    # A replay covers every hook that ran before it was asked for: what was
                    # queued is published first (the router's refresh() relies on it).
                    with self._drain_lock:
                        self._drain(enc)
                        self._serve_replay(replays[sock], enc)
            except zmq.ZMQError as e:
                log.warning("kv events: replay failed: %s", e)
        with self._drain_lock:
            self._drain(enc)  # what was hooked before close

    def _due(self, now: float) -> bool:
        """Whether the thread publishes now: a flush or a drop waits, the heartbeat is due, or
        changes wait that a lull's first put woke it for, or that no pump took in time."""
        return bool(self._flushes or self._lost.is_set() or now - self._last_send >= HEARTBEAT_S
                    or (self._q and (self._lull or self._queued >= PUMP_BATCH
                                     or now - self._first_t >= self._period)))

    def _sleep_ms(self) -> int:
        """How long the thread may sleep: until the heartbeat is due, or a rebuild may run;
        while changes wait, until two periods after the oldest (the pumps publish them after
        one); while changes came within the last heartbeat, two periods (a look that finds
        nothing costs less than a nudge for every put). Sets ``_asleep`` first (see
        :meth:`_nudge`)."""
        self._sleep_until = float("inf")  # a pump that reads it meanwhile nudges: never too late
        self._asleep = True
        now = time.monotonic()
        due = self._last_send + HEARTBEAT_S
        if self._lost.is_set():
            due = min(due, self._last_rebuild + REBUILD_EVERY_S)
        if self._snapshot_pending or self._stopping.is_set() or self._flushes:
            self._sleep_until = now
            return 0
        if self._q:
            due = min(due, self._first_t + 2 * self._period)
        elif now < self._busy_until:
            due = min(due, now + 2 * self._period)
        self._sleep_until = due
        return max(0, int((due - now) * 1000)) + 1

    def _drain(self, enc: msgspec.msgpack.Encoder) -> None:
        """Apply what is queued and publish it (``_drain_lock`` held)."""
        q = self._q
        items: list[tuple[Any, ...]] = []
        with contextlib.suppress(IndexError):
            while len(items) < 1024:
                items.append(q.popleft())
        waiters = []
        taken = taken_bytes = 0
        for item in items:
            kind = item[0]
            if kind == "f":
                waiters.append(item[1])
            else:
                n = sum(map(len, map(_keys, item[1]))) if kind == "b" else len(item[2])
                taken += n
                taken_bytes += _item_bytes(item, n)
                self._apply(item)
                if self._tok_bytes > self.config.mirror_token_bytes:
                    self._trim_tokens()
        if taken or waiters:
            with self._qlock:
                self._queued -= taken
                self._queued_bytes -= taken_bytes
                self._flushes -= len(waiters)
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
