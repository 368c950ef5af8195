"""``kvstore serve``: help, configuration errors and start-up failures have meaningful exits."""

from __future__ import annotations

import os
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


def test_data_dir_problems_exit_as_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """docs/daemon.md: 2 for a usage mistake (a file given as the directory), 1 for a directory
    the daemon cannot write (root writes anywhere, so the permission check is stood in for)."""
    (tmp_path / "file").write_text("x")
    assert main(["serve", "--data-dir", str(tmp_path / "file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    import kvstore.server.cli as cli

    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    assert main(["serve", "--data-dir", str(tmp_path / "ro" / "data")]) == 1
    assert f"{tmp_path} is not writable by this user" in capsys.readouterr().err


def test_a_bad_environment_override_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSTORE_SERVER_HTTP_PORT", "abc")
    assert main(["serve", "--data-dir", str(tmp_path / "d")]) == 2
    assert "KVSTORE_SERVER_HTTP_PORT (overrides [server].http_port): expected an integer, got 'abc'" in capsys.readouterr().err
    monkeypatch.setenv("KVSTORE_SERVER_HTTP_PORT", "70000")
    assert main(["serve", "--data-dir", str(tmp_path / "d")]) == 2
    assert "KVSTORE_SERVER_HTTP_PORT (overrides [server].http_port): port 70000" in capsys.readouterr().err


def test_dram_larger_than_dev_shm_is_one_clean_error(tmp_path: Path) -> None:
    """No resource_tracker traceback after the error (a failed SharedMemory create on Python
    3.11/3.12 unregisters a name it never registered): the size is checked first."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("needs /dev/shm")
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.server", "serve", "--data-dir", str(tmp_path / "d"),
         "--http-port", "0", "--data-port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "KVSTORE_TIER_DRAM_CAPACITY_BYTES": "100TiB"},
    )
    # The configuration is checked against the machine before anything is allocated: a bad
    # configuration (exit 2, docs/daemon.md) with one line that says what to lower.
    assert out.returncode == 2
    assert "/dev/shm" in out.stderr and "lower capacity_bytes" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
