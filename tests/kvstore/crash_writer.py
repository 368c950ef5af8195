"""Child process for the crash test: durable puts in a loop, one ack line per returned put.

Usage: python -m tests.kvstore.crash_writer ROOT FIRST_CHAIN
"""

from __future__ import annotations

import sys
from itertools import count
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.store import KVStore
from tests.conftest import SMALL_NS, chain_for, payload, small_tiers


def main() -> None:
    root, first = Path(sys.argv[1]), int(sys.argv[2])
    store = KVStore(StoreConfig(root=root, tiers=small_tiers(8, 64, 4096)))
    store.register_namespace(SMALL_NS)
    for i in count(first):
        chain = chain_for(i, 3, shared_prefix_blocks=1)
        store.put(SMALL_NS, chain, [payload(h) for h in chain], durable=True)
        sys.stdout.write(f"{i}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
