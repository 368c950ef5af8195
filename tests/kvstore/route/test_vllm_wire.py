"""vLLM's own event classes decode kvstore's stream (run by ``make test-vllm`` in .venv-vllm),
and the token ids of what the real engines save reach it: vLLM through the connector, SGLang
through the HiCache backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

import msgspec  # noqa: E402
import zmq  # noqa: E402

from kvstore.client import connect  # noqa: E402
from kvstore.config import TierSpec  # noqa: E402
from kvstore.keys import hash_blocks  # noqa: E402
from kvstore.server.daemon import ThreadedDaemon  # noqa: E402
from tests.conftest import BB, SMALL_NS  # noqa: E402
from tests.kvstore.route.tap import daemons  # noqa: E402

pytestmark = pytest.mark.vllm

# Checked 2026-12-01 in a scratch copy of .venv-vllm (issue 13).
NO_TORCHVISION = (
    "SGLang's controller imports torchvision, and no torchvision for vLLM's torch==2.13.0+cpu installs "
    "from the package registries: PyPI's torchvision 0.28.0 (the release for torch 2.13.0) is the CUDA "
    "build (its _C.so needs libc10_cuda.so), so `import torchvision` fails with `RuntimeError: operator "
    "torchvision::nms does not exist`; the CPU build 0.28.0+cpu is only on download.pytorch.org "
    "(`pip install torchvision==0.28.0+cpu`: ResolutionImpossible from PyPI)"
)
BIG_DRAM = (TierSpec("dram", "dram", {"capacity_bytes": "256MiB", "slab_bytes": "16MiB"}),)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[ThreadedDaemon]:
    with daemons(tmp_path) as start:
        yield start("n")


def replay(d: ThreadedDaemon) -> list[Any]:
    """Every event of ``d``'s stream from 0, decoded by vLLM's ``KVEventBatch`` through vLLM's
    replay protocol (a DEALER: REQ takes one reply per request; the replay streams many)."""
    ep = d.info["events"]
    decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
    ctx: zmq.Context = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(ep["replay"])
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    events: list[Any] = []
    last = -1
    try:
        while req.poll(60_000):
            _, seq_b, payload = req.recv_multipart()
            if not payload:  # vLLM's end-of-replay marker
                return events
            seq = int.from_bytes(seq_b, "big")
            assert seq == last + 1
            last = seq
            events.extend(decoder.decode(payload).events)
        raise AssertionError("the replay did not end within 60 s")
    finally:
        req.close(0)
        ctx.term()


def stored_blocks(events: list[Any]) -> dict[bytes, list[int]]:
    """Each stored block's token ids, as a subscriber reads them from ``BlockStored`` ([] for a
    block stored without them)."""
    out: dict[bytes, list[int]] = {}
    for ev in events:
        if isinstance(ev, vllm_events.BlockStored):
            bs = ev.block_size
            assert len(ev.token_ids) in (0, bs * len(ev.block_hashes)), "the tokens of every block of the event"
            for i, h in enumerate(ev.block_hashes):
                out[h] = ev.token_ids[i * bs:(i + 1) * bs]
    return out


def test_a_subscriber_built_from_vllm_classes_decodes_the_stream(daemon: ThreadedDaemon) -> None:
    tokens = np.arange(20 * SMALL_NS.block_tokens, dtype=np.int32)
    hs = hash_blocks(SMALL_NS, tokens)
    with connect(daemon.url) as c:  # 20 blocks into a 16-block DRAM: demotions and removals too
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hs, [bytes(BB)] * len(hs), tokens=tokens)
        c.delete(SMALL_NS, hs[18:])
    events = replay(daemon)
    kinds = [type(ev).__name__ for ev in events]
    stored: dict[bytes, set[str]] = {}
    for ev in events:
        if isinstance(ev, vllm_events.BlockStored):
            # vLLM's layout: the tokens of every block of the event, in order.
            want = [int(t) for h in ev.block_hashes for t in tokens[hs.index(h) * 16:][:16]]
            assert ev.block_size == SMALL_NS.block_tokens and ev.token_ids == want
            for h in ev.block_hashes:
                stored.setdefault(h, set()).add(ev.medium)
        elif isinstance(ev, vllm_events.BlockRemoved):
            for h in ev.block_hashes:
                stored.get(h, set()).discard(ev.medium)
    assert kinds[0] == "AllBlocksCleared" and {"BlockStored", "BlockRemoved"} <= set(kinds)
    assert {h for h, m in stored.items() if m} == set(hs[:18])
    assert {m for h in hs[:18] for m in stored[h]} == {"dram", "nvme"}


@pytest.mark.slow
def test_the_vllm_connector_saves_the_token_ids_of_its_blocks(tmp_path: Path) -> None:
    """A real vLLM engine (CPU build, tiny model) with the connector: every block it saves
    reaches the stream with the token ids of that block of a prompt."""
    from engine.vllm.tiny import SMALL, save_tiny_llama
    from tests.engine.vllm.conftest import prompts, run_scenario

    model = str(save_tiny_llama(tmp_path / "model", SMALL))
    ps = prompts(7, [300, 200])  # 9 and 6 whole blocks of 32
    with daemons(tmp_path) as start:
        d = start("v", tiers=BIG_DRAM)
        spec = {"model": model, "url": d.url, "rounds": [{"prompts": ps, "max_tokens": 4}],
                "connector": {"lookup_timeout_s": 60, "load_timeout_s": 120, "save_timeout_s": 120,
                              "max_pending_saves": 256},
                "engine": {"prefix_caching": False, "max_model_len": 1024, "dtype": "float32"}}
        run_scenario(spec, tmp_path / "run")
        blocks = stored_blocks(replay(d))
    bt = 32
    want = {tuple(p[j * bt:(j + 1) * bt]) for p in ps for j in range(len(p) // bt)}
    got = {tuple(t) for t in blocks.values()}
    assert got == want and all(blocks.values())  # every saved block named by its own tokens, and every whole prompt block saved


def _sglang_backend(url: str) -> Any:
    from engine.sglang.storage import KVStoreHiCache
    from tests.engine.sglang.test_storage import HostPool, _config, _dynamic

    backend = KVStoreHiCache(_config(_dynamic(url)))
    backend.register_mem_pool_host(HostPool(8))
    return backend


@pytest.mark.sglang
def test_the_sglang_backend_sends_the_token_ids_a_write_carries(tmp_path: Path) -> None:
    """``batch_set_v1`` with SGLang's ``HiCacheStorageExtraInfo`` carrying the pages' token ids
    (``extra_info={"token_ids": ...}``): they reach the stream with each page's block; a write
    without them is stored without tokens."""
    torch = pytest.importorskip("torch")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from tests.engine.sglang.test_storage import PAGE

    tokens = list(range(100, 100 + 5 * PAGE))
    with daemons(tmp_path) as start:
        d = start("s", tiers=BIG_DRAM)
        backend = _sglang_backend(d.url)
        keys = [f"page-{i}" for i in range(5)]
        info = HiCacheStorageExtraInfo(prefix_keys=[], extra_info={"token_ids": tokens})
        assert all(backend.batch_set_v1(keys, torch.arange(5 * PAGE), info))
        assert all(backend.batch_set_v1(["other-0"], torch.arange(PAGE), HiCacheStorageExtraInfo(prefix_keys=[])))
        backend.close()
        events = replay(d)
    blocks = stored_blocks(events)
    assert sorted(tuple(t) for t in blocks.values() if t) == [tuple(tokens[i * PAGE:(i + 1) * PAGE]) for i in range(5)]
    assert sum(1 for t in blocks.values() if not t) == 1  # the page written without its tokens


@pytest.mark.sglang
def test_a_backup_operations_token_ids_reach_its_writes(tmp_path: Path) -> None:
    """What ``send_token_ids`` puts around SGLang's ``_page_backup``: the writes it makes, in
    batches whose ``prefix_keys`` grow (as SGLang's do), find their pages' token ids in the
    operation (``StorageOperation.token_ids``, ``hash_value``)."""
    torch = pytest.importorskip("torch")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from engine.sglang.storage import _with_operation
    from tests.engine.sglang.test_storage import PAGE

    tokens = list(range(7, 7 + 5 * PAGE))
    keys = [f"page-{i}" for i in range(5)]
    with daemons(tmp_path) as start:
        d = start("s", tiers=BIG_DRAM)
        backend = _sglang_backend(d.url)

        def page_backup(self: Any, operation: Any) -> None:  # SGLang's batching, 2 pages a batch
            prefix = list(operation.prefix_keys)
            for i in range(0, len(operation.hash_value), 2):
                batch = operation.hash_value[i:i + 2]
                assert all(backend.batch_set_v1(batch, torch.arange(len(batch) * PAGE),
                                                HiCacheStorageExtraInfo(prefix_keys=prefix)))
                prefix = prefix + batch

        class Operation:
            token_ids, hash_value, prefix_keys = tokens, keys, []

        _with_operation(page_backup)(None, Operation())
        backend.close()
        blocks = stored_blocks(replay(d))
    assert sorted(tuple(t) for t in blocks.values()) == [tuple(tokens[i * PAGE:(i + 1) * PAGE]) for i in range(5)]


@pytest.mark.sglang
def test_sglangs_page_backup_sends_the_token_ids_of_its_pages(tmp_path: Path) -> None:
    """SGLang's own backup of host pages (``HiCacheController._page_backup``, in batches, with
    ``send_token_ids``) hands the pages' token ids to the backend. Needs SGLang's controller
    importable, which needs torchvision (skipped in .venv-vllm: see NO_TORCHVISION)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.managers.cache_controller", reason=NO_TORCHVISION)
    from sglang.srt.managers.cache_controller import HiCacheController, StorageOperation

    from engine.sglang.storage import send_token_ids
    from tests.engine.sglang.test_storage import PAGE

    tokens = list(range(100, 100 + 5 * PAGE))
    keys = [f"page-{i}" for i in range(5)]
    with daemons(tmp_path) as start:
        d = start("s", tiers=BIG_DRAM)
        backend = _sglang_backend(d.url)

        class Controller:  # what _page_backup reads of a HiCacheController
            page_size = PAGE
            storage_backend = backend

            def page_set_func(self, hashes: list[str], host_indices: Any, extra_info: Any) -> bool:
                return all(backend.batch_set_v1(hashes, host_indices, extra_info))

        with send_token_ids():
            op = StorageOperation(torch.arange(5 * PAGE), tokens, hash_value=keys, prefix_keys=[])
            HiCacheController._page_backup(Controller(), op)  # type: ignore[arg-type]
        assert op.completed_tokens == 5 * PAGE
        backend.close()
        blocks = stored_blocks(replay(d))
    assert sorted(tuple(t) for t in blocks.values()) == [tuple(tokens[i * PAGE:(i + 1) * PAGE]) for i in range(5)]
