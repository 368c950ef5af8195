"""The embedded demo: a toy engine client driving an in-process store on its default tiers.

``make demo`` runs it. A simulated serving workload (a shared system prompt, several users,
multi-turn conversations) goes through the real store: for each request the client hashes the
prompt, loads the cached prefix into its own buffers, "prefills" the rest (a deterministic
stand-in for the model's KV), checks that every loaded block equals what prefill would have
produced, and stores the new blocks. Then the store is closed and reopened from disk (warm
restart) and the first user's conversation is served again from the persistent tiers.

The store directory (``--root``, ``.kvstore-demo``; tens of MB) is removed at the end, and the
summary says so; ``--keep`` keeps it (and reuses one that exists), e.g. for ``kvctl --dir``.

Exit codes: 0 ok, 1 a loaded block differed from its prefill (a bug) or the store could not
open (e.g. /dev/shm too small for the DRAM tier: the message says what to change), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.reference.demo_model import print_model_demo, run_model_demo
from kvstore.config import load_config
from kvstore.errors import KVStoreError
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.store import KVStore
from kvstore.version import version

# 8 layers of 4 KV heads x 64 dims in bf16, 32-token blocks -> 256 KiB per block: enough that the
# workload overflows the default 64 MiB DRAM tier and exercises demotion to NVMe, small enough
# that the whole demo takes tens of MB.
DEMO_NS = Namespace("demo/llama-8-layers", KVLayout("bfloat16", 32, (LayerGroup("full", 8, 4, 64),)))


def fake_prefill(tokens: np.ndarray, block: int, ns: Namespace = DEMO_NS) -> np.ndarray:
    """Deterministic stand-in for a block's KV: depends on the whole prefix, like real KV."""
    bt = ns.block_tokens
    seed = int(np.bitwise_xor.reduce(tokens[: (block + 1) * bt].astype(np.uint64) * np.uint64(2654435761)))
    return np.random.default_rng(seed).integers(0, 256, ns.block_bytes, dtype=np.uint8)


