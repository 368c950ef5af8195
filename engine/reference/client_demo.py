"""The demo workload of ``engine.reference.demo`` served through a running daemon instead of in process.

Run two of these against one daemon and the second one's requests hit what the first one
stored, through whichever data plane each picked::

    kvstore serve &                                      # http://127.0.0.1:7070
    python -m engine.reference.client_demo --plane shm --json      # same node: shared memory
    python -m engine.reference.client_demo --plane tcp --json      # as a remote engine would

Every loaded block is checked against its prefill. Exit codes: 0 ok, 1 a loaded block differed
(a bug), 2 bad arguments, 3 the daemon could not be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from engine.reference.demo import DEMO_NS, serve, workload
from kvstore.client import connect
from kvstore.errors import DaemonUnavailableError
from kvstore.version import version


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.reference.client_demo",
        description="Serve the demo's multi-turn chats through a kvstore daemon (load cached "
        "prefixes, prefill the rest, store it) and check every loaded block.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--url", default=None, help="daemon URL (default $KVSTORE_URL or http://127.0.0.1:7070)")
    p.add_argument("--token", default=None, help="bearer token (default $KVSTORE_TOKEN)")
    p.add_argument("--plane", default="auto", choices=["auto", "shm", "tcp", "ucx"], help="data plane")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.users < 1 or args.turns < 1:
        p.error("--users and --turns must be at least 1")
    t0 = time.perf_counter()
    try:
        client = connect(args.url, token=args.token, plane=args.plane)
    except DaemonUnavailableError as e:
        print(f"client_demo: {e}", file=sys.stderr)
        return 3
    with client:
        client.register_namespace(DEMO_NS)
        hit = total = 0
        try:
            for prompt in workload(args.users, args.turns, np.random.default_rng(args.seed)):
                h, n = serve(client, prompt)  # type: ignore[arg-type]  # the client has the store's API
                hit += h
                total += n
        except AssertionError as e:
            print(f"client_demo: {e}", file=sys.stderr)
            return 1
        out = {"plane": client.plane, "requests": args.users * args.turns, "blocks": total,
               "hit_blocks": hit, "block_hit_rate": round(hit / total, 4),
               "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"client_demo over {out['plane']}: {out['requests']} requests, {hit}/{total} blocks "
              f"from the cache ({out['block_hit_rate']:.1%}), every loaded block checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
