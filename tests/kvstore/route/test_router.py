"""The router on real daemons: second turns, a trace across two daemons against one big one,
cold prefixes, tenants, a daemon restart."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.config import TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.route import Router
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import SMALL_NS
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS, eventually
from tests.kvstore.route.tap import daemons, serve

# shared/ lies beside the repository (CI, the main checkout); a worktree finds it at /work/shared.
TRACE = next((p for p in (Path(__file__).resolve().parents[4] / "shared", Path("/work/shared"))
              if (p / "traces/mooncake/conversation_trace.jsonl").exists()),
             Path("shared")) / "traces/mooncake/conversation_trace.jsonl"
MiB = 1 << 20


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., ThreadedDaemon]]:
    with daemons(tmp_path) as s:
        yield s


def routed(router: Router, clients: dict[str, object], ns: Namespace, prompt: np.ndarray) -> tuple[str, int, int]:
    """Route a prompt, serve it on the chosen node, let the router catch up with the events."""
    node = router.route(ns, prompt).node
    hit, n = serve(clients[node], ns, prompt)
    router.refresh()
    return node, hit, n


def test_the_second_turn_goes_to_the_node_with_the_prefix(start: Callable[..., ThreadedDaemon]) -> None:
    ds = {f"n{i}": start(f"n{i}") for i in range(3)}
    rng = np.random.default_rng(0)
    with Router() as router:
        clients = {}
        for name, d in ds.items():
            router.add_node(name, d.url)
            clients[name] = connect(d.url)
            clients[name].register_namespace(SMALL_NS)
        bt = SMALL_NS.block_tokens
        used: set[str] = set()
        for _ in range(6):
            turn1 = rng.integers(0, 32_000, 5 * bt + 3)
            r1 = router.route(SMALL_NS, turn1)
            assert r1.reason == "hash" and r1.blocks == 0  # cold: the consistent hash decides
            assert router.route(SMALL_NS, turn1).node == r1.node  # and decides the same again
            node, hit, _ = routed(router, clients, SMALL_NS, turn1)
            used.add(node)
            turn2 = np.concatenate([turn1, rng.integers(0, 32_000, 4 * bt)])
            r2 = router.route(SMALL_NS, turn2)
            assert (r2.node, r2.blocks, r2.reason, r2.tiers) == (node, 5, "prefix", {"dram": 5})
            assert r2.matched == {n: (5 if n == node else 0) for n in ds}
            _, hit2, _ = routed(router, clients, SMALL_NS, turn2)
            assert hit2 == 5  # the engine there loads what the router promised
        assert len(used) >= 2  # cold conversations spread over the nodes
        for c in clients.values():
            c.close()


def trace_prompts(n: int, bt: int) -> list[np.ndarray]:
    """The first ``n`` requests of the Mooncake conversation trace as token ids: block id x is
    ``bt`` tokens of value x (an id names its whole prefix, so chains hash alike)."""
    prompts = []
    with TRACE.open() as f:
        for line, _ in zip(f, range(n), strict=False):
            ids = json.loads(line)["hash_ids"]
            prompts.append(np.repeat(np.asarray(ids, dtype=np.int32), bt))
    return prompts


def dram_only(mib: int) -> tuple[TierSpec, ...]:
    return (TierSpec("dram", "dram", {"capacity_bytes": mib * MiB, "slab_bytes": MiB}),)


@pytest.mark.slow
def test_a_router_fed_by_events_matches_one_big_daemon_on_a_trace(start: Callable[..., ThreadedDaemon]) -> None:
    if not TRACE.exists():
        pytest.skip(f"{TRACE} is not here")
    ns = Namespace("test/route-trace", KVLayout("bfloat16", 4, (LayerGroup("full", 1, 1, 4),)))
    prompts = trace_prompts(400, ns.block_tokens)
    # One big daemon: every request on it.
    big = start("big", tiers=dram_only(96))
    with connect(big.url) as c:
        c.register_namespace(ns)
        results = [serve(c, ns, p) for p in prompts]
    big_rate = sum(h for h, _ in results) / sum(n for _, n in results)
    # Two daemons of half the size, a router that knows only their event streams.
    ds = {"a": start("a", tiers=dram_only(48)), "b": start("b", tiers=dram_only(48))}
    with Router() as router:
        clients = {}
        for name, d in ds.items():
            router.add_node(name, d.url)
            clients[name] = connect(d.url)
            clients[name].register_namespace(ns)
        out = [routed(router, clients, ns, p) for p in prompts]
        for c in clients.values():
            c.close()
    rate = sum(h for _, h, _ in out) / sum(n for _, _, n in out)
    load = {name: sum(1 for node, _, _ in out if node == name) for name in ds}
    assert big_rate > 0.05  # the trace reuses prefixes: there is something to match
    assert abs(rate - big_rate) <= 0.01 * big_rate, (rate, big_rate)
    assert min(load.values()) >= 0.2 * len(prompts), load  # and both daemons served


def test_a_tenant_is_routed_by_its_own_blocks(start: Callable[..., ThreadedDaemon]) -> None:
    ds = {"x": start("x", tenants=TENANTS), "y": start("y", tenants=TENANTS)}
    prompt = np.arange(6 * SMALL_NS.block_tokens, dtype=np.int32)
    for node, token in (("x", TOKEN_A), ("y", TOKEN_B)):  # the same prompt, a on x, b on y
        with connect(ds[node].url, token=token) as c:
            c.register_namespace(SMALL_NS)
            serve(c, SMALL_NS, prompt)
    with Router(tenant="a") as ra:  # tenant a's own streams, with a's token
        for node, d in ds.items():
            ra.add_node(node, d.url, token=TOKEN_A)
        ra.refresh()
        assert (ra.route(SMALL_NS, prompt).node, ra.route(SMALL_NS, prompt).blocks) == ("x", 6)
    with Router() as ops:  # every tenant's stream, with the admin's token
        for node, d in ds.items():
            ops.add_node(node, d.url, token=TOKEN_OPS, all_tenants=True)
        ops.refresh()
        assert ops.route(SMALL_NS, prompt, tenant="a").node == "x"
        assert ops.route(SMALL_NS, prompt, tenant="b").node == "y"
        assert ops.route(SMALL_NS, prompt, tenant="ops").blocks == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_router_resyncs_after_a_daemon_restart(start: Callable[..., ThreadedDaemon]) -> None:
    ports = {"publish": f"tcp://127.0.0.1:{free_port()}", "replay": f"tcp://127.0.0.1:{free_port()}"}
    a = start("a", **ports)
    b = start("b")
    prompt = np.arange(8 * SMALL_NS.block_tokens, dtype=np.int32)
    other = prompt + 1
    with Router() as router:
        router.add_node("a", publish=ports["publish"], replay=ports["replay"])
        router.add_node("b", b.url)
        with connect(a.url) as c:
            c.register_namespace(SMALL_NS)
            serve(c, SMALL_NS, prompt)
        router.refresh()
        assert router.route(SMALL_NS, prompt).tiers == {"dram": 8}
        a.stop()  # a clean stop: DRAM goes down to NVMe
        a2 = start("a", **ports)  # same ports, same directory: a new epoch
        with connect(a2.url) as c:
            c.register_namespace(SMALL_NS)
            c.delete(SMALL_NS, hash_blocks(SMALL_NS, prompt)[6:7])  # the restarted node lost two
            serve(c, SMALL_NS, other)
        # The live stream (a heartbeat a second at least) shows the new epoch; the feed forgets
        # what a said and replays its new stream from 0.
        assert eventually(lambda: router.poll(0.2) >= 0 and router.stats()["nodes"]["a"]["restarts"] == 1, 60.0)
        router.refresh()
        r = router.route(SMALL_NS, prompt)
        assert (r.node, r.blocks, r.tiers) == ("a", 6, {"nvme": 6})
        assert router.route(SMALL_NS, other).blocks == 8


def test_the_search_agrees_with_a_lookup_of_every_block() -> None:
    """Prefix-closed nodes with faster tiers on a prefix of each chain: the 32-way search finds
    the same lengths and tier counts as looking every block up."""
    from kvstore.wire.kvevents import AllBlocksCleared, BlockStored

    rng = np.random.default_rng(7)
    router = Router(down_after_s=float("inf"), min_match=0.0)
    feeds = [router.add_events_node(f"n{i}") for i in range(3)]
    prompt = [bytes(h) for h in rng.integers(0, 256, (3000, 16), dtype=np.uint8)]

    def stored(hs: list[bytes], medium: str) -> list[BlockStored]:
        return [BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=16,
                            lora_id=None, medium=medium, lora_name=None)]

    for _ in range(40):
        for f in feeds:
            f([AllBlocksCleared()])
            length = int(rng.choice([0, 1, 2999, 3000, int(rng.integers(0, 3001))]))
            fast = int(rng.integers(0, length + 1))
            f(stored(prompt[length - (length - fast):length], "nvme") if length > fast else [])
            f(stored(prompt[:fast], "dram") if fast else [])
        q = prompt[: int(rng.integers(1, 3001))]
        assert router.route_hashes(q) == router.route_hashes(q, exact=True)
    router.close()
