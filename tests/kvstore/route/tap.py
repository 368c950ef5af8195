"""Test helpers: daemons that publish KV events, and a raw subscriber of their streams."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from engine.reference.demo import fake_prefill
from kvstore.clock import Clock, system_clock
from kvstore.config import StoreConfig, TierSpec
from kvstore.events import EventsConfig
from kvstore.keys import Namespace, hash_blocks
from kvstore.server.config import ServerConfig, TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from kvstore.wire.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decoder,
    seq_bytes,
)
from tests.conftest import small_tiers


def daemon_config(root: Path, *, tiers: tuple[TierSpec, ...] | None = None, **events: Any) -> StoreConfig:
    ev = EventsConfig(**{"publish": "tcp://127.0.0.1:0", **events})
    return StoreConfig(root=root, tiers=tiers or small_tiers(), events=ev)


@contextmanager
def daemons(tmp: Path) -> Iterator[Callable[..., ThreadedDaemon]]:
    """``start(name, tenants=(), tiers=None, clock=..., ucx=False, **events)``: publishing daemons, each
    on ``tmp/name``, stopped at the end (one already stopped is skipped)."""
    started: list[ThreadedDaemon] = []

    def start(name: str, tenants: tuple[TenantSpec, ...] = (), tiers: tuple[TierSpec, ...] | None = None,
              clock: Clock = system_clock, ucx: bool = False, **events: Any) -> ThreadedDaemon:
        cfg = ServerConfig(http_port=0, data_port=0, ucx_port=0, tenants=tenants, ucx=ucx)
        d = ThreadedDaemon(daemon_config(tmp / name, tiers=tiers, **events), cfg, clock=clock)
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            if d._thread.is_alive():
                d.stop()


class Tap:
    """Reads a stream through its replay socket only (deterministic: the publisher publishes
    every hook that ran before a replay request, then answers it)."""

    def __init__(self, replay: str, username: str | None = None, password: str | None = None,
                 timeout_s: float = 60.0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if username is not None:
            self.sock.setsockopt(zmq.PLAIN_USERNAME, username.encode())
            self.sock.setsockopt(zmq.PLAIN_PASSWORD, (password or "").encode())
        self.sock.connect(replay)
        self.timeout_ms = int(timeout_s * 1000)
        self.dec = decoder()

    def replay(self, start: int = 0) -> list[tuple[int, KVEventBatch]] | None:
        """Batches from ``start`` on, or None when the publisher does not answer."""
        self.sock.send_multipart((b"", seq_bytes(start)))
        out = []
        while True:
            if not self.sock.poll(self.timeout_ms):
                return None
            _, seq_b, payload = self.sock.recv_multipart()
            if seq_b == END_SEQ:
                return out
            out.append((int.from_bytes(seq_b, "big"), self.dec.decode(payload)))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def events_of(batches: list[tuple[int, KVEventBatch]]) -> list[Any]:
    return [e for _, b in batches for e in b.events]


def state(events: list[Any]) -> dict[bytes, set[str]]:
    """What a subscriber that applies ``events`` in order believes: hash -> media."""
    out: dict[bytes, set[str]] = {}
    for e in events:
        if isinstance(e, AllBlocksCleared):
            out.clear()
        elif isinstance(e, BlockStored):
            for h in e.block_hashes:
                out.setdefault(h, set()).add(e.medium)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                media = out.get(h)
                if media is not None:
                    media.discard(e.medium)
                    if not media:
                        del out[h]
    return out


def fake_kv(ns: Namespace, prompt: np.ndarray, block: int) -> np.ndarray:
    """A block's KV as a reference engine would compute it: depends on the whole prefix."""
    return fake_prefill(prompt, block, ns)


def serve(client: Any, ns: Namespace, prompt: np.ndarray) -> tuple[int, int]:
    """One request of a reference-style engine on the node ``client`` talks to: load the cached
    prefix (checked against its prefill), prefill the rest, store it. Returns (hit, blocks)."""
    bb = ns.block_bytes
    hashes = hash_blocks(ns, prompt)
    kv = np.empty(len(hashes) * bb, dtype=np.uint8)
    hit = client.get_into(ns, hashes, kv)
    for b in range(hit):
        assert np.array_equal(kv[b * bb:(b + 1) * bb], fake_kv(ns, prompt, b)), f"loaded block {b} differs"
    for b in range(hit, len(hashes)):
        kv[b * bb:(b + 1) * bb] = fake_kv(ns, prompt, b)
    client.put(ns, hashes, kv[hit * bb:], start=hit)
    return hit, len(hashes)
