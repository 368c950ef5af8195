"""vLLM's KV event wire format (``vllm/distributed/kv_events.py`` of vLLM 0.32), field for field.

A publisher sends three frames per batch: ``topic``, the batch's sequence number (8 bytes,
big-endian, unsigned) and the batch as msgpack (a :class:`KVEventBatch`). A replay request on the
ROUTER socket is one frame, the first sequence number wanted (8 bytes, big-endian); the answer is
``(seq, payload)`` pairs and then ``(END_SEQ, b"")``. These classes mirror vLLM's: a subscriber
built from vLLM's own classes decodes what kvstore sends (``tests/kvstore/route/test_vllm_wire.py``).

kvstore's meaning of the fields: ``block_hashes`` are the 16-byte block hashes a client computes
(``kvstore.keys.hash_blocks``), never the salted keys the daemon stores; ``parent_block_hash`` is
the hash of the block before the first one (None for a chain's first block); ``token_ids``
holds the tokens of every block of the event when the put sent them (``put(tokens=)``), else
it is empty (a ``BlockStored`` never mixes the two); ``block_size`` is the namespace's
tokens per block; ``lora_name`` the namespace's LoRA id; ``medium`` the tier's name
(``dram``, ``nvme``, ...): a block on two tiers is stored once per medium.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import xxhash

ExternalBlockHash = bytes | int
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Encoded as an array ``[ts, events]`` (vLLM 0.32: ``array_like=True``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged: a msgpack map with ``"type": <class name>``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


_INT32 = np.dtype([("tag", "u1"), ("value", ">i4")])


def msgpack_ints(tokens: bytes) -> msgspec.Raw:
    """int32 token ids (little-endian bytes) as a msgpack array, built by numpy: each an
    ``int 32`` (0xd2 and 4 bytes big-endian), which every msgpack decoder reads as the same
    integers (vLLM's: ``list[int]``). A list of Python ints for msgspec to encode cost ~30 ns a
    token; this, ~3."""
    ids = np.frombuffer(tokens, "<i4")
    out = np.empty(ids.size, _INT32)
    out["tag"] = 0xD2
    out["value"] = ids
    n = ids.size
    head = b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")
    return msgspec.Raw(head + out.tobytes())


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    return msgspec.msgpack.Decoder(type=KVEventBatch)


def tenant_mask(tenant: str) -> int:
    """What a stream carrying several tenants XORs into the first 8 bytes of each hash (the
    same prompt of two tenants is then two blocks); 0 for the anonymous tenant ``""``."""
    return xxhash.xxh64_intdigest(tenant.encode()) if tenant else 0


def masked(h: bytes, mask: int) -> bytes:
    """``h`` with ``mask`` XORed into its first 8 bytes (little-endian)."""
    if not mask:
        return h
    return (int.from_bytes(h[:8], "little") ^ mask).to_bytes(8, "little") + h[8:]
