"""Child process for the two-node test: one store on a shared S3 bucket, driven by JSON lines.

Usage: python -m tests.kvstore.s3_node ROOT CLOCK_START OPTIONS_JSON

Each stdin line is a command, answered by one stdout line:
    {"op": "get", "seed": S, "n": N}  ->  {"loaded": k, "ok": payloads of the k blocks are right}
    {"op": "put", "seed": S, "n": N}  ->  {"new": k}           (durable: on the bucket)
    {"op": "stats"}                   ->  the store's counters
    {"op": "quit"}                    ->  {}, then the process exits
The store's clock is a FakeClock at CLOCK_START, so expiry agrees with the test's own clock.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload


def handle(store: KVStore, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    if op == "get":
        chain = chain_for(cmd["seed"], cmd["n"])
        buf = np.zeros(len(chain) * BB, np.uint8)
        k = store.get_into(SMALL_NS, chain, buf)
        ok = all(bytes(buf[i * BB : (i + 1) * BB]) == payload(chain[i]) for i in range(k))
        return {"loaded": k, "ok": ok}
    if op == "put":
        chain = chain_for(cmd["seed"], cmd["n"])
        return {"new": store.put(SMALL_NS, chain, [payload(h) for h in chain], durable=True)}
    if op == "stats":
        s = store.stats()
        return {k: v for k, v in s.items() if isinstance(v, int | float)}
    if op == "quit":
        return {}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    root, start, options = Path(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3])
    tiers = (TierSpec("object", "object", options),)
    with KVStore(StoreConfig(root=root, tiers=tiers), clock=FakeClock(start)) as store:
        store.register_namespace(SMALL_NS)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            print(json.dumps(handle(store, cmd)), flush=True)
            if cmd["op"] == "quit":
                break


if __name__ == "__main__":
    main()
