"""Two engine processes share one daemon: one through shared memory, one through TCP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvstore.client.spawn import start_daemon

ROOT = Path(__file__).resolve().parents[3]


def _engine(url: str, plane: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "engine.reference.client_demo", "--url", url, "--plane", plane,
         "--users", "2", "--turns", "3", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_second_engine_process_hits_what_the_first_stored(tmp_path: Path) -> None:
    with start_daemon(tmp_path / "store") as d:
        first = _engine(d.url, "shm")
        second = _engine(d.url, "tcp")
    assert first["plane"] == "shm" and second["plane"] == "tcp"
    assert 0 < first["hit_blocks"] < first["blocks"]  # later turns reuse earlier ones
    assert second["hit_blocks"] == second["blocks"]  # everything was stored by the first


def test_unreachable_daemon_exit_code() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine.reference.client_demo", "--url", "http://127.0.0.1:9"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 3
    assert "unreachable" in out.stderr
