"""peers: kvstore side by side with LMCache and Mooncake Store, one workload, one run.

``python -m tools.bench peers [--json] [--quick] [--only NAMES] ...`` (``--help`` explains;
``make bench-peers`` builds ``.venv-peers`` with the peers and runs it).

Every store gets the same workload (``tools/bench/_peers/workload.py``): Llama-3-8B geometry
(32 layers, 8 KV heads, head_dim 128, bf16), 256-token chunks, requests of 4,096 and 32,768
tokens, a DRAM capacity equal for all with LRU eviction, bytes checked equal on every load.
Figures per store and request size, each with a baseline measured in the same process:

* ``{peer}_{size}_store`` / ``_retrieve``: GB/s; baseline: a one-thread memcpy of the same
  bytes; ``{peer}_{size}_store_vs_mt_memcpy`` / ``_retrieve_vs_mt_memcpy``: the same GB/s
  against a memcpy by ``memcpy_threads`` threads at once (``default_copy_threads()``, kvstore's default
  ``copy_threads``), so that a store copying with several threads is read against both;
* ``{peer}_{size}_lookup``: median ms of a lookup of a cached request; baseline: hashing its
  tokens (``kvstore.keys.hash_blocks``);
* ``{peer}_{size}_retrieve_p99_8_clients``: p99 ms of one retrieve while 8 clients retrieve;
  baseline: the median ms of one retrieve alone.

Then, across stores: ``{kvstore}_vs_{peer}_{size}_{store|retrieve}`` (value: kvstore's GB/s,
baseline: the peer's), with the goal ratio where the issue states one (kvstore in process
>= 1.2x LMCache's CPU backend, >= 1x Mooncake Store). A peer that cannot be installed or
started prints a row with ``status: unavailable`` and the error, and the others go on.

Each store runs in its own process (its memory is freed before the next; a crash stays
there), one after another, so they never share the two cores. With ``--paired`` the named stores
run together in one process instead, request by request (each request stored into and then
retrieved from every store, the order rotating), so that a loaded machine's moments hit them
alike; the comparison rows then add the call-by-call ratios.

``--device cuda``: one prefix restored into a vLLM-layout paged KV cache on the GPU, kvstore's
GPU load path against LMCache 0.5.3's CUDA connector (``tools/bench/_peers/paged.py``;
``--device cpu`` runs that code with the cache in host memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstore.units import parse_size
from kvstore.version import version
from tools.bench._common import emit, missed_goals, result
from tools.bench._peers import PEERS
from tools.bench._peers.workload import Geometry, Workload

SIZES = (4096, 32768)
QUICK_SIZES = (1024,)
KVSTORES = ("kvstore", "kvstore-shm", "kvstore-tcp")
# The goals: kvstore (in process) against each peer, store and retrieve alike.
GOALS = {"lmcache-cpu": 1.2, "mooncake": 1.0}
OTHERS = ("lmcache-cpu", "lmcache-cpu-mt", "lmcache-disk", "lmcache-redis", "mooncake")
PRIVATE_NETNS = ("mooncake",)  # its client binds every interface: run it where only loopback is
TIMEOUT_S, QUICK_TIMEOUT_S = 1800, 600
LONG = 8192  # past this many tokens a request is "long": 1 fits, 2 rounds, 1 retrieve per client


def label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def select(only: str | None) -> list[str]:
    """Peers named by ``--only``, in run order: a peer's name, or a family (``lmcache``, or a
    prefix ending in ``*``: ``kvstore*`` is kvstore in process and through its daemon)."""
    if not only:
        return list(PEERS)

    def picks(item: str, peer: str) -> bool:
        if item.endswith("*"):
            return peer.startswith(item[:-1])
        return peer == item or (item not in PEERS and peer.startswith(item + "-"))

    want = [x.strip() for x in only.split(",") if x.strip()]
    unknown = [x for x in want if not any(picks(x, p) for p in PEERS)]
    if unknown:
        raise SystemExit(f"--only: unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)} "
                         "(or a family: lmcache, kvstore*)")
    return [p for p in PEERS if any(picks(x, p) for x in want)]


def workload(args: argparse.Namespace, tokens: int) -> Workload:
    g = Geometry(layers=args.layers) if args.layers else Geometry()
    # A 32K-token request is 4 GiB: one fits (the box has 23 GiB for everyone) and 2 rounds; in
    # the concurrent phase there each of the 8 clients loads it once (8 x 4 GiB in flight, into
    # one shared destination: see workload._concurrent); --skip-concurrent-long leaves it out.
    small = tokens <= LONG
    fit = args.fit or (2 if args.quick else 4 if small else 1)
    rounds = args.rounds or (2 if args.quick or not small else 3)
    return Workload(tokens=tokens, fit=fit, rounds=rounds, lookups=3 if args.quick else 10,
                    clients=args.clients, per_client=2 if small and not args.quick else 1,
                    concurrent=small or not args.skip_concurrent_long, geometry=g, scratch=args.dir,
                    copy_threads=args.copy_threads)


def peer_rows(peer: str, w: Workload, res: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one peer at one size from its child's result (the result math)."""
    size = label(w.tokens)
    if "figures" not in res:
        status = "unavailable" if "unavailable" in res else "failed"
        return [{"bench": "peers", "metric": f"{peer}_{size}_{status}", "peer": peer, "tokens": w.tokens,
                 "status": status, "error": res.get(status, "no result")}]
    f = res["figures"]
    common = {"peer": peer, "tokens": w.tokens, "request_bytes": w.request_bytes,
              "capacity_bytes": w.capacity_bytes, "chunk_tokens": w.geometry.chunk_tokens,
              "verified": res["wrong_chunks"] == 0 and res["missing_tokens"] == 0,
              "wrong_chunks": res["wrong_chunks"], "missing_tokens": res["missing_tokens"],
              **({"errors": res["errors"], "error_count": res["error_count"]} if res["errors"] else {}),
              **res["info"]}
    return [
        result("peers", f"{peer}_{size}_store", f["store_gbps"], "GB/s", f["memcpy_gbps"],
               first_round_gbps=round(f["first_round_gbps"], 4), **common),
        result("peers", f"{peer}_{size}_retrieve", f["retrieve_gbps"], "GB/s", f["memcpy_gbps"], **common),
        *(result("peers", f"{peer}_{size}_{op}_vs_mt_memcpy", f[f"{op}_gbps"], "GB/s", f["memcpy_mt_gbps"],
                 memcpy_threads=f["memcpy_threads"], peer=peer, tokens=w.tokens)
          for op in ("store", "retrieve")),
        result("peers", f"{peer}_{size}_lookup", f["lookup_ms"], "ms", f["hash_ms"], peer=peer, tokens=w.tokens),
        result("peers", f"{peer}_{size}_retrieve_p99_{w.clients}_clients", f["concurrent_p99_ms"], "ms",
               f["retrieve_p50_ms"], p50_ms=round(f["concurrent_p50_ms"], 3),
               samples=res["samples"]["concurrent"], peer=peer, tokens=w.tokens)
        if res["samples"]["concurrent"] else
        {"bench": "peers", "metric": f"{peer}_{size}_retrieve_p99_{w.clients}_clients_skipped", "peer": peer,
         "tokens": w.tokens, "status": "skipped",
         "error": "not run for long requests (--skip-concurrent-long)" if not w.concurrent else
         "serves one call at a time here (tools/bench/_peers/lmcache.py): a p99 would be the queue"},
    ]


