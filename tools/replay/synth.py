"""Synthetic traces with reuse structures the shared traces do not have, in the Mooncake format.

Policies are tuned on no trace; these check that the default holds up on workloads it never saw
(``python -m tools.replay.synth KIND --out FILE``, then replay FILE). Every kind ends a request
with a partial block whose id is never reused, as real prompts do (the next turn's prompt grows
that block into a different one).

* ``zipf-prompts``: a few hundred system prompts of 2-24 blocks, picked with Zipf(1.1)
  popularity, each followed by 1-30 blocks of unique user text; Poisson arrivals.
* ``agent-loop``: agents that call a model in a loop, each step's prompt the previous prompt
  plus a tool result of 1-4 blocks, 5-60 steps a few seconds apart, many agents at once.
* ``multi-turn``: chats over a handful of system prompts with exponential think time (60 s
  mean) between turns and a geometric number of turns (mean 4); each turn re-sends the history.
* ``scan``: a hot set of 200 long documents asked about again and again, mixed with a scan of
  one-off documents that never return (the workload that flushes LRU).
* ``coding-agent``: long agentic sessions: a shared system prompt, one of a few repositories'
  context (100-1,500 blocks), then tool loops whose results are heavy-tailed (1-200 blocks), so
  chains reach thousands of blocks; a step may fork a sub-agent from the current history, and
  sessions go idle for minutes between bursts. The workload of issue 12's long chains.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.version import version

KINDS = ("zipf-prompts", "agent-loop", "multi-turn", "scan", "coding-agent")


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def new(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(t_ms: float, full: list[int], ids: _Ids, rng: np.random.Generator, bt: int) -> dict[str, Any]:
    tail = int(rng.integers(1, bt))  # tokens in the partial last block
    return {
        "timestamp": int(t_ms),
        "input_length": len(full) * bt + tail,
        "output_length": int(rng.integers(16, 800)),
        "hash_ids": full + ids.new(1),
    }


def _zipf_prompts(n: int, rng: np.random.Generator, bt: int) -> Iterator[dict[str, Any]]:
    ids = _Ids()
    prompts = [ids.new(int(rng.integers(2, 25))) for _ in range(300)]
    weights = 1.0 / np.arange(1, len(prompts) + 1) ** 1.1
    pick = rng.choice(len(prompts), size=n, p=weights / weights.sum())
    t = 0.0
    for i in range(n):
        t += rng.exponential(250.0)
        yield _request(t, prompts[pick[i]] + ids.new(int(rng.integers(1, 31))), ids, rng, bt)


def _sessions(
    n: int, rng: np.random.Generator, bt: int, ids: _Ids, *, start_gap_ms: float,
    step_gap_ms: float, steps_mean: float, first: Any, grow: Any,
) -> Iterator[dict[str, Any]]:
    """Interleaved sessions: each step re-sends the session's history plus ``grow()`` blocks;
    ``first()`` is a new session's opening history."""
    heap: list[tuple[float, int, list[int], int]] = []
    t, sid, out = 0.0, 0, 0
    while out < n:
        t += rng.exponential(start_gap_ms)
        heapq.heappush(heap, (t, sid, first(), int(rng.geometric(1.0 / steps_mean))))
        sid += 1
        while heap and heap[0][0] <= t and out < n:
            when, s, history, left = heapq.heappop(heap)
            history = history + ids.new(grow())
            yield _request(when, history, ids, rng, bt)
            out += 1
            if left > 1:
                heapq.heappush(heap, (when + rng.exponential(step_gap_ms), s, history, left - 1))


def _agent_loop(n: int, rng: np.random.Generator, bt: int) -> Iterator[dict[str, Any]]:
    ids = _Ids()
    system = ids.new(6)
    return _sessions(
        n, rng, bt, ids, start_gap_ms=400.0, step_gap_ms=3000.0, steps_mean=20.0,
        first=lambda: system + ids.new(int(rng.integers(2, 10))),
        grow=lambda: int(rng.integers(1, 5)),
    )


def _multi_turn(n: int, rng: np.random.Generator, bt: int) -> Iterator[dict[str, Any]]:
    ids = _Ids()
    systems = [ids.new(int(rng.integers(2, 8))) for _ in range(5)]
    return _sessions(
        n, rng, bt, ids, start_gap_ms=300.0, step_gap_ms=60_000.0, steps_mean=4.0,
        first=lambda: list(systems[int(rng.integers(0, len(systems)))]),
        grow=lambda: int(rng.integers(1, 12)),
    )


def _scan(n: int, rng: np.random.Generator, bt: int) -> Iterator[dict[str, Any]]:
    ids = _Ids()
    hot = [ids.new(int(rng.integers(8, 40))) for _ in range(200)]
    t = 0.0
    for _ in range(n):
        t += rng.exponential(200.0)
        if rng.random() < 0.4:
            doc = hot[int(rng.integers(0, len(hot)))]
        else:
            doc = ids.new(int(rng.integers(8, 40)))
        yield _request(t, doc + ids.new(int(rng.integers(0, 3))), ids, rng, bt)


def _coding_agent(n: int, rng: np.random.Generator, bt: int) -> Iterator[dict[str, Any]]:
    ids = _Ids()
    system = ids.new(40)
    repos = [system + ids.new(int(rng.integers(100, 1500))) for _ in range(4)]
    heap: list[tuple[float, int, list[int], int]] = []
    t, sid, out = 0.0, 0, 0
    while out < n:
        t += rng.exponential(5_000.0)
        heapq.heappush(heap, (t, sid, list(repos[int(rng.integers(0, len(repos)))]), int(rng.geometric(1 / 40))))
        sid += 1
        while heap and heap[0][0] <= t and out < n:
            when, s, history, left = heapq.heappop(heap)
            grow = int(min(200, rng.pareto(1.2) * 4 + 1))  # most tool results short, a few huge
            history = history + ids.new(grow)
            yield _request(when, history, ids, rng, bt)
            out += 1
            if rng.random() < 0.05:  # a sub-agent forks from here
                heapq.heappush(heap, (when + rng.exponential(2_000.0), sid, history, int(rng.geometric(1 / 10))))
                sid += 1
            if left > 1:
                idle = rng.exponential(120_000.0) if rng.random() < 0.1 else rng.exponential(4_000.0)
                heapq.heappush(heap, (when + idle, s, history, left - 1))


_GENERATORS = {
    "zipf-prompts": _zipf_prompts,
    "agent-loop": _agent_loop,
    "multi-turn": _multi_turn,
    "scan": _scan,
    "coding-agent": _coding_agent,
}


def generate(kind: str, requests: int, seed: int = 0, block_tokens: int = 512) -> list[dict[str, Any]]:
    """``requests`` records of a trace of ``kind`` (one of :data:`KINDS`)."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(KINDS)}")
    rng = np.random.default_rng(seed)
    recs = list(_GENERATORS[kind](requests, rng, block_tokens))
    recs.sort(key=lambda r: r["timestamp"])  # sessions interleave: keep time order
    return recs


def write_trace(path: str | Path, records: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.replay.synth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--out", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    if args.requests <= 0 or args.block_tokens <= 1:
        print("error: --requests must be positive and --block-tokens above 1", file=sys.stderr)
        return 2
    write_trace(args.out, generate(args.kind, args.requests, args.seed, args.block_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
