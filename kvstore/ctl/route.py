"""``kvctl route``: which of several daemons holds a prompt's longest cached prefix, on which tier.

Follows each ``--node NAME=URL``'s KV event stream (``[events] publish`` on the daemon) until
it has caught up, then answers once; ``--serve PORT`` keeps following and answers
``POST /route`` (``python -m kvstore.route``'s server).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstore.ctl.backends import BadUsage
from kvstore.ctl.tokens import parse_ids
from kvstore.keys import Namespace
from kvstore.route.router import Router
from kvstore.route.service import follow, parse_nodes
from kvstore.route.service import main as serve_main


def register(cmd: Any) -> None:
    p = cmd("route", "which node holds a prompt's longest cached prefix (several daemons)",
            "Follow the KV event streams of several daemons and say which node holds the longest "
            "cached prefix of a prompt, on which tiers (a cold prompt: the node the consistent "
            "hash picks). The prompt is --hashes, or --tokens with the --namespace it is hashed "
            "under. --serve runs a router process instead.")
    p.add_argument("--node", action="append", required=True, metavar="NAME=URL",
                   help="a daemon (http://...) or its event stream (tcp://...); repeat per node")
    p.add_argument("--namespace", type=Path, help="a JSON file of the namespace (Namespace.to_dict()), with --tokens")
    p.add_argument("--tokens", help="token ids: '1,2,3' or a JSON list")
    p.add_argument("--hashes", help="the prompt's block hashes (as a client computes them), comma separated")
    p.add_argument("--tenant", default="", help="route as this tenant (with --all-tenants)")
    p.add_argument("--all-tenants", action="store_true", help="follow every tenant's stream (an admin token)")
    p.add_argument("--serve", type=int, metavar="PORT", help="run a router process on 127.0.0.1:PORT (0: any)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.serve is not None:
        argv = [x for n in args.node for x in ("--node", n)] + ["--port", str(args.serve), "--tenant", args.tenant]
        if args.token:
            argv += ["--token", args.token]
        return serve_main(argv + (["--all-tenants"] if args.all_tenants else []))
    try:
        nodes = parse_nodes(args.node)
    except ValueError as e:
        raise BadUsage(str(e)) from None
    with Router(tenant=args.tenant) as router:
        follow(router, nodes, args.token, args.all_tenants)
        router.refresh()
        if args.hashes:
            r = router.route_hashes([bytes.fromhex(h.strip()) for h in args.hashes.split(",") if h.strip()])
        elif args.tokens and args.namespace:
            ns = Namespace.from_dict(json.loads(args.namespace.read_text()))
            r = router.route(ns, parse_ids(args.tokens))
        else:
            raise BadUsage("route needs --hashes, or --tokens with --namespace")
    out = {"node": r.node, "blocks": r.blocks, "tiers": r.tiers, "reason": r.reason, "matched": r.matched}
    if args.json:
        print(json.dumps(out))
    else:
        tiers = ", ".join(f"{n} {t}" for t, n in r.tiers.items()) or "none cached"
        print(f"{r.node}: {r.blocks} blocks ({tiers}); by {r.reason}")
        for name, n in r.matched.items():
            print(f"  {name:<16} {n} blocks", file=sys.stdout)
    return 0
