"""Run a benchmark: ``python -m tools.bench {hash,nvme,index,all} [--json]``.

Each prints one line per figure; with ``--json`` one JSON object per line with ``bench``,
``metric``, ``value``, ``unit``, ``baseline`` (measured in the same run) and ``ratio``.
Exit codes: 0 ok, 2 bad arguments, 1 a benchmark failed; with ``--check``, 3 when a figure
misses the goal its row states (``goal_ms``, ``goal_ratio``...: see ``_common.missed_goals``),
for scripts and release checks (CI's tests never time anything).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvstore.version import version
from tools.bench._common import emit, missed_goals

BENCHES = {
    "hash": "tools.bench.hash",
    "index": "tools.bench.index",
    "nvme": "tools.bench.nvme",
    "store": "tools.bench.store",  # the in-process put / get_into path
    "restart": "tools.bench.restart",
    "s3": "tools.bench.s3",  # starts its own moto_server on loopback
    "gpu_load": "tools.bench.gpu_load",
    "ttft": "tools.bench.ttft",
    "overlap": "tools.bench.overlap",
    "throughput": "tools.bench.throughput",  # batched prefill, hits from DRAM and HBM
    "hybrid": "tools.bench.hybrid",  # sliding-window models: bytes, replay; TTFT on CUDA
    # the daemon: each starts its own daemon on loopback
    "touch": "tools.bench.touch",  # the policy's share of a 2,048-block lease
    "shm": "tools.bench.shm",
    "tcp": "tools.bench.tcp",
    "ucx": "tools.bench.ucx",
    "rpc": "tools.bench.rpc",
    "concurrent": "tools.bench.concurrent",
    "put_device": "tools.bench.put_device",  # a GPU save's daemon time, on a fake CUDA runtime
    "outage": "tools.bench.outage",  # the engine's cost while its daemon is down
    # vLLM's CPU build with the kvstore connector; needs .venv-vllm
    "vllm": "tools.bench.vllm",
    # KV events, the router and the handoff; starts its own daemons
    "route": "tools.bench.route",
}
# Benchmarks with their own arguments (``python -m tools.bench NAME --help``), not in ``all``:
# kvstore beside LMCache and Mooncake Store; needs .venv-peers (make bench-peers).
OWN_CLI = {"peers": "tools.bench.peers"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN_CLI:
        return importlib.import_module(OWN_CLI[argv[0]]).main(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description="kvstore benchmarks. Each figure is printed with a baseline measured in the "
        "same run (ratio = value / baseline), so results survive a noisy machine.",
    )
    p.add_argument("name", choices=[*BENCHES, "all", *OWN_CLI], help="which benchmark to run "
                   f"({', '.join(OWN_CLI)}: own arguments, see NAME --help)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--quick", action="store_true", help="smaller sizes (for smoke tests)")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (nvme); default: a temp dir under ./")
    p.add_argument("--layer-groups", type=int, default=16, help="ttft/overlap: layer groups loaded one after another (default 16)")
    p.add_argument("--smoke", action="store_true", help="throughput: a tiny CPU model (plumbing check, figures meaningless)")
    p.add_argument("--hit", type=float, action="append", help="throughput: hit rate(s) to run (default 0.5 0.8 0.96 0.99)")
    p.add_argument("--attention", default="varlen", choices=["varlen", "loop"], help="throughput: attention backend on CUDA")
    p.add_argument("--hbm-gib", type=float, default=0.0, help="throughput: HBM cache budget (default: the stream's blocks)")
    p.add_argument("--model", default="llama", choices=["llama", "mla"],
                   help="throughput: Llama-3-8B, or a scaled-down DeepSeek-V3 with a latent (MLA) cache")
    p.add_argument("--conversations", type=int, default=0, help="throughput: concurrent conversations (default 16)")
    p.add_argument("--check-requests", type=int, default=2,
                   help="throughput: conversations whose last prompt is checked against the request run alone (default 2)")
    p.add_argument("--repeat", type=int, default=1, help="throughput: run the hit rates this many times (the spread)")
    p.add_argument("--no-compare-attention", dest="compare_attention", action="store_false",
                   help="throughput: skip timing the ideal with the per-request attention loop")
    p.add_argument("--workload", default="standard", choices=["standard", "qps", "overhead", "families"],
                   help="vllm: standard (long-document and sequential multi-round QA), qps "
                   "(multi-round QA at a fixed request rate, several requests in flight), overhead "
                   "(the connector's cost per request when it has nothing to load) or families (one "
                   "row per model family: dense, fp8, MLA, sliding windows)")
    p.add_argument("--qps", type=float, default=0.0, help="vllm --workload qps: requests per second (default 0.5)")
    p.add_argument("--tp", type=int, default=1, help="vllm: tensor-parallel size (2: long-document QA at TP=2)")
    p.add_argument("--check", action="store_true",
                   help="exit 3 when a figure misses its goal (each miss is named on stderr)")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    args = p.parse_args(argv)
    names = list(BENCHES) if args.name == "all" else [args.name]
    missed = 0
    for name in names:
        mod = importlib.import_module(BENCHES[name])
        for row in mod.run(args):
            emit(row, args.json)
            if args.check:
                for miss in missed_goals(row):
                    missed += 1
                    print(f"MISSED {row['bench']}/{row['metric']}: {miss}", file=sys.stderr, flush=True)
    if args.check:
        print(f"--check: {missed} figure(s) missed a goal" if missed else "--check: every goal met",
              file=sys.stderr)
    return 3 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
