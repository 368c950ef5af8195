"""One peer at one request size, in its own process: ``python -m tools.bench._peers.child SPEC``.

``SPEC`` is a JSON file: ``peer`` (a name in ``PEERS``), ``workload`` (``Workload`` fields, the
geometry's under ``geometry``) and ``out``, where this process writes one JSON object: the
figures (``Figures.summary``), the peer's ``info``, the checks (``missing_tokens``,
``wrong_chunks``, ``errors``), each call's seconds (``lat``), or ``unavailable`` (it cannot run
here) or ``failed`` (it raised) with the reason. With ``peers`` (a list) instead of ``peer``,
those peers run together in this process (``--paired``): ``{"paired": {peer: result}}``.
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
from tools.bench._peers.workload import Figures, Geometry, Workload, drive, drive_paired


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
    return _result(f, info)


def _result(f: Figures, info: dict[str, Any]) -> dict[str, Any]:
    return {"figures": f.summary(), "info": info, "missing_tokens": f.missing_tokens,
            "wrong_chunks": f.wrong_chunks, "errors": f.errors[:5], "error_count": len(f.errors),
            "samples": {"lookup": len(f.lookup_lat), "retrieve": len(f.retrieve_lat),
                        "concurrent": len(f.concurrent_lat)},
            "lat": {"store": [round(x, 6) for x in f.store_lat], "retrieve": [round(x, 6) for x in f.retrieve_lat]}}


def run_paired(peers: list[str], w: Workload) -> dict[str, dict[str, Any]]:
    """Several peers in this process, driven together (``drive_paired``): one result per peer; a
    peer that cannot open gets its ``unavailable`` / ``failed`` result and the others run."""
    opened: dict[str, Adapter] = {}
    out: dict[str, dict[str, Any]] = {}
    try:
        for peer in peers:
            try:
                a = make_adapter(peer)
                a.open(w)
                opened[peer] = a
            except PeerUnavailable as e:
                out[peer] = {"unavailable": str(e)}
            except Exception as e:  # reported as that peer's row; the others run
                traceback.print_exc()
                out[peer] = {"failed": f"{type(e).__name__}: {e}"}
        if opened:
            figs = drive_paired(opened, w)
            for peer, a in opened.items():
                out[peer] = _result(figs[peer], a.info())
    finally:
        for a in opened.values():
            a.close()
    return {p: out[p] for p in peers}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(spec["out"])
    try:
        w = workload_from(spec["workload"])
        res = {"paired": run_paired(spec["peers"], w)} if "peers" in spec else run_peer(spec["peer"], w)
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
