"""The router as a process: ``python -m kvstore.route --node a=URL --node b=URL [--port P]``.

HTTP on 127.0.0.1 (stdlib server, one thread per connection):

* ``POST /route`` ``{"hashes": [hex, ...]}`` or ``{"namespace": Namespace.to_dict(), "tokens":
  [...]}``, optional ``"tenant"`` -> ``{"node", "blocks", "tiers", "reason", "matched"}``;
* ``GET /stats`` -> the router's index and feeds.

Prints one JSON line when ready (``{"url": ..., "pid": ...}``); stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.route.router import Router
from kvstore.version import version


def parse_nodes(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "tcp://")):
            raise ValueError(f"--node {item!r}: expected NAME=http://HOST:PORT (a daemon) or NAME=tcp://HOST:PORT (its events)")
        out.append((name, url))
    return out


def follow(router: Router, nodes: list[tuple[str, str]], token: str | None, all_tenants: bool) -> None:
    for name, url in nodes:
        if url.startswith("tcp://"):
            router.add_node(name, publish=url, token=token, all_tenants=all_tenants)
        else:
            router.add_node(name, url, token=token, all_tenants=all_tenants)


def answer(router: Router, body: dict[str, Any], namespaces: dict[str, Namespace]) -> dict[str, Any]:
    tenant = body.get("tenant")
    if "hashes" in body:
        r = router.route_hashes([bytes.fromhex(h) for h in body["hashes"]], tenant=tenant)
    elif "tokens" in body and "namespace" in body:
        key = json.dumps(body["namespace"], sort_keys=True)
        ns = namespaces.get(key)
        if ns is None:
            ns = namespaces[key] = Namespace.from_dict(body["namespace"])
        r = router.route(ns, body["tokens"], tenant=tenant)
    else:
        raise ValueError("send {'hashes': [...]} or {'namespace': {...}, 'tokens': [...]}")
    return asdict(r)


def make_server(router: Router, port: int = 0) -> ThreadingHTTPServer:
    namespaces: dict[str, Namespace] = {}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path != "/route":
                return self._send(404, {"detail": f"no {self.path}; POST /route"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                self._send(200, answer(router, body, namespaces))
            except (ValueError, KeyError, TypeError, KVStoreError) as e:
                self._send(400, {"detail": str(e)})
            except LookupError as e:
                self._send(503, {"detail": str(e)})

        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/stats":
                return self._send(404, {"detail": f"no {self.path}; GET /stats"})
            self._send(200, router.stats())

        def log_message(self, format: str, *args: Any) -> None:
            return  # no access log on stderr

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.route",
                                description="A router process: follows the daemons' KV events and "
                                "answers which node holds a prompt's longest cached prefix.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--node", action="append", required=True, metavar="NAME=URL",
                   help="a daemon (http://...) or its event stream (tcp://...); repeat per node")
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (default: any free one)")
    p.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"), help="bearer token (default $KVSTORE_TOKEN)")
    p.add_argument("--tenant", default="", help="the tenant whose requests are routed by default")
    p.add_argument("--all-tenants", action="store_true", help="follow every tenant's stream (an admin token)")
    p.add_argument("--min-match", type=float, default=0.25, help="share of a prompt a cached prefix must cover to decide (default 0.25)")
    args = p.parse_args(argv)
    try:
        nodes = parse_nodes(args.node)
        router = Router(tenant=args.tenant, min_match=args.min_match)
        follow(router, nodes, args.token, args.all_tenants)
    except (ValueError, KVStoreError) as e:
        print(f"kvstore.route: {e}", file=sys.stderr)
        return 2
    router.start()
    server = make_server(router, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(json.dumps({"url": f"http://127.0.0.1:{server.server_address[1]}", "pid": os.getpid(),
                      "nodes": router.nodes()}), flush=True)
    stop.wait()
    server.shutdown()
    router.close()
    return 0
