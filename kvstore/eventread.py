"""Reading the event log (``kvstore.events``, ``[events]``): its files in order and their records,
for ``kvreport``, ``kvctl`` and the replay tools."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import zstandard

from kvstore.events import event_files


def read_events(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    since: float | None = None,
    until: float | None = None,
    types: Iterable[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Every record of the event files in ``paths`` (directories or files), file by file.

    A file still being written, or cut short by a crash, yields its records up to the last
    whole batch. ``namespace`` and ``header`` records are yielded whatever ``since``/``until``
    say (they describe, they do not happen).
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    wanted = set(types) if types is not None else None
    dctx = zstandard.ZstdDecompressor()
    for root in paths:
        if not Path(root).exists():
            raise FileNotFoundError(f"no event log at {root}: pass the events directory (default <store root>/events)")
        for f in event_files(root):
            for rec in _records(f, dctx):
                kind = rec.get("type")
                if wanted is not None and kind not in wanted:
                    continue
                if kind in ("request", "block"):
                    t = rec.get("t", 0.0)
                    if (since is not None and t < since) or (until is not None and t >= until):
                        continue
                yield rec


def _records(path: Path, dctx: zstandard.ZstdDecompressor) -> Iterator[dict[str, Any]]:
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        return  # removed by retention since the listing
    with fh:
        reader = dctx.stream_reader(fh, read_across_frames=True)
        tail = b""
        while True:
            try:
                chunk = reader.read(1 << 20)
            except zstandard.ZstdError:
                chunk = b""  # a frame cut short: what came before it is whole
            if not chunk:
                break
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            for line in lines:
                if line:
                    yield json.loads(line)
        # An unterminated last line is a record the writer never finished: skip it.
