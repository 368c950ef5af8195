"""Events and the access log: what the cache was asked for, what it served, what happened to blocks.

Records are JSON objects, one per line, in zstd-compressed files under one directory::

    events-20250101T120000-4242-0001.jsonl.zst     (start time, writer pid, sequence)

Every file starts with a ``header`` record and the ``namespace`` records it needs, so any file
can be read alone. Record types (``"type"``):

* ``request``: one load (``get_into``/``acquire``): ``t``, ``tenant``, ``ns``, ``op``,
  ``blocks``, ``block_tokens``, ``prompt_tokens``, ``hit_blocks``, ``hit_tokens``,
  ``hit_tokens_by_tier``, ``lookup_s``, ``load_s`` and ``h``: the 8-byte prefixes of the
  request's block hashes (base64 of little-endian u64s), so that a report can replay the requests
  through an unlimited cache and tell which misses a bigger or longer-lived cache would have hit.
  A lookup (what is cached? nothing moves) is a ``request`` with ``op: "lookup"``, without
  ``h`` (its prefix is its load's) and with zero timings: reports count it apart from loads.
* ``block``: a lifecycle event of one block, ``event`` in :data:`BLOCK_EVENTS`; ``h`` is the
  same 8-byte prefix in hex, ``tier``, ``size``, and ``reason`` for ``evicted``.
* ``namespace``: a namespace's descriptor, its tenant and TTL.
* ``usage``: how full each tier is (``tiers``: name -> ``used_bytes``, ``capacity_bytes``,
  ``blocks``), written now and then (the daemon: every maintenance pass), so that a report can
  draw tier fill over time.

Writing never slows the data path: records go into a bounded queue that a background thread
drains, formats and compresses (one zstd frame per batch, so a file that is still being written,
or was cut short by a crash, reads back up to its last whole batch). When the queue is full the
record is dropped and counted (``stats()["dropped"]``). Files rotate by size and age; the oldest
closed files go once the directory holds more than ``retain_bytes``.

:class:`EventLog` is the writer API (the store, the daemon and ``tools/replay`` use it);
:func:`kvstore.eventread.read_events` the reader; :class:`StoreEvents` the store's hooks (it also keeps the
per-tier byte counters that ``KVStore.stats()`` reports, logging or not).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import zstandard

from kvstore.clock import Clock, system_clock
from kvstore.errors import ConfigError, UsageError
from kvstore.keys import Namespace, _token_bytes
from kvstore.units import parse_duration, parse_size

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KEY_BYTES = 8
"""Bytes of a block hash kept in the log: collisions stay negligible (~3e-4 expected among 1e8
distinct blocks) at half the size, and replay traces' integer ids fit whole."""
BLOCK_EVENTS = ("stored", "promoted", "demoted", "evicted", "expired", "corrupt")
EVICT_REASONS = ("capacity", "deleted")
USAGE_COUNTERS = ("skipped_writes", "skipped_bytes")
"""Store counters a usage record carries (``KVStore.stats()``): admission's skipped writes to
the last tier and their bytes."""
EVENT_FILE = re.compile(r"^events-(\d{8}T\d{6})-(\d+)-(\d{4,})\.jsonl\.zst$")
_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """``[events]`` of the store's TOML file."""

    enabled: bool | None = None
    """None lets the host decide: off for an in-process store, on in the daemon."""
    dir: Path | None = None
    """Where the log files go; default ``<store root>/events``."""
    max_bytes: int = 64 * _MiB
    """A file is closed and a new one started past this size..."""
    max_age_s: float = 3600.0
    """...or past this age."""
    retain_bytes: int = 4096 * _MiB
    """The oldest closed files are deleted once the directory holds more (0 keeps everything)."""
    queue: int = 65_536
    """Records waiting for the writer; more are dropped and counted."""
    queue_bytes: int = 64 << 20
    """Bytes of records waiting for the writer (a request record is counted at 256 bytes and 64
    a block hash it names, up to ``max_blocks`` of them); more are dropped and counted."""
    hashes: bool = True
    """Keep block hashes in request records (what the achieved-vs-ideal analysis needs; about 8
    bytes per block)."""
    level: int = 3
    """zstd level of the log files."""
    publish: str | None = None
    """``tcp://HOST:PORT``: the daemon publishes block events there in vLLM's ``KVEventBatch``
    format (``kvstore/server/kvevents.py``, ``docs/routing.md``); None (default): no publisher."""
    replay: str | None = None
    """The replay (ROUTER) endpoint; default: ``publish``'s port + 1."""
    publish_queue: int = 65_536
    """Block hooks waiting for the publisher's thread; more are dropped, counted, and cost a resync."""
    replay_batches: int = 10_000
    """Published batches kept for replay requests; an older request is answered with a snapshot."""
    replay_bytes: int = 64 << 20
    """Bytes of published batches kept for replay, per stream (with token ids a batch can be
    megabytes: counted in batches alone, the buffer of a publisher with no subscriber grew
    without a useful bound); the oldest go first."""
    publish_queue_bytes: int = 64 << 20
    """Bytes of block hooks waiting for the publisher (about 64 bytes a block change, plus the
    token ids a put carries); more are dropped and counted like ``publish_queue``'s."""
    max_batch_bytes: int = 1 << 20
    """A published batch's msgpack at most (a larger one goes as several, a long
    ``BlockStored`` split where its chain continues): what one queued message can cost (a
    single block's event larger than this, from ``block_tokens`` over ~200,000, goes alone)."""
    subscriber_bytes: int = 64 << 20
    """Published batches queued for one slow subscriber: its ZeroMQ queue holds
    ``subscriber_bytes // max_batch_bytes`` batches (SNDHWM); past it that subscriber misses
    batches (it sees the gap in the sequence numbers and asks for a replay)."""
    replay_answer_bytes: int = 64 << 20
    """Replay answers queued for requesters that have not read them, all requesters of all
    streams together; past it the rest of an answer is dropped (counted; the requester asks
    again). One answer is always admitted when nothing else is queued (a snapshot can be larger)."""
    mirror_token_bytes: int = 256 << 20
    """Token ids the KV event publisher keeps for blocks already announced (``4 x block_tokens``
    bytes a block, and 41 more for their entry), so that the blocks' promotions, demotions,
    snapshots and replays carry them too. Past it the oldest blocks' token ids go (counted,
    logged once per burst), and those later events carry ``token_ids == []``, as those of a block
    recovered at a restart do; a put's own ``BlockStored`` always carries the tokens it came with."""
    max_connections: int = 256
    """Connections to the event ports (every stream's publish and replay ports together). A
    connection over it (or over ``max_connections_per_peer``) ends the oldest connection not yet
    proven (open for less than ZeroMQ's 5 s handshake deadline; those that sent no ZeroMQ
    greeting first), else is ended itself. While the connections open, being ended or just
    accepted are a quarter of it (at least 16) over it (a flood faster than the daemon ends
    them), or while the daemon holds the last eighth of its ``RLIMIT_NOFILE`` (whoever holds
    them), the ports accept nothing (their SYNs are dropped; a client retries). The daemon keeps
    this many descriptors, that slack and each port's backlog of 16 aside from its data and HTTP
    planes'."""
    max_connections_per_peer: int = 64
    """Connections to the event ports from one address (a subscriber holds two a stream)."""
    publish_period_s: float = 0.25
    """While blocks change, the publisher sends what changed at most this long ago (sooner when
    many changes wait, at once after a lull): a router's view lags by up to this much; shorter
    costs the daemon more CPU a block event (a publication's cost is mostly fixed)."""

    def __post_init__(self) -> None:
        if self.dir is not None:
            object.__setattr__(self, "dir", Path(self.dir))
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise ConfigError(f"[events] enabled must be true or false, got {self.enabled!r}")
        if self.max_bytes <= 0 or self.max_age_s <= 0:
            raise ConfigError("[events] max_bytes and max_age must be positive (e.g. '64MiB', '1h')")
        if self.retain_bytes < 0:
            raise ConfigError("[events] retain_bytes cannot be negative (0 keeps every file)")
        if self.queue <= 0:
            raise ConfigError(f"[events] queue must be a positive number of records, got {self.queue}")
        if not 1 <= self.level <= 19:
            raise ConfigError(f"[events] level must be a zstd level in 1..19, got {self.level}")
        for name in ("publish", "replay"):
            url = getattr(self, name)
            if url is not None and not re.match(r"^tcp://[^:/]+:\d+$", str(url)):
                raise ConfigError(f"[events] {name} must be 'tcp://HOST:PORT' (e.g. 'tcp://127.0.0.1:5557'), got {url!r}")
        for name in ("publish_queue", "replay_batches", "max_connections", "max_connections_per_peer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"[events] {name} must be a positive count, got {v!r}")
        for name in ("queue_bytes", "replay_bytes", "publish_queue_bytes", "max_batch_bytes", "subscriber_bytes",
                     "replay_answer_bytes", "mirror_token_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"[events] {name} must be a positive size (e.g. '64MiB'), got {v!r}")
        if self.max_batch_bytes < 4096:
            raise ConfigError(f"[events] max_batch_bytes must be at least 4KiB (one block's event), got {self.max_batch_bytes}")
        if self.subscriber_bytes < self.max_batch_bytes:
            raise ConfigError(f"[events] subscriber_bytes ({self.subscriber_bytes}) must hold at least one batch "
                              f"of max_batch_bytes ({self.max_batch_bytes})")
        if not 0 < self.publish_period_s <= 10:
            raise ConfigError(f"[events] publish_period must be in (0, 10s] (e.g. '0.25s'), got {self.publish_period_s}")

    def directory(self, root: Path) -> Path:
        return self.dir if self.dir is not None else Path(root) / "events"


_KEYS: dict[str, tuple[str, Any]] = {
    "enabled": ("enabled", bool),
    "dir": ("dir", Path),
    "max_bytes": ("max_bytes", parse_size),
    "max_age": ("max_age_s", parse_duration),
    "max_age_s": ("max_age_s", parse_duration),
    "retain_bytes": ("retain_bytes", parse_size),
    "queue": ("queue", int),
    "queue_bytes": ("queue_bytes", parse_size),
    "hashes": ("hashes", bool),
    "level": ("level", int),
    "publish": ("publish", str),
    "replay": ("replay", str),
    "publish_queue": ("publish_queue", int),
    "replay_batches": ("replay_batches", int),
    "replay_bytes": ("replay_bytes", parse_size),
    "publish_queue_bytes": ("publish_queue_bytes", parse_size),
    "max_batch_bytes": ("max_batch_bytes", parse_size),
    "subscriber_bytes": ("subscriber_bytes", parse_size),
    "replay_answer_bytes": ("replay_answer_bytes", parse_size),
    "mirror_token_bytes": ("mirror_token_bytes", parse_size),
    "max_connections": ("max_connections", int),
    "max_connections_per_peer": ("max_connections_per_peer", int),
    "publish_period": ("publish_period_s", parse_duration),
}


def events_config(section: Mapping[str, Any], env: Mapping[str, str] | None = None) -> EventsConfig:
    """An :class:`EventsConfig` from the ``[events]`` table and ``KVSTORE_EVENTS_<KEY>``
    environment overrides (e.g. ``KVSTORE_EVENTS_ENABLED=true``, ``KVSTORE_EVENTS_DIR=...``)."""
    merged = dict(section)
    for k, e in (env or {}).items():
        if k.startswith("KVSTORE_EVENTS_"):
            merged[k[len("KVSTORE_EVENTS_"):].lower()] = e
    kwargs: dict[str, Any] = {}
    for k, v in merged.items():
        if k not in _KEYS:
            raise ConfigError(f"[events]: unknown key {k!r}; known: {', '.join(_KEYS)}")
        name, conv = _KEYS[k]
        where = f"[events].{k}"
        if conv is bool:
            if isinstance(v, str):
                if v.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ConfigError(f"{where}: expected true or false, got {v!r}")
                v = v.lower() in ("1", "true", "yes")
            kwargs[name] = v
        elif conv in (parse_size, parse_duration):
            kwargs[name] = conv(v, where)
        else:
            try:
                kwargs[name] = conv(v)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{where}: {e}") from e
    return EventsConfig(**kwargs)


def _record_bytes(item: tuple[Any, ...]) -> int:
    """What a queued event log record is counted at: 256 bytes, and 64 a block hash of a
    request record (its tuple's slot and the hash it keeps alive)."""
    if item[0] == "request":
        return 256 + 64 * len(item[3])
    return 256 * len(item[2]) if item[0] in ("blocks", "placed") else 256


def _block_line(t: float, event: str, key: bytes | int, tier: str, size: int, reason: str, depth: int | None) -> str:
    """A block record's line, as ``json.dumps(rec, separators=(",", ":"))`` writes it (keys in
    this order; ``reason`` and ``depth`` only when set), without building the dict: the writer
    formats a 2,048-block put's records while the store's threads want the interpreter."""
    line = (f'{{"type":"block","t":{float.__repr__(float(t))},"event":{_js(event)},"h":"{short_key(key).hex()}",'
            f'"tier":{_js(tier)},"size":{int(size)}')
    if reason:
        line += f',"reason":{_js(reason)}'
    if depth is not None:
        line += f',"depth":{int(depth)}'
    return line + "}\n"


def _placed_lines(t: float, keys: Sequence[bytes | int], k: int, tier: str, prior_masks: Sequence[int], size: int,
                  depths: Sequence[int | None]) -> Iterator[str]:
    """The block lines of an :meth:`EventLog.placed` record."""
    low = (1 << (k + 1)) - 1
    for key, prior, depth in zip(keys, prior_masks, depths, strict=True):
        yield _block_line(t, "stored" if not prior else "promoted" if not prior & low else "demoted",
                          key, tier, size, "", depth)


_js = json.encoder.encode_basestring  # a str as a JSON string (the C encoder)


# ---- keys -----------------------------------------------------------------------------------------


def short_key(h: bytes | int) -> bytes:
    """The logged form of a block hash (its first 8 bytes) or of a trace's integer block id."""
    if isinstance(h, int | np.integer):
        return int(h).to_bytes(KEY_BYTES, "little", signed=False)
    return bytes(h[:KEY_BYTES])


def key_int(h: bytes | int) -> int:
    """A logged key as an integer: how readers compare them (block events and requests alike)."""
    return int.from_bytes(short_key(h), "little")


def encode_hashes(hashes: Sequence[bytes | int]) -> str:
    return base64.b64encode(b"".join(short_key(h) for h in hashes)).decode()


def decode_hashes(text: str) -> np.ndarray:
    """The ``h`` field of a request record as a ``uint64`` array (the keys' :func:`key_int`)."""
    return np.frombuffer(base64.b64decode(text), dtype="<u8")


def decode_key(text: str) -> int:
    """The ``h`` field of a block record as an integer."""
    return int.from_bytes(bytes.fromhex(text), "little")


# ---- the writer -----------------------------------------------------------------------------------

_FLUSH = "flush"
_STOP = "stop"
COALESCE_S = 0.05
"""The writer waits this long after a record wakes it (or until a flush or close) before it
formats what has come: the work of formatting a put's records then falls after the request
that made them, not in its commit (the daemon's threads share one interpreter)."""


class EventLog:
    """Writes event records to rotated, zstd-compressed JSONL files from a background thread.

    Thread-safe. ``request``, ``block`` and ``namespace`` only enqueue (never block, never
    raise on I/O); :meth:`flush` waits until everything enqueued so far is written;
    :meth:`close` flushes and stops the thread. ``t`` defaults to the injected clock.

    ``tools/replay`` and other simulators write the same format: open one on a directory, call
    :meth:`namespace` once per namespace, then :meth:`request` per simulated request (with its
    own simulated ``t``) and :meth:`block` per lifecycle event, and :meth:`close`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: EventsConfig | None = None,
        *,
        clock: Clock = system_clock,
        source: str = "store",
        tiers: Sequence[str] = (),
    ) -> None:
        self.config = config or EventsConfig(enabled=True)
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create the events directory {self.dir}: {e.strerror}; set [events] dir "
                "to a writable directory, or enabled = false"
            ) from e
        self._clock = clock
        self._header = {"type": "header", "v": FORMAT_VERSION, "source": source,
                        "host": socket.gethostname(), "pid": os.getpid(), "tiers": list(tiers)}
        self._q: queue.Queue[tuple[Any, ...]] = queue.Queue(self.config.queue)
        self._urgent = threading.Event()
        """Set by :meth:`flush` and :meth:`close`: the writer stops coalescing (:data:`COALESCE_S`)."""
        self._namespaces: dict[str, dict[str, Any]] = {}  # ns hex -> record: re-sent in each file
        self._lock = threading.Lock()
        self._counts = Counter[str]()
        self._queued_bytes = 0
        """What the queued records are counted at (:func:`_record_bytes`), under ``queue_bytes``."""
        self._file: Any = None
        self._path: Path | None = None
        self._opened = 0.0
        self._size = 0
        self._seq = 0
        self._described: set[str] = set()  # namespaces the current file describes
        self._cctx = zstandard.ZstdCompressor(level=self.config.level)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # ---- records (any thread) ----------------------------------------------------------------

    def request(
        self,
        *,
        ns: bytes | str,
        hashes: Sequence[bytes | int],
        hit_blocks: int,
        block_tokens: int,
        hit_tiers: Mapping[str, int] | None = None,
        tenant: str = "",
        op: str = "get",
        lookup_s: float = 0.0,
        load_s: float = 0.0,
        prompt_tokens: int | None = None,
        t: float | None = None,
    ) -> None:
        """One request: ``hashes`` it asked for (whole prefix chain), ``hit_blocks`` leading
        blocks served, ``hit_tiers`` how many of them each tier served (default: all from an
        unnamed tier), ``prompt_tokens`` (default ``len(hashes) * block_tokens``)."""
        self._put(("request", self._t(t), ns, tuple(hashes), hit_blocks, block_tokens,
                   dict(hit_tiers) if hit_tiers is not None else None, tenant, op, lookup_s,
                   load_s, prompt_tokens))

    def block(
        self,
        event: str,
        key: bytes | int,
        *,
        tier: str = "",
        size: int = 0,
        reason: str = "",
        depth: int | None = None,
        t: float | None = None,
    ) -> None:
        """A lifecycle event of one block (``event`` in :data:`BLOCK_EVENTS`)."""
        if event not in BLOCK_EVENTS:
            raise ValueError(f"event {event!r} is not one of {', '.join(BLOCK_EVENTS)}")
        self._put(("block", self._t(t), event, key, tier, size, reason, depth))

    def blocks(self, events: Sequence[tuple[str, bytes | int, str, int, str, int | None]], *,
               t: float | None = None) -> None:
        """Lifecycle events of many blocks at one time, ``(event, key, tier, size, reason,
        depth)`` each, queued as one record (a put of 2,048 blocks: one queue hand-off to the
        writer, not 2,048, each of which woke it)."""
        if not events:
            return
        for e in events:
            if e[0] not in BLOCK_EVENTS:
                raise ValueError(f"event {e[0]!r} is not one of {', '.join(BLOCK_EVENTS)}")
        self._put(("blocks", self._t(t), list(events)))

    def placed(self, keys: Sequence[bytes | int], k: int, tier: str, prior_masks: Sequence[int], size: int,
               depths: Sequence[int | None], *, t: float | None = None) -> None:
        """The events of copies of ``keys`` written into tier ``k`` (named ``tier``), ``size``
        bytes each, at one time: *stored* where ``prior_masks[i]`` (the tiers that held
        ``keys[i]`` before) is 0, *promoted* where no tier as fast held it, else *demoted*;
        ``depths[i]`` its depth. One record, as :meth:`blocks`, whose per-block events the
        writer spells out: the store calls this under its lock, in a put's commit."""
        if not keys:
            return
        if not len(keys) == len(prior_masks) == len(depths):
            raise ValueError(f"{len(keys)} keys, {len(prior_masks)} prior masks and {len(depths)} depths")
        self._put(("placed", self._t(t), tuple(keys), k, tier, tuple(prior_masks), size, tuple(depths)))

    def namespace(
        self,
        ns: Namespace | Mapping[str, Any],
        *,
        tenant: str = "",
        ttl_s: float | None = None,
        digest: bytes | str | None = None,
        t: float | None = None,
    ) -> None:
        """Describe a namespace (a :class:`Namespace`, or a descriptor dict with ``digest``)."""
        if isinstance(ns, Namespace):
            desc, digest = ns.to_dict(), ns.root
        else:
            desc = dict(ns)
            if digest is None:
                raise ValueError("a namespace given as a dict needs its digest")
        key = digest.hex() if isinstance(digest, bytes) else str(digest)
        rec = {"type": "namespace", "t": self._t(t), "ns": key, "tenant": tenant, "ttl_s": ttl_s,
               "descriptor": desc}
        with self._lock:
            self._namespaces[key] = rec
        self._put(("raw", rec))

    def usage(self, tiers: Iterable[Mapping[str, Any]], *, t: float | None = None,
              store: Mapping[str, Any] | None = None) -> None:
        """How full each tier is now: rows with ``name``, ``used_bytes``, ``capacity_bytes`` and
        ``blocks`` (what ``KVStore.stats()["tiers"]`` lists). ``store``: the store's stats, whose
        admission counters (:data:`USAGE_COUNTERS`, since the store opened, and the admission
        rule's name) the record carries too."""
        rec: dict[str, Any] = {"type": "usage", "t": self._t(t), "tiers": {
            str(r["name"]): {k: int(r.get(k) or 0) for k in ("used_bytes", "capacity_bytes", "blocks")} for r in tiers}}
        if store is not None:
            adm = store.get("admission")
            rec["store"] = {**{k: int(store.get(k) or 0) for k in USAGE_COUNTERS},
                            "admission": str(adm.get("admission", "")) if isinstance(adm, Mapping) else ""}
        self._put(("raw", rec))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every record enqueued before this call is written (False on timeout)."""
        if self._closed or not self._thread.is_alive():
            return False
        done = threading.Event()
        self._q.put((_FLUSH, done))  # blocking put: a flush marker is never dropped
        self._urgent.set()
        return done.wait(timeout)

    def close(self) -> None:
        """Write what is queued, close the current file and stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._q.put((_STOP,))
            self._urgent.set()
            self._thread.join(30.0)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self._counts)
        return {
            "enabled": True,
            "dir": str(self.dir),
            "written": c.get("written", 0),
            "dropped": c.get("dropped", 0),
            "errors": c.get("errors", 0),
            "files": c.get("files", 0),
            "bytes": c.get("bytes", 0),
            "queued": self._q.qsize(),
            "queued_bytes": self._queued_bytes,
        }

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _t(self, t: float | None) -> float:
        return self._clock() if t is None else float(t)

    def _put(self, item: tuple[Any, ...]) -> None:
        if self._closed:
            return
        size = _record_bytes(item)
        n = len(item[2]) if item[0] in ("blocks", "placed") else 1
        with self._lock:
            if self._queued_bytes + size > self.config.queue_bytes:
                self._counts["dropped"] += n
                return
            self._queued_bytes += size
        try:
            self._q.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._queued_bytes -= size
                self._counts["dropped"] += n

    # ---- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            items = [self._q.get()]
            if items[0][0] not in (_FLUSH, _STOP):
                self._urgent.wait(COALESCE_S)  # let the request that logged it finish first
            self._urgent.clear()  # (a flush or close from now on is drained below, or wakes the next get)
            with contextlib.suppress(queue.Empty):
                while len(items) < 4096:
                    items.append(self._q.get_nowait())
            records: list[tuple[Any, ...]] = []
            waiters: list[threading.Event] = []
            for item in items:
                if item[0] == _FLUSH:
                    waiters.append(item[1])
                elif item[0] == _STOP:
                    stop = True
                else:
                    records.append(item)
            if records:
                self._write(records)
                taken = sum(map(_record_bytes, records))
                with self._lock:
                    self._queued_bytes -= taken
            for w in waiters:
                w.set()
        self._close_file()

    def _format(self, item: tuple[Any, ...]) -> bytes:
        kind = item[0]
        if kind == "raw":
            rec = item[1]
            if rec["type"] == "namespace":
                if rec["ns"] in self._described:
                    return b""  # the file's preamble has it already
                self._described.add(rec["ns"])
        elif kind == "request":
            _, t, ns, hashes, hit, bt, tiers, tenant, op, lookup_s, load_s, prompt = item
            if tiers is None:
                tiers = {"": hit} if hit else {}
            rec = {
                "type": "request", "t": t, "tenant": tenant,
                "ns": ns.hex() if isinstance(ns, bytes) else str(ns), "op": op,
                "blocks": len(hashes), "block_tokens": bt,
                "prompt_tokens": prompt if prompt is not None else len(hashes) * bt,
                "hit_blocks": hit, "hit_tokens": hit * bt,
                "hit_tokens_by_tier": {k: v * bt for k, v in tiers.items() if v},
                "lookup_s": round(lookup_s, 7), "load_s": round(load_s, 7),
            }
            if self.config.hashes and op != "lookup":  # a lookup's prefix is its load's
                rec["h"] = encode_hashes(hashes)
        elif kind == "blocks":
            _, t, events = item
            return "".join(_block_line(t, *e) for e in events).encode()
        elif kind == "placed":
            return "".join(_placed_lines(*item[1:])).encode()
        else:
            return _block_line(*item[1:]).encode()
        return json.dumps(rec, separators=(",", ":")).encode() + b"\n"

    def _write(self, records: list[tuple[Any, ...]]) -> None:
        try:
            if self._file is None or self._due():
                self._rotate()
            lines = [line for r in records if (line := self._format(r))]
            frame = self._cctx.compress(b"".join(lines))
            self._file.write(frame)
            self._file.flush()  # to the OS: a reader (kvreport on a live daemon) sees it now
            self._size += len(frame)
            with self._lock:
                self._counts["written"] += sum(line.count(b"\n") for line in lines)  # (a "blocks" item: many)
                self._counts["bytes"] += len(frame)
        except OSError as e:
            # The log must never take the store down: count, say so once per file, go on.
            with self._lock:
                self._counts["errors"] += 1
                first = self._counts["errors"] == 1
            if first:
                log.warning("events: cannot write to %s (%s); records are dropped", self.dir, e)
            self._close_file()

    def _due(self) -> bool:
        c = self.config
        return self._size >= c.max_bytes or self._clock() - self._opened >= c.max_age_s

    def _rotate(self) -> None:
        self._close_file()
        now = self._clock()
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%S")
        self._seq += 1
        path = self.dir / f"events-{stamp}-{os.getpid()}-{self._seq:04d}.jsonl.zst"
        self._file = open(path, "ab")  # noqa: SIM115 (closed by _close_file)
        self._path, self._opened, self._size = path, now, 0
        with self._lock:
            self._counts["files"] += 1
            first = [dict(self._header, t=now), *self._namespaces.values()]
        self._described = {r["ns"] for r in first[1:]}
        frame = self._cctx.compress(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in first))
        self._file.write(frame)
        self._size += len(frame)
        self._retain()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _retain(self) -> None:
        keep = self.config.retain_bytes
        if not keep:
            return
        files = event_files(self.dir)
        sizes = {p: p.stat().st_size for p in files if p.exists()}
        total = sum(sizes.values())
        for p in files:  # oldest first; never the file being written
            if total <= keep or p == self._path:
                break
            with contextlib.suppress(OSError):
                p.unlink()
                total -= sizes.get(p, 0)


