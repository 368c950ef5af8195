"""vLLM's own event classes decode kvstore's stream (run by ``make test-vllm`` in .venv-vllm)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

import msgspec  # noqa: E402
import zmq  # noqa: E402

from kvstore.client import connect  # noqa: E402
from kvstore.keys import hash_blocks  # noqa: E402
from kvstore.server.daemon import ThreadedDaemon  # noqa: E402
from tests.conftest import BB, SMALL_NS  # noqa: E402
from tests.kvstore.route.tap import daemons  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[ThreadedDaemon]:
    with daemons(tmp_path) as start:
        yield start("n")


def test_a_subscriber_built_from_vllm_classes_decodes_the_stream(daemon: ThreadedDaemon) -> None:
    tokens = np.arange(20 * SMALL_NS.block_tokens, dtype=np.int32)
    hs = hash_blocks(SMALL_NS, tokens)
    with connect(daemon.url) as c:  # 20 blocks into a 16-block DRAM: demotions and removals too
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hs, [bytes(BB)] * len(hs), tokens=tokens)
        c.delete(SMALL_NS, hs[18:])
    ep = daemon.info["events"]
    decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
    ctx: zmq.Context = zmq.Context()
    # vLLM's replay client: a REQ socket sending the first sequence number wanted.
    req = ctx.socket(zmq.DEALER)  # REQ takes one reply per request; the replay streams many
    req.setsockopt(zmq.LINGER, 0)
    req.connect(ep["replay"])
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    kinds: list[str] = []
    stored: dict[bytes, set[str]] = {}
    last = -1
    while req.poll(5000):
        _, seq_b, payload = req.recv_multipart()
        if not payload:  # vLLM's end-of-replay marker
            break
        seq = int.from_bytes(seq_b, "big")
        assert seq == last + 1
        last = seq
        batch = decoder.decode(payload)
        for ev in batch.events:
            kinds.append(type(ev).__name__)
            if isinstance(ev, vllm_events.BlockStored):
                # vLLM's layout: the tokens of every block of the event, in order.
                want = [int(t) for h in ev.block_hashes for t in tokens[hs.index(h) * 16:][:16]]
                assert ev.block_size == SMALL_NS.block_tokens and ev.token_ids == want
                for h in ev.block_hashes:
                    stored.setdefault(h, set()).add(ev.medium)
            elif isinstance(ev, vllm_events.BlockRemoved):
                for h in ev.block_hashes:
                    stored.get(h, set()).discard(ev.medium)
    req.close(0)
    ctx.term()
    assert kinds[0] == "AllBlocksCleared" and {"BlockStored", "BlockRemoved"} <= set(kinds)
    assert {h for h, m in stored.items() if m} == set(hs[:18])
    assert {m for h in hs[:18] for m in stored[h]} == {"dram", "nvme"}
