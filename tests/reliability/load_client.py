"""One process of the load test's clients: ``threads`` clients (half shared memory, half TCP)
run the verifying workload against a daemon for ``seconds``; prints the tally as JSON.

Usage: python -m tests.reliability.load_client URL THREADS SECONDS PROCESS PRELOADED
"""

from __future__ import annotations

import json
import sys

from kvstore.client import connect
from tests.reliability.harness import run_workers


def main() -> None:
    url, threads, seconds, proc, preloaded = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    clients = [connect(url, plane="shm" if i % 2 else "tcp") for i in range(threads)]
    try:
        # Mostly reads, as an engine fleet does: 50% lookups, 35% loads, 15% puts.
        tally = run_workers(clients, seconds, first=(proc + 1) * 1_000_000, seed=proc,
                            mix=(0.15, 0.35, 0.50), preloaded=preloaded)
    finally:
        for c in clients:
            c.close()
    json.dump(tally.to_json(), sys.stdout)


if __name__ == "__main__":
    main()
