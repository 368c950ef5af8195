"""Every command answers --version with the package's version; the daemon names --data-dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.version import version

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module, prog",
    [("kvstore.server", "kvstore"), ("kvstore.ctl", "kvctl"), ("kvstore.report", "kvreport"),
     ("engine.reference.demo", "python -m engine.reference.demo"), ("tools.replay", "python -m tools.replay"),
     ("tools.bench", "python -m tools.bench"), ("kvstore.route", "python -m kvstore.route")],
)
def test_version(module: str, prog: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--version"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{prog} {version()}"


def test_every_command_line_parser_has_version() -> None:
    """Each module that builds an argparse parser (a command: the ones above, the demos, the
    replay helpers, kvreport's sample) offers --version."""
    missing = []
    for pkg in ("kvstore", "engine", "tools", "tiers", "eviction"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            text = f.read_text()
            if "argparse.ArgumentParser(" in text and '"--version", action="version"' not in text:
                missing.append(str(f.relative_to(ROOT)))
    assert not missing, f"no --version: {missing}"


def test_version_is_the_pyproject_one() -> None:
    assert f'version = "{version()}"' in (ROOT / "pyproject.toml").read_text()


def test_data_dir_that_is_a_file_is_named_by_its_flag(tmp_path: Path) -> None:
    from kvstore.server.cli import main

    f = tmp_path / "not-a-dir"
    f.write_text("")
    assert main(["serve", "--data-dir", str(f)]) == 2