def compare(w: Workload, figures: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """kvstore against each peer that ran at this size: store and retrieve GB/s."""
    size = label(w.tokens)
    out = []
    for kv in KVSTORES:
        if kv not in figures:
            continue
        peers = OTHERS if kv == "kvstore" else ("lmcache-cpu", "mooncake")
        for peer in peers:
            if peer not in figures:
                continue
            for op in ("store", "retrieve"):
                goal = GOALS.get(peer) if kv == "kvstore" else None
                metric = f"{kv}_vs_{peer}_{size}_{op}"
                bad = [x for x in (kv, peer) if not figures[x].get("verified", True) or not figures[x][f"{op}_gbps"]]
                if bad:  # a store that lost cached requests has no comparable figure
                    out.append({"bench": "peers", "metric": metric, "tokens": w.tokens, "status": "not comparable",
                                "error": f"{', '.join(bad)} did not hold every cached request (missing tokens; "
                                         f"see its {size} rows)", "goal_ratio": goal})
                    continue
                out.append(result("peers", metric, figures[kv][f"{op}_gbps"], "GB/s",
                                  figures[peer][f"{op}_gbps"], goal_ratio=goal, tokens=w.tokens,
                                  **paired_ratios(figures[kv], figures[peer], op)))
    return out


def paired_ratios(kv: dict[str, Any], peer: dict[str, Any], op: str) -> dict[str, Any]:
    """For stores driven together (``--paired``): kvstore's speed over the peer's, call by call
    (the same request, moments apart): the median, the range and the count. Empty otherwise."""
    if not (kv.get("paired") and peer.get("paired")):
        return {}
    a, b = kv["lat"][op], peer["lat"][op]
    ratios = sorted(y / x for x, y in zip(a, b, strict=False) if x > 0 and y > 0)
    if not ratios:
        return {}
    return {"paired_median_ratio": round(statistics.median(ratios), 4), "paired_min_ratio": round(ratios[0], 4),
            "paired_max_ratio": round(ratios[-1], 4), "paired_calls": len(ratios)}


def _command(peers: list[str], spec: Path) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "tools.bench._peers.child", str(spec)]
    env = dict(os.environ)
    if set(peers) & set(PRIVATE_NETNS) and os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        env["PEERS_NETNS"] = "private"
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
    return cmd, env


