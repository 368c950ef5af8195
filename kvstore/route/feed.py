"""One subscription to one daemon's KV event stream, with gap detection, replay and resync.

A :class:`Feed` holds a SUB socket on the stream and a DEALER socket on its replay endpoint
(vLLM's protocol: a request is the first sequence number wanted, 8 bytes big-endian; the
answer is ``(seq, payload)`` pairs ending with ``END_SEQ``). It hands each batch's events, in
order, to its sink. Its rules:

* first contact: replay from 0 (the publisher answers with its history, or a snapshot of its
  state when the history is gone), then the live stream;
* a sequence number past the next one is a gap: replay from the first missing one;
* a new epoch in the topic (``"<tenant>@<epoch>"``) is a restarted daemon: forget the node and
  replay from 0; the publisher's stream starts with ``AllBlocksCleared`` and announces what the
  store kept;
* a replay that does not answer within ``replay_timeout_s`` is tried again on the next message
  (the node's state stays as it was, and is counted ``stale``).

Not thread-safe: one thread polls (the router's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvstore.wire.kvevents import END_SEQ, KVEventBatch, decoder, seq_bytes

Sink = Callable[[list[Any]], None]


@dataclass(slots=True)
class FeedStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    duplicates: int = 0


@dataclass(slots=True)
class Feed:
    name: str
    publish: str
    replay: str
    sink: Sink
    """Called with each batch's events (decoded :mod:`kvstore.wire.kvevents` structs)."""
    on_reset: Callable[[], None]
    """Called when the node must be forgotten (a restart) before its replay from 0."""
    ctx: zmq.Context[Any]
    username: str | None = None
    password: str | None = None
    replay_timeout_s: float = 5.0
    last_seq: int = -1
    epoch: bytes | None = None
    synced: bool = False
    """A replay from 0 (or the one after a restart) has been applied."""
    stats: FeedStats = field(default_factory=FeedStats)
    sub: Any = field(default=None, init=False, repr=False)
    dealer: Any = field(default=None, init=False, repr=False)
    _decode: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._decode = decoder()
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.publish)
        self._connect_dealer()

    def _socket(self, kind: int) -> Any:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if self.username is not None:
            s.setsockopt(zmq.PLAIN_USERNAME, self.username.encode())
            s.setsockopt(zmq.PLAIN_PASSWORD, (self.password or "").encode())
        return s

    def _connect_dealer(self) -> None:
        if self.dealer is not None:
            self.dealer.close(0)
        self.dealer = self._socket(zmq.DEALER)
        self.dealer.connect(self.replay)

    def close(self) -> None:
        self.sub.close(0)
        self.dealer.close(0)

    # ---- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        """First contact: everything the publisher still knows, before any live message."""
        self.catch_up(0)

    def handle(self) -> int:
        """Process every live message waiting on the SUB socket; returns how many."""
        n = 0
        while True:
            try:
                topic, seq_b, payload = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            self._live(topic, int.from_bytes(seq_b, "big"), payload)

    def _live(self, topic: bytes, seq: int, payload: bytes) -> None:
        epoch = topic.rpartition(b"@")[2]
        if self.epoch is not None and epoch != self.epoch:
            self.stats.restarts += 1
            self.epoch, self.last_seq, self.synced = epoch, -1, False
            self.on_reset()
            self.catch_up(0)
        self.epoch = epoch
        if not self.synced or seq > self.last_seq + 1:
            if self.synced:
                self.stats.gaps += 1
            self.catch_up(self.last_seq + 1)
        if seq <= self.last_seq:
            self.stats.duplicates += 1
            return
        if seq != self.last_seq + 1:
            return  # the replay did not close the gap: wait for the next message to try again
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch: KVEventBatch = self._decode.decode(payload)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.sink(batch.events)
        self.last_seq = seq

    def catch_up(self, start: int) -> bool:
        """Ask for batches from ``start`` on and apply them; False if the publisher did not
        answer in time (the DEALER is then replaced: a late answer must not be mistaken for
        the next one's)."""
        self.stats.replays += 1
        self.dealer.send_multipart((b"", seq_bytes(start)))
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        timeout = int(self.replay_timeout_s * 1000)
        while True:
            if not poller.poll(timeout):
                self.stats.replay_failures += 1
                self._connect_dealer()
                return False
            frames = self.dealer.recv_multipart()
            if len(frames) != 3:
                continue
            _, seq_b, payload = frames
            if seq_b == END_SEQ:
                break
            seq = int.from_bytes(seq_b, "big")
            # A snapshot (the history from ``start`` is gone) is one batch tagged with the last
            # seq sent, which is past last_seq too.
            if seq > self.last_seq:
                self._apply(seq, payload)
        self.synced = True
        return True
