"""A feed against a scripted publisher: gaps, duplicates, restarts, a publisher that does not answer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvstore.route.feed import Feed
from kvstore.wire.kvevents import END_SEQ, AllBlocksCleared, BlockStored, KVEventBatch, seq_bytes


def stored(i: int) -> BlockStored:
    return BlockStored(block_hashes=[i.to_bytes(16, "little")], parent_block_hash=None, token_ids=[],
                       block_size=16, lora_id=None, medium="dram", lora_name=None)


class ScriptedPublisher:
    """PUB (an XPUB, to know when the subscriber is there) and a ROUTER served by a thread."""

    def __init__(self, ctx: zmq.Context[Any], epoch: str = "e1") -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.publish = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.rep = ctx.socket(zmq.ROUTER)
        self.rep.setsockopt(zmq.LINGER, 0)
        self.replay = f"tcp://127.0.0.1:{self.rep.bind_to_random_port('tcp://127.0.0.1')}"
        self.epoch = epoch
        self.buffer: list[tuple[int, bytes]] = []
        self.answer = True
        self.requests: list[int] = []
        self._enc = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_subscriber(self) -> None:
        assert self.pub.poll(5000), "the subscriber never subscribed"
        self.pub.recv()

    def send(self, seq: int, events: list[Any], live: bool = True) -> None:
        payload = self._enc.encode(KVEventBatch(ts=0.0, events=events))
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart((f"@{self.epoch}".encode(), seq_bytes(seq), payload))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.rep.poll(50):
                continue
            client, _, start_b = self.rep.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.requests.append(start)
            if not self.answer:
                continue
            for seq, payload in list(self.buffer):
                if seq >= start:
                    self.rep.send_multipart((client, b"", seq_bytes(seq), payload))
            self.rep.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.rep.close(0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)  # also when a test failed before closing its sockets


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.resets = 0

    def sink(self, events: list[Any]) -> None:
        self.events.extend(events)

    def reset(self) -> None:
        self.resets += 1
        self.events.clear()

    def ids(self) -> list[int]:
        return [int.from_bytes(e.block_hashes[0], "little") for e in self.events if isinstance(e, BlockStored)]


def follow(feed: Feed, pub: ScriptedPublisher, until: int) -> None:
    """Handle live messages until the feed has applied batch ``until``."""
    while feed.last_seq < until:
        assert feed.sub.poll(5000), f"no live message; the feed is at {feed.last_seq}"
        feed.handle()


def make(pub: ScriptedPublisher, rec: Recorder, ctx: zmq.Context[Any], **kw: Any) -> Feed:
    feed = Feed("n", pub.publish, pub.replay, rec.sink, rec.reset, ctx, **kw)
    pub.wait_subscriber()
    return feed


def test_first_contact_replays_history_then_follows_live(ctx: zmq.Context[Any]) -> None:
    pub = ScriptedPublisher(ctx)
    pub.send(0, [AllBlocksCleared()], live=False)  # before anyone listened
    pub.send(1, [stored(1)], live=False)
    rec = Recorder()
    feed = make(pub, rec, ctx)
    feed.start()
    assert feed.synced and feed.last_seq == 1 and rec.ids() == [1]
    pub.send(2, [stored(2)])
    follow(feed, pub, 2)
    assert rec.ids() == [1, 2] and pub.requests == [0] and feed.stats.gaps == 0
    feed.close()
    pub.close()


def test_a_gap_is_replayed_in_order_and_duplicates_are_skipped(ctx: zmq.Context[Any]) -> None:
    pub = ScriptedPublisher(ctx)
    rec = Recorder()
    feed = make(pub, rec, ctx)
    feed.start()
    pub.send(0, [stored(0)])
    follow(feed, pub, 0)
    pub.send(1, [stored(1)], live=False)  # lost on the way
    pub.send(2, [stored(2)], live=False)
    pub.send(3, [stored(3)])
    follow(feed, pub, 3)
    assert rec.ids() == [0, 1, 2, 3]
    assert feed.stats.gaps == 1 and pub.requests[-1] == 1
    pub.pub.send_multipart((b"@e1", seq_bytes(2), pub.buffer[2][1]))  # a late duplicate
    pub.send(4, [stored(4)])
    follow(feed, pub, 4)
    # Two duplicates: batch 3 itself (the replay brought it before its live copy was read) and 2.
    assert rec.ids() == [0, 1, 2, 3, 4] and feed.stats.duplicates == 2
    feed.close()
    pub.close()


def test_a_new_epoch_forgets_the_node_and_resyncs_from_zero(ctx: zmq.Context[Any]) -> None:
    pub = ScriptedPublisher(ctx)
    rec = Recorder()
    feed = make(pub, rec, ctx)
    feed.start()
    for s in range(3):
        pub.send(s, [stored(s)])
    follow(feed, pub, 2)
    # The daemon restarts: a new epoch, sequence numbers from 0 again, first batches unseen.
    pub.epoch, pub.buffer = "e2", []
    pub.send(0, [AllBlocksCleared(), stored(10)], live=False)
    pub.send(1, [stored(11)])
    while feed.stats.restarts == 0 or feed.last_seq < 1:
        assert feed.sub.poll(5000)
        feed.handle()
    assert rec.resets == 1 and rec.ids() == [10, 11] and feed.epoch == b"e2"
    feed.close()
    pub.close()


def test_a_publisher_that_does_not_answer_leaves_the_state_and_is_asked_again(ctx: zmq.Context[Any]) -> None:
    pub = ScriptedPublisher(ctx)
    rec = Recorder()
    feed = make(pub, rec, ctx, replay_timeout_s=0.2)
    feed.start()
    pub.send(0, [stored(0)])
    follow(feed, pub, 0)
    pub.answer = False
    pub.send(1, [stored(1)], live=False)
    pub.send(2, [stored(2)])
    assert feed.sub.poll(5000)
    feed.handle()
    assert feed.stats.replay_failures == 1 and feed.last_seq == 0 and rec.ids() == [0]
    pub.answer = True
    pub.send(3, [stored(3)])
    follow(feed, pub, 3)
    assert rec.ids() == [0, 1, 2, 3]
    feed.close()
    pub.close()
