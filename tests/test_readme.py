"""The README's in-process example runs as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_the_two_commands() -> None:
    first = README.read_text().splitlines()[:4]
    assert any(line.startswith("make demo") for line in first)
    assert any(line.startswith("make test") for line in first)


def test_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("KVSTORE_")]:
        monkeypatch.delenv(k)
    exec(compile(code.group(1), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "0 of 16 blocks cached" in out
    assert "num_blocks=16" in out
    assert (tmp_path / "kvstore-data" / "namespaces.json").exists()


def test_readme_shows_the_operator_path() -> None:
    text = README.read_text()
    for step in ("**Install**", "**Configure**", "**Run**", "**Watch**", "**Report**"):
        assert step in text
    root = README.parent
    for path in re.findall(r"`((?:deploy|docs)/[\w./-]+)`", text):
        assert (root / path).exists(), f"the README names {path}, which does not exist"
    assert "systemd" in text and "Docker" in text and "/metrics" in text and "kvreport" in text
