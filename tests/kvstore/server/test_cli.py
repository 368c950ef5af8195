"""``kvstore serve``: help, configuration errors and start-up failures have meaningful exits."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.server.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    assert "--config" in capsys.readouterr().out


def test_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text('[server]\nhost = "0.0.0.0"\n')
    assert main(["serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d")]) == 2
    assert "loopback" in capsys.readouterr().err
    cfg.write_text('[[tenants]]\nname = "x"\ntoken = "short"\n')
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "at least 16" in capsys.readouterr().err


def test_port_in_use_exits_1(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "kvstore.server", "serve", "--data-dir", str(tmp_path / "d"),
             "--http-port", "0", "--data-port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )
    assert out.returncode == 1
    assert "cannot run the daemon" in out.stderr
