"""Request traces in the Mooncake JSONL format, flattened into arrays.

One request a line: ``timestamp`` (ms from the start), ``input_length`` (tokens),
``output_length`` and ``hash_ids`` (one id per block of ``block_tokens`` tokens; equal ids are the
same prefix block, and an id identifies its whole prefix). The last block of a request is partial
when ``input_length`` is not a multiple of the block size; it still has an id, and the replay
treats it like any block (as the published figures do).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.errors import UsageError


class TraceError(UsageError):
    """The trace file is missing or malformed; the message names the line."""


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    timestamps_ms: np.ndarray
    """Per request, non-decreasing."""
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    offsets: np.ndarray
    """Request ``r``'s blocks are ``block_ids[offsets[r]:offsets[r + 1]]``."""
    block_ids: np.ndarray
    """Dense ids ``0..unique_blocks-1`` in order of first appearance."""
    unique_blocks: int

    @property
    def num_requests(self) -> int:
        return int(self.timestamps_ms.size)

    @property
    def num_blocks(self) -> int:
        return int(self.block_ids.size)

    def blocks(self, r: int) -> np.ndarray:
        return self.block_ids[self.offsets[r] : self.offsets[r + 1]]

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (for quick runs and tests), ids renumbered."""
        n = min(n, self.num_requests)
        ids, unique = _dense_ids(self.block_ids[: self.offsets[n]])
        return Trace(
            self.name,
            self.timestamps_ms[:n],
            self.input_tokens[:n],
            self.output_tokens[:n],
            self.offsets[: n + 1],
            ids,
            unique,
        )


def _dense_ids(raw: np.ndarray) -> tuple[np.ndarray, int]:
    """Renumber ids ``0..u-1`` in order of first appearance; returns them and ``u``."""
    _, first, dense = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.empty(first.size, np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    return rank[dense.reshape(-1)], int(first.size)


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a Mooncake-format JSONL trace, plain or gzip-compressed (a name ending ``.gz``;
    ``limit``: only the first requests)."""
    p = Path(path)
    try:
        f = gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else p.open("r", encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except FileNotFoundError:
        raise TraceError(f"trace file {p} does not exist") from None
    except OSError as e:
        raise TraceError(f"cannot read trace file {p}: {e.strerror or e}") from e
    ts: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    lengths: list[int] = []
    flat: list[int] = []
    try:
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if limit is not None and len(ts) >= limit:
                    break
                try:
                    rec = json.loads(line)
                    hashes = rec["hash_ids"]
                    t, i, o = float(rec["timestamp"]), int(rec["input_length"]), int(rec.get("output_length", 0))
                except (ValueError, KeyError, TypeError) as e:
                    raise TraceError(
                        f"{p}:{lineno}: not a trace record ({e}); expected JSON with timestamp, "
                        "input_length, output_length and hash_ids"
                    ) from None
                if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                    raise TraceError(f"{p}:{lineno}: hash_ids must be a list of integers")
                if ts and t < ts[-1]:
                    raise TraceError(f"{p}:{lineno}: timestamp {t} goes back in time (previous {ts[-1]})")
                ts.append(t)
                inp.append(i)
                out.append(o)
                lengths.append(len(hashes))
                flat.extend(hashes)
    except (OSError, EOFError, UnicodeDecodeError) as e:  # a damaged gzip stream, or not text
        raise TraceError(f"cannot read trace file {p}: {e}") from None
    if not ts:
        raise TraceError(f"{p} holds no requests")
    ids, unique = _dense_ids(np.array(flat, dtype=np.int64))
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Trace(
        p.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix("_trace"),
        np.array(ts, np.float64),
        np.array(inp, np.int64),
        np.array(out, np.int64),
        offsets,
        ids,
        unique,
    )
