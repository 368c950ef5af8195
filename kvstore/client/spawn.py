"""Start a daemon on free loopback ports as a child process (tests, benchmarks, demos).

It runs ``python -m kvstore.server serve --json`` and waits (bounded) for the line that says it
is ready; :meth:`LocalDaemon.stop` sends SIGTERM and waits for the graceful shutdown.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from kvstore.errors import DaemonUnavailableError


class LocalDaemon:
    def __init__(self, proc: subprocess.Popen[str], info: dict[str, Any], log: IO[bytes]) -> None:
        self.proc = proc
        self.info = info
        self._log = log
        self._final_log = ""
        self.url: str = info["url"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._final_log = self.log()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        """What the daemon wrote to stderr so far."""
        if self._log.closed:
            return self._final_log
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: a crash, for tests."""
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> LocalDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_daemon(
    data_dir: str | os.PathLike[str],
    config: str | os.PathLike[str] | None = None,
    *,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    nofile: int | None = None,
) -> LocalDaemon:
    """A daemon on ``data_dir`` with free ports; ``config``: optional TOML ([store], [server]...).
    ``nofile``: its RLIMIT_NOFILE (soft and hard), to test what happens at the descriptor limit."""
    cmd = [sys.executable, "-m", "kvstore.server", "serve", "--json", "--data-dir", str(data_dir),
           "--http-port", "0", "--data-port", "0", "--ucx-port", "0"]
    if config is not None:
        cmd += ["--config", str(config)]
    cmd += args or []
    full_env = {**os.environ, **(env or {})}
    # The daemon must import this checkout's packages even when started from elsewhere.
    root = str(Path(__file__).resolve().parents[2])
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, full_env.get("PYTHONPATH", "")) if p)
    # stderr to a file, not a pipe: nobody drains a pipe, and a full one would block the daemon.
    log = tempfile.TemporaryFile()  # noqa: SIM115 (owned by the LocalDaemon, closed by stop)
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=full_env,
                            preexec_fn=limit if nofile is not None else None)
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if line:
                sel.close()
                return LocalDaemon(proc, json.loads(line), log)
        if proc.poll() is not None:
            break
    sel.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.seek(0)
    err = log.read().decode(errors="replace")
    log.close()
    raise DaemonUnavailableError(f"the daemon did not start (exit {proc.returncode}): {err.strip()[-2000:]}")