# ---- the files -----------------------------------------------------------------------------------


def event_files(path: str | os.PathLike[str]) -> list[Path]:
    """The event files under ``path`` (a directory, or one file), oldest first."""
    p = Path(path)
    if p.is_file():
        return [p]
    found = [f for f in p.glob("events-*.jsonl.zst") if EVENT_FILE.match(f.name)]

    def order(f: Path) -> tuple[str, int, int]:
        m = EVENT_FILE.match(f.name)
        assert m is not None
        return m.group(1), int(m.group(3)), int(m.group(2))

    return sorted(found, key=order)


# ---- the store's hooks ----------------------------------------------------------------------------


class StoreEvents:
    """What ``KVStore`` calls at each event; logs when ``log`` is set and always counts the
    bytes each tier took in and served (``traffic``). Cheap: the store calls it under its lock."""

    def __init__(self, log: EventLog | None, tier_names: Sequence[str], policy: str) -> None:
        self.log = log
        self._tiers = list(tier_names)
        self._policy = policy
        self._lock = threading.Lock()
        self._in = [0] * len(self._tiers)
        self._out = [0] * len(self._tiers)
        self._tenants: dict[bytes, str] = {}
        self._known: set[bytes] = set()
        self.sinks: list[BlockSink] = []
        """Also told of every change of a block's place (the daemon's KV event publisher), one
        call per :meth:`batch` (a put, a load, a maintenance pass), never one per block."""
        self._changes: list[BlockRun] | None = None
        self._run: BlockRun | None = None  # the last of ``_changes``
        self._depth = 0
        self._tokens: PutTokens | None = None
        self._chain: PutChain | None = None

    @classmethod
    def open(cls, config: EventsConfig, root: Path, clock: Clock, tier_names: Sequence[str],
             policy: str, *, source: str = "store") -> StoreEvents:
        log_ = None
        if config.enabled:
            log_ = EventLog(config.directory(root), config, clock=clock, source=source, tiers=tier_names)
        return cls(log_, tier_names, policy)

    # ---- namespaces and tenants ------------------------------------------------------------

    def set_tenant(self, digest: bytes, tenant: str) -> None:
        """Requests of namespace ``digest`` belong to ``tenant`` (the daemon says so)."""
        self._tenants[bytes(digest)] = tenant

    def namespace(self, ns: Namespace, ttl_s: float | None) -> None:
        self._known.add(bytes(ns.root))
        if self.log is not None:
            self.log.namespace(ns, tenant=self._tenants.get(bytes(ns.root), ""), ttl_s=ttl_s)

    # ---- requests -------------------------------------------------------------------------

    def request(self, ns: Namespace, hashes: Sequence[bytes], op: str = "get") -> RequestTrace:
        """Start timing one load; the store calls ``matched()`` and ``done(served)`` on it."""
        if self.log is not None and bytes(ns.root) not in self._known:
            self.namespace(ns, None)  # loaded from namespaces.json, not registered this run
        return RequestTrace(self, ns, hashes, op)

    def lookup(self, ns: Namespace, hashes: Sequence[bytes], hit_tiers: Sequence[str]) -> None:
        """A lookup (counted apart from loads): an ``op: "lookup"`` request record, without
        hashes or timings; ``hit_tiers``: the fastest tier of each cached leading block."""
        if self.log is not None:
            self.log.request(ns=ns.root, hashes=hashes, hit_blocks=len(hit_tiers), block_tokens=ns.block_tokens,
                             hit_tiers=Counter(hit_tiers), tenant=self._tenants.get(bytes(ns.root), ""),
                             op="lookup")

    def _request_done(self, trace: RequestTrace, served: Sequence[int], t_end: float) -> None:
        ns = trace.ns
        by_tier = Counter(served)
        bb = ns.block_bytes
        with self._lock:
            for k, n in by_tier.items():
                self._out[k] += n * bb
        if self.log is not None:
            self.log.request(
                ns=ns.root, hashes=trace.hashes, hit_blocks=len(served), block_tokens=ns.block_tokens,
                hit_tiers={self._tiers[k]: n for k, n in by_tier.items()},
                tenant=self._tenants.get(bytes(ns.root), ""), op=trace.op,
                lookup_s=trace.t1 - trace.t0, load_s=t_end - trace.t1,
            )

    # ---- blocks ---------------------------------------------------------------------------

    def batch(self, tokens: PutTokens | None = None, ns: Namespace | None = None,
              hashes: Sequence[bytes] | None = None) -> _Batch:
        """``with events.batch():`` around a store operation (under the store's lock): the
        sinks hear of every block it changed in one call as it ends. Nested batches join the
        outermost. ``tokens``: the token ids of a put's blocks; ``ns`` and ``hashes``: the
        chain a put stores (validated), handed to the sinks with its new copies
        (:class:`PutChain`), so that a sink needs no record of its own to know their parents."""
        return _Batch(self, tokens, ns, hashes)

    def _change(self, kind: str, key: bytes, k: int) -> None:
        # One change of a block: into the batch's last run when it is of the same kind and
        # tier (one list append), else a new run; outside a batch (a path no batch wraps), a
        # batch of one.
        runs = self._changes
        if runs is None:
            for sink in self.sinks:
                sink.blocks([(kind, k, [key])], None, None)
            return
        run = self._run = (kind, k, [key])
        runs.append(run)

    def placed(self, key: bytes, k: int, prior_mask: int, size: int, depth: int | None = None) -> None:
        """A copy of ``key`` was written into tier ``k``; ``prior_mask``: tiers holding it before.

        No copy before: *stored*; none as fast: *promoted*; a faster one exists: *demoted*
        (a write down a tier: demotion under pressure, a durable copy, persist on close).
        """
        self.placed_many((key,), k, (prior_mask,), size, (depth,))

    def _changes_of(self, kind: str, keys: Sequence[bytes], k: int) -> None:
        """Changes of one ``kind`` to ``keys`` on tier (or mask) ``k``, for the sinks."""
        if not self.sinks:
            return
        for key in keys:
            run = self._run
            if run is not None and run[1] == k and run[0] == kind:
                run[2].append(key)
            else:
                self._change(kind, key, k)

    def placed_many(self, keys: Sequence[bytes], k: int, prior_masks: Sequence[int], size: int,
                    depths: Sequence[int | None]) -> None:
        """:meth:`placed` of each key (``size`` bytes each) in order, in one call (one event
        log record for all of them)."""
        with self._lock:
            self._in[k] += size * len(keys)
        self._changes_of("p", keys, k)
        if self.log is not None:
            self.log.placed(keys, k, self._tiers[k], prior_masks, size, depths)

    def dropped_many(self, keys: Sequence[bytes], mask: int, reason: str) -> None:
        """:meth:`dropped` of each key in order, in one call (one event log record for all)."""
        self._changes_of("d", keys, mask)
        if self.log is not None and keys:
            tier = self._tiers[(mask & -mask).bit_length() - 1] if mask else ""
            if reason == "expired":
                self.log.blocks([("expired", key, tier, 0, "", None) for key in keys])
            else:
                why = f"{reason}:{self._policy}" if reason == "capacity" else reason
                self.log.blocks([("evicted", key, tier, 0, why, None) for key in keys])

    def dropped(self, key: bytes, mask: int, reason: str) -> None:
        """``key`` left the store: ``reason`` "capacity" (evicted by policy), "expired" or
        "deleted" (an operator's evict)."""
        self.dropped_many((key,), mask, reason)

    def copy_dropped(self, key: bytes, k: int) -> None:
        """Tier ``k`` no longer holds ``key`` (it moved down, or the copy was bad); other tiers may."""
        self._changes_of("c", (key,), k)

    def usage(self, tiers: Iterable[Mapping[str, Any]], *, store: Mapping[str, Any] | None = None) -> None:
        """Log how full each tier is (``KVStore.stats()["tiers"]``) and, given the store's
        stats, its admission counters; nothing when not logging."""
        if self.log is not None:
            self.log.usage(tiers, store=store)

    def bad_copy(self, key: bytes, k: int, corrupt: bool) -> None:
        if self.log is not None:
            self.log.block("corrupt", key, tier=self._tiers[k], reason="checksum" if corrupt else "unreadable")

    # ---- reporting ------------------------------------------------------------------------

    def traffic(self, tier: str) -> dict[str, int]:
        """Bytes written into and served from ``tier`` since the store opened."""
        k = self._tiers.index(tier)
        with self._lock:
            return {"bytes_in": self._in[k], "bytes_out": self._out[k]}

    def stats(self) -> dict[str, Any]:
        return self.log.stats() if self.log is not None else {"enabled": False}

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


