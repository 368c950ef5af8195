"""The routing demo on one machine: ``python -m engine.reference.route_demo [--nodes 3] [--json]``.

Starts ``--nodes`` daemons on loopback (``kvstore.client.spawn.start_daemon``, each publishing
its KV events) and a router process (``python -m kvstore.route``) that knows only their event
streams; then runs multi-turn chats (:func:`chats`: a short shared system prompt, each turn extending the
last) through reference-style engine clients, each request on the node the
router names, every loaded block checked against its prefill. Last, a prefill -> decode
handoff between two nodes. Prints what happened: requests per node, hit rates, how each second
turn was routed, the handoff.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.reference.demo import fake_prefill
from kvstore.client import connect
from kvstore.client.control import control
from kvstore.client.spawn import LocalDaemon, start_daemon
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.route.handoff import offer, receive
from kvstore.version import version

NS = Namespace("demo/route-tiny", KVLayout("bfloat16", 32, (LayerGroup("full", 2, 2, 32),)))
"""32 tokens a block, 16 KiB of KV: small enough for a laptop's loopback, chained like a model's."""

CONFIG = """
[events]
publish = "tcp://127.0.0.1:0"

[[tiers]]
name = "dram"
kind = "dram"
capacity_bytes = "64MiB"
slab_bytes = "1MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
capacity_bytes = "128MiB"
slab_bytes = "1MiB"
"""


def chats(users: int, turns: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Prompts of multi-turn chats sharing a 2-block system prompt, each turn adding 7-12
    blocks of its own, interleaved user by user (turn t of every user, then turn t + 1)."""
    bt = NS.block_tokens
    system = rng.integers(0, 32_000, 2 * bt)
    history = [system.copy() for _ in range(users)]
    out = []
    for _ in range(turns):
        for u in range(users):
            history[u] = np.concatenate([history[u], rng.integers(0, 32_000, int(rng.integers(7, 13)) * bt)])
            out.append(history[u].copy())
    return out


def serve_request(client: Any, prompt: np.ndarray) -> tuple[int, int]:
    """A reference-style engine: load the cached prefix (checked), prefill the rest, store it."""
    bb = NS.block_bytes
    hashes = hash_blocks(NS, prompt)
    kv = np.empty(len(hashes) * bb, dtype=np.uint8)
    hit = client.get_into(NS, hashes, kv)
    for b in range(hit):
        if not np.array_equal(kv[b * bb:(b + 1) * bb], fake_prefill(prompt, b, NS)):
            raise AssertionError(f"loaded block {b} differs from its prefill")
    for b in range(hit, len(hashes)):
        kv[b * bb:(b + 1) * bb] = fake_prefill(prompt, b, NS)
    bt = NS.block_tokens  # the token ids go along: the daemons' KV events carry them
    client.put(NS, hashes, kv[hit * bb:], start=hit, tokens=prompt[hit * bt:len(hashes) * bt])
    return hit, len(hashes)


def start_router(daemons: dict[str, LocalDaemon]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvstore.route"] + [x for n, d in daemons.items() for x in ("--node", f"{n}={d.url}")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the router process did not start (exit {proc.wait()})")
    return proc, json.loads(line)["url"]


def route(router_url: str, prompt: np.ndarray, wait_for: int | None = None) -> dict[str, Any]:
    """Ask the router process; ``wait_for``: ask again (bounded) until it knows that many blocks
    of the prompt, as a caller that just stored them would (events arrive within milliseconds)."""
    deadline = time.monotonic() + 10.0
    while True:
        r = control(router_url, "POST", "/route", {"namespace": NS.to_dict(), "tokens": prompt.tolist()})
        if wait_for is None or r["blocks"] >= wait_for or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


def run(nodes: int, users: int, turns: int, seed: int, root: Path) -> dict[str, Any]:
    cfg = root / "kvstore.toml"
    cfg.write_text(CONFIG)
    daemons: dict[str, LocalDaemon] = {}
    router = None
    try:
        for i in range(nodes):
            daemons[f"node{i}"] = start_daemon(root / f"node{i}", cfg)
        router, router_url = start_router(daemons)
        clients = {n: connect(d.url, plane="tcp") for n, d in daemons.items()}
        for c in clients.values():
            c.register_namespace(NS)
        prompts = chats(users, turns, np.random.default_rng(seed))
        bt = NS.block_tokens
        per_node = dict.fromkeys(daemons, 0)
        hit = total = 0
        second_turns = []
        where: dict[int, str] = {}
        for k, prompt in enumerate(prompts):
            user, turn = k % users, k // users
            r = route(router_url, prompt, wait_for=len(prompts[k - users]) // bt if turn else None)
            h, n = serve_request(clients[r["node"]], prompt)
            per_node[r["node"]] += 1
            hit, total = hit + h, total + n
            if turn == 1:
                second_turns.append({"user": user, "first_turn_on": where[user], "routed_to": r["node"],
                                     "reason": r["reason"], "cached_blocks": r["blocks"], "hit_blocks": h})
            where[user] = r["node"]
        # A handoff: prefill on one node, decode on another, over TCP.
        pre, dec = list(daemons)[:2] if nodes > 1 else (list(daemons)[0],) * 2
        prompt = np.random.default_rng(seed + 1).integers(0, 32_000, 16 * bt)
        hashes = hash_blocks(NS, prompt)
        kv = np.concatenate([fake_prefill(prompt, b, NS) for b in range(len(hashes))])
        t0 = time.perf_counter()
        offer(clients[pre], NS, hashes, kv, "demo-request-1", ttl_s=30)
        dst = np.empty_like(kv)
        got = receive(daemons[pre].url, NS, hashes, dst, "demo-request-1")
        handoff = {"prefill": pre, "decode": dec, "blocks": got.blocks, "state": got.state,
                   "bytes_equal": bool(np.array_equal(dst, kv)), "seconds": round(time.perf_counter() - t0, 4)}
        for c in clients.values():
            c.close()
        stats = control(router_url, "GET", "/stats")
        return {"nodes": nodes, "requests": len(prompts), "requests_per_node": per_node,
                "block_hit_rate": round(hit / total, 4), "second_turns": second_turns,
                "second_turns_on_their_node": sum(s["routed_to"] == s["first_turn_on"] for s in second_turns),
                "router_blocks": stats["blocks"], "handoff": handoff}
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for d in daemons.values():
            d.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.reference.route_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.users < 1 or args.turns < 2:
        p.error("--nodes and --users must be at least 1, --turns at least 2")
    with tempfile.TemporaryDirectory(prefix="kvstore-route-demo-") as tmp:
        out = run(args.nodes, args.users, args.turns, args.seed, Path(tmp))
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