def workload(users: int, turns: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Prompts of multi-turn chats that share one system prompt: turn t extends turn t-1."""
    bt = DEMO_NS.block_tokens
    system = rng.integers(0, 32_000, 8 * bt)
    prompts: list[tuple[int, np.ndarray]] = []
    for u in range(users):
        history = system.copy()
        for t in range(turns):
            turn = rng.integers(0, 32_000, int(rng.integers(2, 6)) * bt)
            history = np.concatenate([history, turn])
            prompts.append((t * users + u, history.copy()))
    return [p for _, p in sorted(prompts, key=lambda x: x[0])]  # interleave users turn by turn


def serve(store: KVStore, prompt: np.ndarray) -> tuple[int, int]:
    """One request: load the cached prefix, prefill the rest, store it. Returns (hit, total)."""
    bb = DEMO_NS.block_bytes
    hashes = hash_blocks(DEMO_NS, prompt)
    kv = np.empty(len(hashes) * bb, dtype=np.uint8)  # the engine's own buffer
    hit = store.get_into(DEMO_NS, hashes, kv)
    for b in range(hit):
        if not np.array_equal(kv[b * bb : (b + 1) * bb], fake_prefill(prompt, b)):
            raise AssertionError(f"loaded block {b} differs from its prefill")
    for b in range(hit, len(hashes)):
        kv[b * bb : (b + 1) * bb] = fake_prefill(prompt, b)
    store.put(DEMO_NS, hashes, kv[hit * bb :], start=hit)
    return hit, len(hashes)


def run(root: Path, users: int, turns: int, seed: int) -> dict[str, Any]:
    cfg = load_config(root=root)
    rng = np.random.default_rng(seed)
    prompts = workload(users, turns, rng)
    t0 = time.perf_counter()
    with KVStore(cfg) as store:
        store.register_namespace(DEMO_NS)
        hit = total = 0
        for p in prompts:
            h, n = serve(store, p)
            hit += h
            total += n
        first = store.stats()
        store.flush()
    with KVStore(cfg) as store:  # warm restart from the persistent tiers
        store.register_namespace(DEMO_NS)
        recovered = store.stats()["recovered_blocks"]
        again_hit, again_total = serve(store, prompts[-users])  # first user's last turn
        after = store.stats()
    return {
        "root": str(root),
        "requests": len(prompts),
        "blocks": total,
        "hit_blocks": hit,
        "block_hit_rate": round(hit / total, 4),
        "prefill_tokens_skipped": hit * DEMO_NS.block_tokens,
        "demotions": first["demotions"],
        "promotions": first["promotions"],
        "evictions": first["evictions"],
        "tiers": {t["name"]: {"blocks": t["blocks"], "used_bytes": t["used_bytes"]} for t in first["tiers"]},
        "restart_recovered_blocks": recovered,
        "restart_hit_blocks": again_hit,
        "restart_request_blocks": again_total,
        "restart_hits_by_tier": after["hits_by_tier"],
        "seconds": round(time.perf_counter() - t0, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.reference.demo",
        description="Run kvstore end to end on its embedded defaults (shared-memory DRAM, NVMe "
        "slab file + RocksDB, file:// object store; no external service): a toy engine serves "
        "multi-turn chats through the store, then the store restarts warm from disk.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--root", type=Path, default=Path(".kvstore-demo"),
                   help="store directory (default .kvstore-demo; wiped first and removed at the end)")
    p.add_argument("--users", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--turns", type=int, default=10, help="turns per conversation (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=4, help="reference-engine prompts (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="TTFT runs per prompt and side (default 5)")
    p.add_argument("--keep", action="store_true",
                   help="keep --root after the run (and reuse it if it exists), e.g. for kvctl --dir")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-model", action="store_true", help="skip the reference-engine part (transformers)")
    args = p.parse_args(argv)
    if min(args.users, args.turns, args.prompts, args.repeats) < 1:
        p.error("--users, --turns, --prompts and --repeats must be at least 1")
    if not args.keep and args.root.exists():
        shutil.rmtree(args.root)
    try:
        out = run(args.root, args.users, args.turns, args.seed)
        model = None if args.no_model else run_model_demo(args.root, prompts=args.prompts, seed=args.seed, repeats=args.repeats)
    except AssertionError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    except KVStoreError as e:
        print(f"demo: the store could not run: {e}", file=sys.stderr)
        return 1
    finally:
        root_bytes = _tree_bytes(args.root)
        if not args.keep:
            shutil.rmtree(args.root, ignore_errors=True)
    out = {**out, "root_bytes": root_bytes, "root_kept": bool(args.keep)}
    if model is not None and not all(r["same_next_token"] for r in model.get("prompts", [])):
        print("demo: a cached run picked another next token than the full prefill", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**out, "reference_engine": model}))
        return 0
    print(f"kvstore demo: {out['requests']} requests ({args.users} users x {args.turns} turns) in {out['seconds']} s")
    print(f"  blocks requested {out['blocks']}, served from cache {out['hit_blocks']} "
          f"(block hit rate {out['block_hit_rate']:.1%}), prefill tokens skipped {out['prefill_tokens_skipped']}")
    print("  every loaded block was checked against its prefill: identical")
    print(f"  tier moves: {out['demotions']} demotions, {out['promotions']} promotions, {out['evictions']} evictions")
    for name, t in out["tiers"].items():
        print(f"  tier {name:<7} {t['blocks']:>5} blocks  {t['used_bytes'] / 2**20:8.1f} MiB")
    print(f"  warm restart: {out['restart_recovered_blocks']} blocks recovered from disk; the first user's "
          f"last turn hit {out['restart_hit_blocks']}/{out['restart_request_blocks']} blocks "
          f"(from {out['restart_hits_by_tier']})")
    if model is not None:
        print_model_demo(model)
    size = f"{out['root_bytes'] / 1e6:.1f} MB"
    if args.keep:
        print(f"store directory {out['root']} ({size}) kept: `kvctl --dir {out['root']} tiers` reads it; "
              f"remove it with `rm -rf {out['root']}`")
    else:
        print(f"store directory {out['root']} ({size}) removed; `--keep` keeps it")
    return 0


def _tree_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take on disk (allocated blocks: the NVMe slab file is
    preallocated); 0 when it does not exist."""
    if not root.exists():
        return 0
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file() and not p.is_symlink())


if __name__ == "__main__":
    sys.exit(main())