BlockChange = tuple[str, bytes, int]
"""``("p", key, k)``: tier ``k`` took a copy of ``key``; ``("c", key, k)``: tier ``k`` lost
its copy (others may hold one); ``("d", key, mask)``: ``key`` left the store (``mask``: the tiers
that held it)."""

BlockRun = tuple[str, int, list[bytes]]
"""Consecutive changes of one kind and tier: ``(kind, k, keys)`` stands for ``(kind, key, k)``
for each of ``keys`` in order (what the sinks are given: one list append a block under the
store's lock, no tuple a block)."""


def block_changes(runs: Iterable[BlockRun]) -> list[BlockChange]:
    """The changes that ``runs`` stand for, one a block, in order."""
    return [(kind, key, k) for kind, k, keys in runs for key in keys]


@dataclass(frozen=True, slots=True)
class PutTokens:
    """The token ids of a put's blocks: ``tokens[i * block_tokens:(i + 1) * block_tokens]``
    are those of the block stored under ``keys[i]`` (the keys of ``hashes[start:]``)."""

    keys: Sequence[bytes]
    tokens: np.ndarray
    block_tokens: int


def put_tokens_of(keys: Sequence[bytes], tokens: Any, block_tokens: int) -> PutTokens:
    """A put's :class:`PutTokens`; UsageError unless ``tokens`` holds ``block_tokens`` ids for
    each of ``keys`` (a list, numpy array or torch tensor of integers)."""
    arr = _token_bytes(tokens)
    if arr.size != len(keys) * block_tokens:
        raise UsageError(
            f"tokens holds {arr.size} token ids, but the put stores {len(keys)} blocks of {block_tokens} "
            f"tokens: pass the token ids of the blocks put (hashes[start:]), {len(keys) * block_tokens} of them"
        )
    return PutTokens(tuple(bytes(k) for k in keys), arr, block_tokens)


