"""``kvstore serve``: run the daemon.

Exit codes: 0 after a clean shutdown (SIGTERM, SIGINT), 2 bad arguments or configuration,
1 the daemon could not start or failed (a port in use, an unwritable data directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.config import load_config
from kvstore.errors import ConfigError, KVStoreError
from kvstore.server import requestlog
from kvstore.version import version


def _serve(args: argparse.Namespace) -> int:
    from kvstore.server.config import load_server_config
    from kvstore.server.daemon import Daemon

    overrides: dict[str, Any] = {}
    for key in ("host", "http_port", "data_port", "ucx_port", "ucx"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    store_over = {"root": args.data_dir} if args.data_dir is not None else {}
    problem = _data_dir_problem(args.data_dir) if args.data_dir is not None else None
    if problem:
        code, why = problem
        print(f"kvstore serve: --data-dir {args.data_dir}: {why}", file=sys.stderr)
        return code
    try:
        store_cfg = load_config(args.config, **store_over)
        server_cfg = load_server_config(args.config, **overrides)
    except ConfigError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 2

    def ready(info: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            ucx = f", ucx port {info['ucx_port']}" if info["ucx_port"] else ""
            print(f"kvstore daemon ready: {info['url']} (data port {info['data_port']}{ucx}; "
                  f"store {info['root']})", flush=True)

    # Everything the daemon writes (slab, objects, namespaces.json with tenant salts, the event
    # log, pins.json, server-secret) is for its own user alone: files 0600, directories 0700.
    os.umask(0o077)
    _not_dumpable()
    try:
        requestlog.configure(args.request_log)
    except OSError as e:
        print(f"kvstore serve: --request-log {args.request_log}: cannot open it ({e.strerror})", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=_loop_factory(server_cfg.ucx)) as runner:
            runner.run(Daemon(store_cfg, server_cfg).serve(ready))
        # stderr: with --json, stdout carries the one ready line a parent reads.
        print(f"kvstore daemon stopped: requests in flight finished, store {store_cfg.root} closed",
              file=sys.stderr, flush=True)
    except ConfigError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 2
    except (KVStoreError, OSError) as e:
        print(f"kvstore serve: cannot run the daemon: {e}", file=sys.stderr)
        return 1
    return 0


def _not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: processes of the daemon's own user can no longer ptrace it or open its
    /proc/<pid>/fd and /proc/<pid>/mem (only root can), so the arena and staging descriptors
    reach only the clients the daemon hands them to. No core dumps either."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")
    except (OSError, AttributeError) as e:
        logging.getLogger(__name__).warning("cannot make the daemon non-dumpable (%s): processes of "
                                            "its user can read its memory", e)


def _data_dir_problem(path: Path) -> tuple[int, str] | None:
    """What keeps ``--data-dir`` from being a store directory, with the exit code: 2 for a
    usage mistake (a file, not a directory), 1 for a directory the daemon cannot write (it
    cannot start; the module's docstring). Named by the flag (the store's own message names
    the TOML key)."""
    if path.exists() and not path.is_dir():
        return 2, "is a file, not a directory; pass a directory (it is created if missing)"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return 2, f"{probe} is a file, not a directory; pass a path under a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "it" if probe == path else f"{probe}"
        return 1, f"{where} is not writable by this user; pass a directory it may write, or fix its permissions"
    return None


def _loop_factory(ucx: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop (from uvicorn[standard]) roughly halves the control plane's per-request overhead;
    ucxx drives the standard asyncio loop, so UCX keeps that one."""
    if ucx:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore", description="kvstore: a tiered KV-cache store for LLM inference.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run the daemon (one per node)",
        description="Run the kvstore daemon: control plane over HTTP, data plane over shared "
        "memory, framed TCP and (optionally) UCX. Without --config: embedded defaults under "
        "--data-dir, loopback only. Stops gracefully on SIGTERM or SIGINT.",
    )
    s.add_argument("--config", type=Path, default=None, help="TOML file with [store], [[tiers]], [server], [[tenants]]")
    s.add_argument("--data-dir", type=Path, default=None, help="store directory (overrides [store] root; default ./kvstore-data)")
    s.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    s.add_argument("--http-port", type=int, default=None, help="control-plane port (default 7070; 0 picks a free one)")
    s.add_argument("--data-port", type=int, default=None, help="TCP data-plane port (default 7071; 0 picks a free one)")
    s.add_argument("--ucx", action=argparse.BooleanOptionalAction, default=None, help="enable the UCX data plane")
    s.add_argument("--ucx-port", type=int, default=None, help="UCX port (default 7072; 0 picks a free one)")
    s.add_argument("--json", action="store_true", help="print one JSON line with the bound addresses when ready")
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    s.add_argument("--request-log", metavar="FILE", default=None,
                   help="one JSON line per HTTP request to FILE ('-': stderr); default off")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
