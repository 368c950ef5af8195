"""hash: chained block hashes + longest-prefix match of a long prompt.

Figure: hashing a 131,072-token prompt in 64-token blocks with xxh3-128 and matching it against
an index that holds the whole prefix (the worst case: every block is walked). Baseline, in the
same run: SHA-256 over pickled (parent, block tokens, extra) tuples, how vLLM hashes by default,
plus the same match. Goal: <= 1 ms.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvstore.index import NO_PARENT, RadixIndex
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from tools.bench._common import best_of, result

NS = Namespace("bench/llama-3-8b", KVLayout("bfloat16", 64, (LayerGroup("full", 32, 8, 128),)))


def sha256_pickle_chain(tokens: list[int], block_tokens: int) -> list[bytes]:
    prev = b"\0" * 32
    out = []
    for i in range(len(tokens) // block_tokens):
        blk = tuple(tokens[i * block_tokens : (i + 1) * block_tokens])
        prev = hashlib.sha256(pickle.dumps((prev, blk, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(prev)
    return out


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n_tokens = 16_384 if args.quick else 131_072
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, size=n_tokens, dtype=np.int32)
    chain = hash_blocks(NS, tokens)
    idx = RadixIndex()
    idx.insert_chain(chain, NO_PARENT, 0, NS.block_bytes, 0, 1, 0.0, 1e18)
    tok_list = tokens.tolist()
    base_chain = sha256_pickle_chain(tok_list, 64)
    base_idx = RadixIndex()
    base_idx.insert_chain([h[:16] for h in base_chain], NO_PARENT, 0, NS.block_bytes, 0, 1, 0.0, 1e18)

    def ours() -> None:
        m = idx.match(hash_blocks(NS, tokens), now=1.0)
        assert m.num_blocks == len(chain)

    def baseline() -> None:
        hs = sha256_pickle_chain(tok_list, 64)
        m = base_idx.match([h[:16] for h in hs], now=1.0)
        assert m.num_blocks == len(chain)

    repeat = 5 if args.quick else 30
    t = best_of(ours, repeat) * 1e3
    b = best_of(baseline, max(3, repeat // 5)) * 1e3
    yield result("hash", f"hash_match_{n_tokens}_tokens", t, "ms", b, blocks=len(chain), goal_ms=1.0)
    t_hash = best_of(lambda: hash_blocks(NS, tokens), repeat) * 1e3
    t_match = best_of(lambda: idx.match(chain, now=1.0), repeat) * 1e3
    yield result("hash", f"hash_only_{n_tokens}_tokens", t_hash, "ms", b)
    yield result("hash", f"match_only_{len(chain)}_blocks", t_match, "ms", b)