class PutChain(NamedTuple):
    """The chain a put stored, handed to the sinks with the changes of its new copies: its
    namespace and every hash from the chain's first block (the store's keys, as validated),
    so a new copy of ``hashes[i]`` has ``hashes[i - 1]`` as its parent."""

    ns: Namespace
    hashes: tuple[bytes, ...]


class BlockSink(Protocol):
    """A listener on block placement (:attr:`StoreEvents.sinks`); called under the store's
    lock, so it must only enqueue."""

    def blocks(self, runs: list[BlockRun], tokens: PutTokens | None, chain: PutChain | None) -> None:
        """The changes of one store operation, in order, as runs (:data:`BlockRun`;
        :func:`block_changes` spells them out); ``tokens``: a put's token ids (None when its
        caller sent none); ``chain``: the chain a put stored, with its new copies (None for
        other operations). Every sink is given the same lists: keep them, never change them."""
        ...


class _Batch:
    __slots__ = ("events", "tokens", "ns", "hashes")

    def __init__(self, events: StoreEvents, tokens: PutTokens | None, ns: Namespace | None,
                 hashes: Sequence[bytes] | None) -> None:
        self.events, self.tokens, self.ns, self.hashes = events, tokens, ns, hashes

    def __enter__(self) -> None:
        ev = self.events
        if not ev._depth:
            ev._run = None
            if ev.sinks:
                ev._changes = []
                ev._tokens = self.tokens
                # (a copy: the caller may reuse its list once the put returns)
                ev._chain = None if self.ns is None or self.hashes is None else PutChain(self.ns, tuple(self.hashes))
            else:
                ev._changes = None
        ev._depth += 1

    def __exit__(self, *exc: object) -> None:
        ev = self.events
        ev._depth -= 1
        if ev._depth:
            return
        changes, tokens, chain = ev._changes, ev._tokens, ev._chain
        ev._changes = ev._tokens = ev._chain = ev._run = None
        if changes:
            for sink in ev.sinks:
                sink.blocks(changes, tokens, chain)


class RequestTrace:
    """Times one load: start, ``matched()`` after the prefix match, ``done(served)`` at the end."""

    __slots__ = ("events", "ns", "hashes", "op", "t0", "t1")

    def __init__(self, events: StoreEvents, ns: Namespace, hashes: Sequence[bytes], op: str) -> None:
        self.events, self.ns, self.hashes, self.op = events, ns, hashes, op
        self.t0 = self.t1 = time.perf_counter()

    def matched(self) -> None:
        self.t1 = time.perf_counter()

    def done(self, served: Sequence[int]) -> None:
        """``served[i]``: the tier that served leading block ``i``."""
        self.events._request_done(self, served, time.perf_counter())
