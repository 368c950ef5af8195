"""The README's daemon example runs as written against a daemon started here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstore.client.spawn import start_daemon

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_daemon_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    section = README.read_text().split("## The daemon", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    with start_daemon(tmp_path / "store") as d:
        monkeypatch.setenv("KVSTORE_URL", d.url)
        monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
        exec(compile(code.group(1), "README.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["shm", "64"]