def run_child(peer: str | list[str], w: Workload, tmp: Path, timeout: float) -> dict[str, Any]:
    """One peer (or, given a list, those peers driven together) in its own process group (its
    servers too); killed as a group on timeout."""
    peers = [peer] if isinstance(peer, str) else list(peer)
    tag = peers[0] if isinstance(peer, str) else "paired"
    spec, out, log = tmp / f"{tag}.json", tmp / f"{tag}.out.json", tmp / f"{tag}.log"
    wd = asdict(w)
    who = {"peer": peer} if isinstance(peer, str) else {"peers": peers}
    spec.write_text(json.dumps({**who, "workload": wd, "out": str(out)}))
    # The file names repeat from size to size: a child that dies without a result must not
    # leave the last size's result to be read as its own (a 32K LMCache-Redis child did).
    out.unlink(missing_ok=True)
    cmd, env = _command(peers, spec)
    with log.open("wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"failed": f"timed out after {timeout:.0f} s; log: {_tail(log)}"}
        finally:  # this process interrupted: the child and its servers go too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if not out.exists():
        return {"failed": f"exit {rc} without a result; log: {_tail(log)}"}
    res = json.loads(out.read_text())
    if "failed" in res:
        res["failed"] += f"; log: {_tail(log)}"
    return res


def _tail(log: Path, n: int = 800) -> str:
    return log.read_text(errors="replace")[-n:].strip() if log.exists() else ""


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    peers = select(getattr(args, "only", None))
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    timeout = args.timeout or (QUICK_TIMEOUT_S if args.quick else TIMEOUT_S)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peers-run-", dir=args.dir) as d:
        for tokens in sizes:
            w = workload(args, tokens)
            figures: dict[str, dict[str, Any]] = {}
            paired = getattr(args, "paired", False)
            together = run_child(peers, w, Path(d), timeout * len(peers)) if paired else {}
            for peer in peers:
                res = together.get("paired", {}).get(peer, together) if paired else run_child(peer, w, Path(d), timeout)
                if "figures" in res:
                    ok = res["missing_tokens"] == 0 and res["wrong_chunks"] == 0
                    figures[peer] = {**res["figures"], "verified": ok, "lat": res.get("lat", {}), "paired": paired}
                yield from ({**r, "paired": paired} if paired else r for r in peer_rows(peer, w, res))
            yield from compare(w, figures)


def paged_rows(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """``--device cuda|cpu``: the paged-KV restore bench (``tools/bench/_peers/paged.py``)."""
    from engine import transfer
    from tools.bench._peers import paged, paged_run

    want = [x.strip() for x in (args.only or ",".join(paged.PEERS)).split(",") if x.strip()]
    unknown = [x for x in want if x not in paged.PEERS]
    if unknown:
        raise SystemExit(f"--only with --device {args.device}: unknown store(s) {', '.join(unknown)}; "
                         f"known: {', '.join(paged.PEERS)}")
    only = tuple(p for p in paged.PEERS if p in want)
    sizes = args.sizes or ((1024,) if args.quick else paged.SIZES)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    if args.tail_parts < 0:
        raise SystemExit(f"--tail-parts {args.tail_parts}: give 1 or more parts (0: the default)")
    default = transfer.TAIL_PARTS
    if args.tail_parts:
        transfer.TAIL_PARTS = args.tail_parts  # every loader made during the run reads it
    try:
        yield from paged_run.run(args.device, sizes, layers=args.layers or 32, trials=args.rounds, only=only,
                                 scratch=args.dir, log=log, copy_threads=args.copy_threads,
                                 paired=args.paired, piece_bytes=args.piece_bytes, page_kernel=args.page_kernel)
    finally:  # (an in-process caller's later loaders get the library's default back)
        transfer.TAIL_PARTS = default


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench peers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1],
        epilog=f"peers: {', '.join(PEERS)}. Needs .venv-peers (make bench-peers) for LMCache and Mooncake; "
               "without it those print 'unavailable' rows.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {label(QUICK_SIZES[0])}-token requests, 2 rounds")
    p.add_argument("--only", metavar="NAMES", help="comma-separated peers or families to run (lmcache, kvstore*: "
                   "in process and through the daemon; default: all)")
    p.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")), metavar="TOKENS,...",
                   help=f"request sizes in tokens (default {','.join(map(str, SIZES))})")
    p.add_argument("--fit", type=int, default=0, help="requests the capacity holds (default 4 up to 8K tokens, else 1)")
    p.add_argument("--rounds", type=int, default=0, help="store and retrieve rounds (default 3; 2 past 8K tokens)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--skip-concurrent-long", action="store_true",
                   help=f"leave out the concurrent phase past {LONG} tokens (8 x 4 GiB in flight at 32K)")
    p.add_argument("--layers", type=int, default=0, help="layers of the geometry (default 32; fewer for smoke tests)")
    p.add_argument("--dir", default=".", help="scratch directory on the disk (stores' files, LMCache's disk backend)")
    p.add_argument("--timeout", type=float, default=0, help="seconds one peer at one size may take")
    p.add_argument("--check", action="store_true", help="exit 3 when a figure misses its goal")
    p.add_argument("--copy-threads", type=int, default=0, metavar="N",
                   help="kvstore in process (and kvstore on --device): its DRAM tier's copy_threads "
                        "(default 0: its default, from the cores)")
    p.add_argument("--piece-bytes", type=parse_size, default=0, metavar="SIZE",
                   help="--device: the restore's tile and the save's piece of kvstore's GPU rows (the "
                        "connector's piece_bytes; default its default, 128MiB)")
    p.add_argument("--page-kernel", action="store_true",
                   help="--device: kvstore's rows copy every layer's pages in one Triton kernel launch "
                        "(engine.pagecopy; the connector's page_kernel), where Triton is installed")
    p.add_argument("--tail-parts", type=int, default=0, metavar="N",
                   help="--device: kvstore's rows cut a restore's last tile into N shrinking parts "
                        "(engine.transfer.TAIL_PARTS; default 0: its default, 4; 1: not cut)")
    p.add_argument("--paired", action="store_true",
                   help="drive the peers together in one process, interleaved call by call (each request stored "
                        "into, then retrieved from, every peer in turn), so that all see the same moments of the "
                        "machine; the comparison rows add the call-by-call ratios (paired_median_ratio). Memory: "
                        "every peer's capacity at once. With --device: every store open at once, saves and "
                        "restores in turn (each round in another order)")
    p.add_argument("--device", choices=("host", "cuda", "cpu"), default="host",
                   help="host (default): the workload above, host buffers; cuda: one prefix restored into a "
                        "vLLM-layout paged KV cache on the GPU, kvstore against LMCache's CUDA connector "
                        "(tools/bench/_peers/paged.py); cpu: that paged bench with the cache in host memory "
                        "(a smoke run; LMCache's connector is CUDA only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # SIGTERM as an exception, so that run_child's finally takes the running store down with us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    missed = 0
    rows = run(args) if args.device == "host" else paged_rows(args)
    for row in rows:
        if "value" in row:
            emit(row, args.json)
            if args.check:
                for miss in missed_goals(row):
                    missed += 1
                    print(f"MISSED {row['metric']}: {miss}", file=sys.stderr, flush=True)
        else:
            print(json.dumps(row) if args.json else f" peers {row['metric']:<28} {row['error']}", flush=True)
    return 3 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
