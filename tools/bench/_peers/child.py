"""One peer at one request size, in its own process: ``python -m tools.bench._peers.child SPEC``.

``SPEC`` is a JSON file: ``peer`` (a name in ``PEERS``), ``workload`` (``Workload`` fields, the
geometry's under ``geometry``) and ``out``, where this process writes one JSON object: the
figures (``Figures.summary``), the peer's ``info``, the checks (``missing_tokens``,
``wrong_chunks``, ``errors``), or ``unavailable`` (it cannot run here) or ``failed`` (it
raised) with the reason.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from tools.bench._peers import PEERS
from tools.bench._peers.base import Adapter, PeerUnavailable
from tools.bench._peers.workload import Geometry, Workload, drive


def workload_from(spec: dict[str, Any]) -> Workload:
    fields = dict(spec)
    fields["geometry"] = Geometry(**fields.get("geometry", {}))
    return Workload(**fields)


def make_adapter(peer: str) -> Adapter:
    module, cls = PEERS[peer].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # the peer's package is missing: that peer only
        raise PeerUnavailable(f"cannot import {module}: {e}; run make bench-peers") from e
    return getattr(mod, cls)()


def run_peer(peer: str, w: Workload) -> dict[str, Any]:
    """Open, drive and close one peer; PeerUnavailable if it cannot run here."""
    adapter = make_adapter(peer)
    adapter.open(w)
    try:
        f = drive(adapter, w)
        info = adapter.info()
    finally:
        adapter.close()
    return {"figures": f.summary(), "info": info, "missing_tokens": f.missing_tokens,
            "wrong_chunks": f.wrong_chunks, "errors": f.errors[:5], "error_count": len(f.errors),
            "samples": {"lookup": len(f.lookup_lat), "retrieve": len(f.retrieve_lat),
                        "concurrent": len(f.concurrent_lat)}}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(spec["out"])
    try:
        res = run_peer(spec["peer"], workload_from(spec["workload"]))
    except PeerUnavailable as e:
        res = {"unavailable": str(e)}
    except Exception as e:  # reported as a row (with the trace on stderr); the bench goes on
        traceback.print_exc()
        res = {"failed": f"{type(e).__name__}: {e}"}
    out.write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a peer's stuck non-daemon thread (LMCache's) must not keep this process
